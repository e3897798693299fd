"""Authentication on (`auth.py`): every session, record and handle belongs to the principal that opened it.

Against a stack with static tokens for two principals, alice and bob: the
contract's tests (`tests/test_server.py`) pass again with alice's token; no
token or a bad one gets 401 and adopts or replays nothing; and every way bob
could reach alice's session (its id through HAProxy, on the replica holding
it and on one that would adopt it, `DELETE`, `resume_session`, the summary
resource, a handle, a `Last-Event-ID` replay) is answered exactly as an id
nobody minted. A JWT stack checks tokens against a real JWKS endpoint.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import time
import uuid

import httpx2
import pytest
from conftest import JWT_AUDIENCE, JWT_ISSUER, JWT_KID, ROOT
from fastmcp import Client
from fastmcp.exceptions import ToolError
from fastmcp.server.auth.providers.jwt import RSAKeyPair
from joserfc import jwk as joserfc_jwk
from joserfc import jwt as joserfc_jwt
from test_server import *  # noqa: F403 (the contract's tests, collected here again: with alice's token)

from mcp_ha import auth
from mcp_ha.handles import UNKNOWN_HANDLE
from mcp_ha.ops.check.wire import RawSession
from mcp_ha.ops.stack import Stack
from mcp_ha.resilient_client import ResilientClient
from mcp_ha.settings import Settings, SettingsError

GET_COUNTER = {"name": "get_counter", "arguments": {}}
# A call with something to stream (a call with nothing to stream is answered as JSON, and kept nowhere).
STREAMS = {"name": "analyze_data", "arguments": {"num_items": 0}}


def verifier_from_env(environ: dict[str, str]):
    """The verifier a replica with this environment builds (None: authentication off)."""
    return auth.make_verifier(Settings.from_env(environ))


@pytest.fixture
def stack(auth_stack: Stack) -> Stack:
    """For the contract's tests (and `healed_stack`): the stack with authentication on."""
    return auth_stack


@pytest.fixture
def bearer(auth_tokens: dict[str, str]) -> str:
    return auth_tokens["alice"]


def replica_url(stack: Stack, replica: str) -> str:
    return f"http://127.0.0.1:{stack.service(replica).port}/mcp"


def other_replica(stack: Stack, replica: str) -> str:
    return next(name for name in stack.config.replica_names() if name != replica)


def redis(stack: Stack, *words: str) -> object:
    """One command to the stack's Redis as its admin; an error reply fails the test instead of comparing equal."""
    reply = stack.redis_command("redis", *words)
    assert not isinstance(reply, Exception), reply
    return reply


def epoch_of(stack: Stack, session_id: str) -> str | None:
    """The session's ownership epoch in Redis (None once its record is gone): adoption and DELETE both change it."""
    return redis(stack, "HGET", f"mcp:session:{session_id}", ".epoch")


def assert_same_answer(stranger: httpx2.Response, unknown: httpx2.Response, status: int) -> None:
    """Byte for byte: nothing tells another principal's session from one that does not exist."""
    assert stranger.status_code == unknown.status_code == status, (stranger.status_code, stranger.text)
    assert stranger.headers.get("content-type") == unknown.headers.get("content-type")
    assert stranger.content == unknown.content


async def open_session(http: httpx2.AsyncClient, stack: Stack, token: str) -> tuple[RawSession, str]:
    """A session through HAProxy with one increment; and the replica it is pinned to."""
    session = RawSession(http, stack.config.mcp_url, token=token)
    await session.initialize()
    return session, (await session.call("increment_counter"))["instance"]


def stranger_and_nobody(session: RawSession, url: str, token: str) -> tuple[RawSession, RawSession]:
    """`token`'s holder speaking to `url` with `session`'s id, and with an id nobody minted."""
    unknown = session.at(url, token=token)
    unknown.session_id = uuid.uuid4().hex
    return session.at(url, token=token), unknown


# -- without a valid token ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "authorization", [None, "Bearer not-a-token-of-this-stack", "Basic YWxpY2U6c2VjcmV0", "Bearer"]
)
async def test_without_a_valid_token_nothing_is_served_adopted_or_replayed(
    http: httpx2.AsyncClient, stack: Stack, auth_tokens: dict[str, str], authorization: str | None
) -> None:
    alice, owner = await open_session(http, stack, auth_tokens["alice"])
    async with alice.stream("tools/call", STREAMS) as stream:
        last_event = [event async for event in stream][-1].id
    epoch = epoch_of(stack, alice.session_id)
    assert epoch is not None
    for url in (stack.config.mcp_url, replica_url(stack, owner), replica_url(stack, other_replica(stack, owner))):
        headers = {name: value for name, value in alice.headers().items() if name != "Authorization"}
        if authorization is not None:
            headers["Authorization"] = authorization
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": GET_COUNTER}
        fresh = {name: value for name, value in headers.items() if name != "mcp-session-id"}
        init = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-11-25",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            },
        }
        for response in (
            await http.post(url, headers=fresh, json=init),
            await http.post(url, headers=headers, json=body),
            await http.get(url, headers={**headers, "Last-Event-ID": last_event}),
            await http.delete(url, headers=headers),
        ):
            assert response.status_code == 401, (url, response.status_code, response.text)
            assert "mcp-session-id" not in response.headers
    # Not adopted (the epoch would have moved), not ended (the record would be gone).
    assert epoch_of(stack, alice.session_id) == epoch
    assert await alice.call("get_counter") == {"counter": 1, "instance": owner}


# -- another principal's session, every way in ----------------------------------------------------


@pytest.mark.parametrize("route", ["through HAProxy", "on the replica holding it", "on a replica that would adopt it"])
async def test_another_principals_session_id_is_answered_like_an_unknown_one(
    http: httpx2.AsyncClient, stack: Stack, auth_tokens: dict[str, str], route: str
) -> None:
    alice, owner = await open_session(http, stack, auth_tokens["alice"])
    url = {
        "through HAProxy": stack.config.mcp_url,
        "on the replica holding it": replica_url(stack, owner),
        "on a replica that would adopt it": replica_url(stack, other_replica(stack, owner)),
    }[route]
    epoch = epoch_of(stack, alice.session_id)
    assert epoch is not None
    bob, nobody = stranger_and_nobody(alice, url, auth_tokens["bob"])

    assert_same_answer(await bob.post("tools/call", GET_COUNTER), await nobody.post("tools/call", GET_COUNTER), 404)
    assert_same_answer(
        await bob.post("tools/call", {"name": "increment_counter", "arguments": {}}),
        await nobody.post("tools/call", {"name": "increment_counter", "arguments": {}}),
        404,
    )
    assert_same_answer(await http.get(url, headers=bob.headers()), await http.get(url, headers=nobody.headers()), 404)
    assert_same_answer(
        await http.delete(url, headers=bob.headers()), await http.delete(url, headers=nobody.headers()), 404
    )

    # Bob took nothing over and ended nothing; alice carries on where she was.
    assert epoch_of(stack, alice.session_id) == epoch
    assert await alice.call("increment_counter") == {"counter": 2, "instance": owner}


async def test_the_owner_still_adopts_her_session_when_its_replica_is_stopped(
    http: httpx2.AsyncClient, healed_stack: Stack, auth_tokens: dict[str, str]
) -> None:
    alice, owner = await open_session(http, healed_stack, auth_tokens["alice"])
    healed_stack.stop(owner)
    adopted = await alice.call("increment_counter")
    assert adopted["counter"] == 2 and adopted["instance"] != owner
    # Bound to alice in the adopter's SDK too: she keeps it, bob is a stranger there.
    assert await alice.call("increment_counter") == {"counter": 3, "instance": adopted["instance"]}
    bob, nobody = stranger_and_nobody(alice, replica_url(healed_stack, adopted["instance"]), auth_tokens["bob"])
    assert_same_answer(await bob.post("tools/call", GET_COUNTER), await nobody.post("tools/call", GET_COUNTER), 404)
    assert await alice.call("get_counter") == {"counter": 3, "instance": adopted["instance"]}


async def test_resume_session_copies_nothing_from_another_principals_session(
    connect, mcp_url: str, auth_tokens: dict[str, str]
) -> None:
    async with connect() as alice:
        await alice.call_tool("increment_counter", {})
        await alice.call_tool("add_note", {"note": "alice's"})
        alice_id = alice.transport.get_session_id()
        async with Client(mcp_url, mode="legacy", auth=auth_tokens["bob"]) as bob:
            stranger = (await bob.call_tool("resume_session", {"old_session_id": alice_id})).data
            unknown = (await bob.call_tool("resume_session", {"old_session_id": uuid.uuid4().hex})).data
            assert stranger == unknown and (stranger["status"], stranger["keys_copied"]) == ("resumed", 0)
            assert (await bob.call_tool("get_counter", {})).data["counter"] == 0
            assert (await bob.call_tool("list_notes", {})).data["notes"] == []
    # Ended, its state stays for its owner to resume, and still for nobody else.
    async with Client(mcp_url, mode="legacy", auth=auth_tokens["bob"]) as bob:
        assert (await bob.call_tool("resume_session", {"old_session_id": alice_id})).data["keys_copied"] == 0
    async with connect() as alice_again:
        assert (await alice_again.call_tool("resume_session", {"old_session_id": alice_id})).data["keys_copied"] == 2


async def test_the_summary_of_another_principals_session_reads_like_an_unknown_one(
    connect, mcp_url: str, auth_tokens: dict[str, str]
) -> None:
    async with connect() as alice, Client(mcp_url, mode="legacy", auth=auth_tokens["bob"]) as bob:
        await alice.call_tool("increment_counter", {})
        await alice.call_tool("add_note", {"note": "alice's"})
        alice_id, unknown_id = alice.transport.get_session_id(), uuid.uuid4().hex
        own = json.loads((await alice.read_resource(f"resource://session/{alice_id}/summary"))[0].text)
        assert (own["counter"], own["notes"]) == (1, ["alice's"])
        stranger = (await bob.read_resource(f"resource://session/{alice_id}/summary"))[0].text
        unknown = (await bob.read_resource(f"resource://session/{unknown_id}/summary"))[0].text
    assert stranger.replace(alice_id, unknown_id) == unknown
    assert (json.loads(unknown)["counter"], json.loads(unknown)["notes"]) == (0, [])


async def test_another_principals_handle_is_answered_like_an_unknown_one(
    mcp_url: str, auth_tokens: dict[str, str]
) -> None:
    async with Client(mcp_url, auth=auth_tokens["alice"]) as alice, Client(mcp_url, auth=auth_tokens["bob"]) as bob:
        handle = (await alice.call_tool("create_session", {})).data["session_id"]
        await alice.call_tool("increment_counter", {"session_id": handle})
        bobs = (await bob.call_tool("create_session", {})).data["session_id"]
        for foreign in (handle, uuid.uuid4().hex):
            for tool in ("increment_counter", "end_session"):
                with pytest.raises(ToolError) as refused:
                    await bob.call_tool(tool, {"session_id": foreign})
                assert str(refused.value) == UNKNOWN_HANDLE
        resumed = (await bob.call_tool("resume_session", {"old_session_id": handle, "session_id": bobs})).data
        assert (resumed["status"], resumed["keys_copied"]) == ("resumed", 0)
        assert (await alice.call_tool("get_counter", {"session_id": handle})).data["counter"] == 1


@pytest.mark.parametrize("route", ["through HAProxy", "on another replica"])
async def test_another_principals_stream_is_not_replayed(
    http: httpx2.AsyncClient, stack: Stack, auth_tokens: dict[str, str], route: str
) -> None:
    alice, owner = await open_session(http, stack, auth_tokens["alice"])
    async with alice.stream("tools/call", STREAMS) as stream:
        events = [event async for event in stream]
    first = events[0].id
    url = stack.config.mcp_url if route == "through HAProxy" else replica_url(stack, other_replica(stack, owner))
    bob, nobody = stranger_and_nobody(alice, url, auth_tokens["bob"])
    assert_same_answer(
        await http.get(url, headers={**bob.headers(), "Last-Event-ID": first}),
        await http.get(url, headers={**nobody.headers(), "Last-Event-ID": first}),
        404,
    )
    # Alice resumes her own stream there: the answer she had already been sent.
    async with alice.at(url).resume(first) as resumed:
        assert resumed.response.status_code == 200
        replayed = [event async for event in resumed]
    assert replayed[-1].message == events[-1].message


async def test_an_authenticated_session_stays_in_redis_compact_encoding_within_the_byte_target(
    http: httpx2.AsyncClient, stack: Stack, auth_tokens: dict[str, str]
) -> None:
    """The owner is a 32-hex digest: the hash stays a listpack, and a session holding a counter and
    three notes (bench.py's) stays within the 288 bytes the README promises (248 unauthenticated)."""
    alice, _ = await open_session(http, stack, auth_tokens["alice"])
    for note in ("one", "two", "three"):
        await alice.call("add_note", {"note": note})
    key = f"mcp:session:{alice.session_id}"
    # The digest of the principal the SDK names: (client_id, issuer, subject).
    principal = json.dumps(["alice", None, "alice"], separators=(",", ":")).encode()
    assert redis(stack, "HGET", key, ".owner") == json.dumps(hashlib.blake2b(principal, digest_size=16).hexdigest())
    assert redis(stack, "OBJECT", "ENCODING", key) == "listpack"
    assert 0 < redis(stack, "MEMORY", "USAGE", key) <= 288


# -- JWT ------------------------------------------------------------------------------------------


def jwt(keys: RSAKeyPair, subject: str = "carol", **claims: object) -> str:
    options = {"issuer": JWT_ISSUER, "audience": JWT_AUDIENCE, "kid": JWT_KID, **claims}
    return keys.create_token(subject=subject, **options)


async def test_a_jwt_signed_by_the_jwks_key_for_this_issuer_and_audience_is_served(
    http: httpx2.AsyncClient, jwt_stack: Stack, jwt_keys: RSAKeyPair
) -> None:
    carol = RawSession(http, jwt_stack.config.mcp_url, token=jwt(jwt_keys))
    await carol.initialize()
    assert (await carol.call("increment_counter"))["counter"] == 1
    # Another subject of the same issuer is another principal.
    dave, nobody = stranger_and_nobody(carol, jwt_stack.config.mcp_url, jwt(jwt_keys, "dave"))
    assert_same_answer(await dave.post("tools/call", GET_COUNTER), await nobody.post("tools/call", GET_COUNTER), 404)
    # A new token for the same subject is the same principal.
    assert (await carol.at(carol.url, token=jwt(jwt_keys)).call("increment_counter"))["counter"] == 2


def jwt_without_subject(keys: RSAKeyPair) -> str:
    """Signed like `jwt`, valid in every way but one: no `sub` (RSAKeyPair.create_token always sets one)."""
    now = int(time.time())
    key = joserfc_jwk.RSAKey.import_key(keys.private_key.get_secret_value())
    claims = {"iss": JWT_ISSUER, "aud": JWT_AUDIENCE, "iat": now, "exp": now + 600}
    return joserfc_jwt.encode({"alg": "RS256", "kid": JWT_KID}, claims, key)


@pytest.mark.parametrize(
    "case", ["wrong issuer", "wrong audience", "expired", "wrong key", "unknown key id", "no subject"]
)
async def test_a_jwt_that_does_not_verify_gets_401(
    http: httpx2.AsyncClient, jwt_stack: Stack, jwt_keys: RSAKeyPair, case: str
) -> None:
    token = {
        "wrong issuer": lambda: jwt(jwt_keys, issuer="https://elsewhere.invalid"),
        "wrong audience": lambda: jwt(jwt_keys, audience="another-service"),
        "expired": lambda: jwt(jwt_keys, expires_in_seconds=-600),
        "wrong key": lambda: jwt(RSAKeyPair.generate()),
        "unknown key id": lambda: jwt(jwt_keys, kid="another-key"),
        "no subject": lambda: jwt_without_subject(jwt_keys),
    }[case]()
    session = RawSession(http, jwt_stack.config.mcp_url, token=token)
    response = await session.post(
        "initialize", {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
    )
    assert response.status_code == 401, response.text
    assert "mcp-session-id" not in response.headers


# -- settings -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"MCP_AUTH": "bearer"}, "MCP_AUTH='bearer'"),
        ({"MCP_AUTH": "static"}, "needs MCP_AUTH_TOKENS"),
        ({"MCP_AUTH": "static", "MCP_AUTH_TOKENS": "alice:short"}, "shorter than 16"),
        ({"MCP_AUTH": "static", "MCP_AUTH_TOKENS": "t" * 20}, "entry 1 is not name:token"),
        ({"MCP_AUTH": "static", "MCP_AUTH_TOKENS": "a:" + "t" * 20 + ",b:" + "t" * 20}, "share a token"),
        ({"MCP_AUTH": "jwt", "MCP_AUTH_JWKS_URL": "https://idp.invalid/jwks"}, "MCP_AUTH_ISSUER, MCP_AUTH_AUDIENCE"),
        (
            {
                "MCP_AUTH": "jwt",
                "MCP_AUTH_JWKS_URL": "http://idp.invalid/jwks",
                "MCP_AUTH_ISSUER": "i",
                "MCP_AUTH_AUDIENCE": "a",
            },
            "http on loopback only",
        ),
        (
            {
                "MCP_AUTH": "jwt",
                "MCP_AUTH_JWKS_URL": "https://idp.invalid/jwks",
                "MCP_AUTH_ISSUER": "i",
                "MCP_AUTH_AUDIENCE": "a",
                "MCP_AUTH_ALGORITHM": "HS256",
            },
            "asymmetric",
        ),
        (
            {
                "MCP_AUTH": "jwt",
                "MCP_AUTH_JWKS_URL": "https://idp.invalid/jwks",
                "MCP_AUTH_ISSUER": "i",
                "MCP_AUTH_AUDIENCE": "a",
                "MCP_AUTH_ALGORITHM": "none",
            },
            "Unsupported algorithm",
        ),
    ],
)
@pytest.mark.quick
def test_settings_that_cannot_work_are_refused_by_name(environ: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as refused:
        verifier_from_env(environ)
    assert message in str(refused.value)
    for token in (value.split(":", 1)[-1] for value in environ.values() if "t" * 20 in value):
        assert token not in str(refused.value)


@pytest.mark.quick
def test_authentication_is_off_unless_asked_for() -> None:
    assert verifier_from_env({}) is None
    assert verifier_from_env({"MCP_AUTH": "none", "MCP_AUTH_TOKENS": "ignored"}) is None
    assert isinstance(verifier_from_env({"MCP_AUTH": "static", "MCP_AUTH_TOKENS": "a:" + "t" * 20}), auth.TokenVerifier)


@pytest.mark.slow
def test_a_replica_with_unworkable_auth_settings_refuses_to_start() -> None:
    env = {"PATH": "/usr/bin:/bin", "MCP_AUTH": "jwt", "MCP_AUTH_JWKS_URL": "https://idp.invalid/jwks"}
    done = subprocess.run(
        [sys.executable, "-m", "server"], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode != 0
    assert "MCP_AUTH=jwt needs MCP_AUTH_ISSUER, MCP_AUTH_AUDIENCE" in done.stderr
    assert "Traceback" not in done.stderr


async def test_a_resilient_client_with_a_token_rides_through_a_stop_and_ends_its_session(
    http: httpx2.AsyncClient, healed_stack: Stack, auth_tokens: dict[str, str]
) -> None:
    async with ResilientClient(healed_stack.config.mcp_url, auth=auth_tokens["alice"]) as client:
        first = await client.call_tool("increment_counter", {})
        healed_stack.stop(first.data["instance"])
        assert (await client.call_tool("increment_counter", {})).data["counter"] == 2
        session_id = client.session_id
    # Its DELETE carried the token, so the session ended rather than lingering until its TTL.
    alice = RawSession(http, healed_stack.config.mcp_url, token=auth_tokens["alice"])
    alice.session_id = session_id
    assert (await alice.post("tools/call", GET_COUNTER)).status_code == 404


def store_work(metrics_text: str) -> float:
    """Store operations a replica has made, its health checks' pings aside (they run on their own clock)."""
    found = re.findall(r'^mcp_store_operation_duration_seconds_count\{operation="([^"]+)"\} (\S+)$', metrics_text, re.M)
    return sum(float(count) for operation, count in found if operation != "ping")


async def test_a_stranger_costs_the_holding_replica_the_store_work_an_unknown_id_does(
    http: httpx2.AsyncClient, stack: Stack, auth_tokens: dict[str, str]
) -> None:
    """No oracle in the store's work either: the SDK refuses a stranger without the store, an unknown id costs
    a read of its owner."""
    alice, owner = await open_session(http, stack, auth_tokens["alice"])
    metrics = f"http://127.0.0.1:{stack.service(owner).port}/metrics"
    bob, nobody = stranger_and_nobody(alice, replica_url(stack, owner), auth_tokens["bob"])
    work = []
    for session in (bob, nobody):
        before = store_work((await http.get(metrics)).text)
        assert (await session.post("tools/call", GET_COUNTER)).status_code == 404
        work.append(store_work((await http.get(metrics)).text) - before)
    assert work[0] == work[1] > 0, work
