"""HAProxy in front of the replicas: config, stickiness, spreading, failover and state that survives it."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from conftest import running_stack, starts
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from mcp_ha.drain import BALANCER_CHECK_HEADER
from mcp_ha.ops.check.wire import CallFailed, RawSession, SessionlessSession
from mcp_ha.ops.stack import Stack, free_ports, read_stats_csv

CONFIG = Path(__file__).resolve().parents[2] / "haproxy" / "haproxy.cfg"


def haproxy_check(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["haproxy", "-c", "-f", str(CONFIG)], env={**os.environ, **env}, capture_output=True, text=True
    )


def test_config_is_valid_with_the_local_stacks_environment(stack: Stack) -> None:
    haproxy = stack.service("haproxy")
    result = haproxy_check(haproxy.env)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.haproxy
def test_config_rejects_a_broken_address() -> None:
    # Proves the check above can fail: the server addresses really come from the environment.
    result = haproxy_check({"MCP_SERVER_1": "127.0.0.1:not-a-port"})
    assert result.returncode != 0


def test_each_haproxy_of_a_pair_must_say_which_peer_it_is(stack: Stack) -> None:
    """A local name missing from the peers would make HAProxy drop the section and share nothing: refused."""
    peers = {"HAPROXY_PEER_1": "127.0.0.1:1", "HAPROXY_PEER_2": "127.0.0.1:2"}
    outcomes = {}
    for local in (None, "haproxy-1", "haproxy-2", "haproxy-3", "haproxy"):
        env = {**stack.service("haproxy").env, **peers, **({"HAPROXY_LOCAL_PEER": local} if local else {})}
        outcomes[local] = haproxy_check(env).returncode == 0
    assert outcomes == {None: False, "haproxy-1": True, "haproxy-2": True, "haproxy-3": False, "haproxy": False}


def test_stick_table_expiry_follows_the_session_ttl_setting(stack: Stack) -> None:
    assert stack.service("haproxy").env["SESSION_TTL_SECONDS"] == str(stack.config.session_ttl_seconds)
    for replica in stack.config.replica_names():
        assert stack.service(replica).env["SESSION_TTL_SECONDS"] == str(stack.config.session_ttl_seconds)
    assert 'expire "${SESSION_TTL_SECONDS-1800}s"' in CONFIG.read_text()


async def test_haproxys_log_is_json_naming_each_requests_id_and_session(stack: Stack, raw: RawSession) -> None:
    """One JSON object per request, as the replicas log theirs: its session (sent, or answered to an
    initialize) and its request id, which the replica that served it logs too, so one grep follows a call
    through both. A request whose path holds a backslash still makes valid JSON."""
    answered = await raw.call("increment_counter")
    await raw.http.get(raw.url.replace("/mcp", '/x"\\y'))
    deadline = time.monotonic() + 10  # HAProxy writes a request's line once the request has ended
    while True:
        text = (stack.log_dir / "haproxy.log").read_text()
        # Whole lines only: HAProxy may be writing the last one as it is read.
        whole = [line for line in text.splitlines(keepends=True) if line.startswith("{") and line.endswith("\n")]
        lines = [json.loads(line) for line in whole]
        mine = [line for line in lines if line["session_id"] == raw.session_id]
        if any(line["uri"] == "/x%22\\y" for line in lines) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert mine and all(line["frontend"] == "mcp" and line["method"] == "POST" for line in mine), mine
    assert mine[0]["status"] == 200 and mine[0]["server"] == answered["instance"]
    served = (stack.log_dir / f"{mine[-1]['server']}.log").read_text()
    assert mine[-1]["request_id"] and mine[-1]["request_id"] in served
    assert any(line["uri"] == "/x%22\\y" and line["status"] == 404 for line in lines)  # the client's encoding
    long = "/" + "%5C" * 3000  # past the 1 KiB of a URI the log keeps (tune.http.logurilen): one whole line
    await raw.http.get(raw.url.replace("/mcp", long))
    await asyncio.sleep(0.5)
    tail = (stack.log_dir / "haproxy.log").read_text().splitlines()
    [uri] = [json.loads(line)["uri"] for line in tail if line.startswith("{") and long[:40] in line]
    assert long.startswith(uri) and 1000 <= len(uri) < 1024, len(uri)  # the request line's first 1 KiB


async def test_a_session_sticks_to_one_replica(raw: RawSession) -> None:
    results = [await raw.call("increment_counter") for _ in range(10)]
    assert [r["counter"] for r in results] == list(range(1, 11))
    assert len({r["instance"] for r in results}) == 1


async def test_new_sessions_spread_across_replicas(http: httpx2.AsyncClient, mcp_url: str) -> None:
    instances = set()
    sessions = [RawSession(http, mcp_url) for _ in range(12)]
    for session in sessions:
        await session.initialize()
    # Each new session goes to the next replica in turn.
    results = await asyncio.gather(*(s.call("analyze_data", {"num_items": 2}) for s in sessions))
    instances = {r["instance"] for r in results}
    assert len(instances) >= 2, instances


async def admitted(raw: RawSession, tool: str, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
    """The call, sent again while the replica answers 429 (past MAX_CALLS_PER_SESSION): a refused call applied
    nothing, so the totals below still count each call once."""
    for _ in range(200):
        try:
            return await raw.call_tool(tool, arguments)
        except CallFailed as exc:
            if not str(exc).startswith("HTTP 429"):
                raise
            await asyncio.sleep(0.05)
    raise AssertionError(f"{tool} was refused 200 times")


async def test_200_concurrent_increments_on_one_session_end_at_200(raw: RawSession) -> None:
    results = await asyncio.gather(*(admitted(raw, "increment_counter") for _ in range(200)))
    assert sorted(r["counter"] for r in results) == list(range(1, 201))
    assert (await raw.call("get_counter"))["counter"] == 200


async def test_200_concurrent_notes_on_one_session_are_all_kept(raw: RawSession) -> None:
    results = await asyncio.gather(*(admitted(raw, "add_note", {"note": f"n{i}"}) for i in range(200)))
    assert sorted(r["notes_count"] for r in results) == list(range(1, 201))
    notes = (await raw.call("list_notes"))["notes"]
    assert sorted(notes) == sorted(f"n{i}" for i in range(200))


async def test_stopping_a_sessions_replica_keeps_its_state(
    healed_stack: Stack, http: httpx2.AsyncClient, mcp_url: str
) -> None:
    old = RawSession(http, mcp_url)
    await old.initialize()
    for _ in range(3):
        replica = (await old.call("increment_counter"))["instance"]
    await old.call("add_note", {"note": "survive-crash"})

    healed_stack.stop(replica)

    new = RawSession(http, mcp_url)
    await new.initialize()
    resumed = await new.call("resume_session", {"old_session_id": old.session_id})
    assert resumed["instance"] != replica
    assert (resumed["status"], resumed["keys_copied"]) == ("resumed", 2)
    after = await new.call("increment_counter")
    assert after["counter"] == 4
    assert (await new.call("list_notes"))["notes"] == ["survive-crash"]


@pytest.mark.timeout(120)
async def test_state_survives_restarting_every_replica(healed_stack: Stack, raw: RawSession) -> None:
    await raw.call("increment_counter")
    await raw.call("add_note", {"note": "before restart"})
    for replica in healed_stack.config.replica_names():
        healed_stack.restart(replica)
    fresh = RawSession(raw.http, raw.url)
    await fresh.initialize()
    assert (await fresh.call("resume_session", {"old_session_id": raw.session_id}))["keys_copied"] == 2
    assert (await fresh.call("get_counter"))["counter"] == 1
    assert (await fresh.call("list_notes"))["notes"] == ["before restart"]


async def test_stats_page_lists_every_replica_up(stack: Stack, http: httpx2.AsyncClient) -> None:
    page = await http.get(stack.config.stats_url, auth=stack.config.stats_auth)
    assert page.status_code == 200
    assert stack.backend_status() == {name: "UP" for name in stack.config.replica_names()}


# -- the stats port, request limits and headers (issue 6) ------------------------------


async def test_the_stats_port_needs_the_stacks_credentials(stack: Stack, http: httpx2.AsyncClient) -> None:
    base = stack.config.stats_url.removesuffix("/stats")
    for path in ("/stats", "/stats;csv", "/metrics"):
        assert (await http.get(base + path)).status_code == 401, path
        assert (await http.get(base + path, auth=(stack.config.stats_user, "wrong"))).status_code == 401, path
        assert (await http.get(base + path, auth=stack.config.stats_auth)).status_code == 200, path
    assert stack.service("haproxy").env["HAPROXY_STATS_PASSWORD"] == stack.config.stats_password
    assert len(stack.config.stats_password) >= 20


def test_haproxy_refuses_to_start_without_a_stats_password(stack: Stack) -> None:
    env = {k: v for k, v in stack.service("haproxy").env.items() if k != "HAPROXY_STATS_PASSWORD"}
    result = subprocess.run(
        ["haproxy", "-c", "-f", str(CONFIG)],
        capture_output=True,
        text=True,
        env={k: v for k, v in {**os.environ, **env}.items() if k != "HAPROXY_STATS_PASSWORD"},
    )
    assert result.returncode != 0
    assert "HAPROXY_STATS_PASSWORD is not set" in result.stdout + result.stderr


async def test_a_body_over_the_limit_is_refused_by_haproxy(raw: RawSession) -> None:
    # 2 MB: over HAProxy's 1 MB default, under the replica's own 4 MB limit, so the 413 is HAProxy's.
    response = await raw.post("tools/call", {"name": "add_note", "arguments": {"note": "x" * (2 * 1024 * 1024)}})
    assert response.status_code == 413
    assert "mcp-session-id" not in {k.lower() for k in response.headers}
    # The replica's answer for a chunked body it refuses itself (mcp_ha/limits.py), so a client gets one kind.
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"] == {"code": -32600, "message": "Request body over 1048576 bytes"}
    # Under the limit, a large body reaches a replica. (Not a note: add_note keeps at most 10,000 characters.)
    assert (await raw.call("resume_session", {"old_session_id": "x" * 100_000}))["keys_copied"] == 0


async def test_a_request_with_an_origin_is_refused_unless_listed(
    stack: Stack, raw: RawSession, http: httpx2.AsyncClient
) -> None:
    # No origin is allowed by default; clients that are not browsers send none.
    health = stack.config.mcp_url.removesuffix("/mcp") + "/health"
    assert (await http.get(health)).status_code == 200
    for origin in ("http://evil.example", f"http://127.0.0.1:{stack.config.http_port}", "null", ""):
        assert (await http.get(health, headers={"Origin": origin})).status_code == 403, origin
    assert (await raw.call("increment_counter"))["counter"] == 1


def _access_lines(stack: Stack, marker: str) -> list[str]:
    return [
        line
        for name in stack.config.replica_names()
        for line in (stack.log_dir / f"{name}.log").read_text().splitlines()
        if marker in line
    ]


async def test_forged_forwarding_headers_do_not_reach_the_replicas(stack: Stack, http: httpx2.AsyncClient) -> None:
    """Replicas (uvicorn) take X-Forwarded-For from their proxy as the client's address, and log it."""
    forged = {"X-Forwarded-For": "203.0.113.7", "X-Forwarded-Proto": "https", "Forwarded": "for=203.0.113.8"}
    via_haproxy, direct = uuid.uuid4().hex, uuid.uuid4().hex
    base = stack.config.mcp_url.removesuffix("/mcp")
    assert (await http.get(f"{base}/health?probe={via_haproxy}", headers=forged)).status_code == 200
    # The control: sent straight to a replica from 127.0.0.1, the forged address is believed.
    replica = stack.config.replica_ports[0]
    assert (await http.get(f"http://127.0.0.1:{replica}/health?probe={direct}", headers=forged)).status_code == 200
    deadline = asyncio.get_running_loop().time() + 5
    while not (_access_lines(stack, via_haproxy) and _access_lines(stack, direct)):
        assert asyncio.get_running_loop().time() < deadline, "no access log line for the probes"
        await asyncio.sleep(0.1)
    assert "203.0.113.7" in _access_lines(stack, direct)[0]
    (line,) = _access_lines(stack, via_haproxy)
    assert "127.0.0.1" in line and "203.0.113" not in line, line


async def test_listed_origins_are_served(limited_stack: Stack, http: httpx2.AsyncClient) -> None:
    health = limited_stack.config.mcp_url.removesuffix("/mcp") + "/health"
    for origin, status in (
        ("http://app.example", 200),
        ("HTTPS://other.example:8443", 200),
        ("http://app.example.evil", 403),
        ("http://evil.example", 403),
        (None, 200),
    ):
        headers = {"Origin": origin} if origin is not None else {}
        assert (await http.get(health, headers=headers)).status_code == status, origin


@pytest.mark.timeout(60)
async def test_a_flood_from_one_address_gets_429_and_the_stack_stays_healthy(
    limited_stack: Stack, http: httpx2.AsyncClient
) -> None:
    session = RawSession(http, limited_stack.config.mcp_url)
    await session.initialize()
    # Under the limit (40 per 10 s; the test above used 5): served.
    assert [(await session.call("increment_counter"))["counter"] for _ in range(5)] == [1, 2, 3, 4, 5]
    health = limited_stack.config.mcp_url.removesuffix("/mcp") + "/health"
    statuses = Counter()
    for _ in range(4):
        batch = await asyncio.gather(*(http.get(health) for _ in range(25)))
        statuses.update(r.status_code for r in batch)
    assert statuses[429] >= 50, statuses
    assert set(statuses) <= {200, 429}, statuses
    # The refusal says why and when to come back (the rate is over a 10 s window).
    refused = next(r for r in batch if r.status_code == 429)
    assert refused.headers["retry-after"] == "10"
    assert refused.json()["error"]["message"] == "Too many requests from this address; retry later"
    # Refused at HAProxy: the replica and HAProxy are as healthy as before.
    replica = limited_stack.config.replica_ports[0]
    assert (await http.get(f"http://127.0.0.1:{replica}/health")).status_code == 200
    assert limited_stack.healthy("haproxy") and limited_stack.healthy("mcp-server-1")


# -- connections per client address (issue 17) -------------------------------------------

# A stack whose HAProxy serves CAP connections per client address. Every test client comes from 127.0.0.1,
# so each test below stands for a client of its own by connecting from another loopback address.
CAP = 8


@pytest.fixture(scope="module")
@starts("redis", "haproxy", "slow")
def capped_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("capped"), replicas=1, max_conn_per_source=CAP) as s:
        yield s


def _connect(stack: Stack, source: str) -> socket.socket:
    return socket.create_connection((stack.config.host, stack.config.http_port), timeout=10, source_address=(source, 0))


def _get(sock: socket.socket, path: str = "/health") -> tuple[int, dict[str, str], bytes] | None:
    """One GET on a kept-alive connection: (status, headers, body), or None if the connection ends unanswered."""
    try:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: mcp\r\n\r\n".encode())
        reply = sock.makefile("rb")
        status_line = reply.readline()
        if not status_line:
            return None
        headers = {}
        while (line := reply.readline().decode()) not in ("\r\n", ""):
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return int(status_line.split()[1]), headers, reply.read(int(headers.get("content-length", 0)))
    except (ConnectionResetError, BrokenPipeError):
        return None


def _status(sock: socket.socket) -> int | None:
    reply = _get(sock)
    return reply[0] if reply else None


def _ended(sock: socket.socket) -> bool:
    """Whether the peer closed the connection (nothing more to read), waiting at most the socket's timeout."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _open_connections(stack: Stack) -> int:
    """The MCP frontend's open client connections, from HAProxy's stats."""
    rows = csv.DictReader(io.StringIO(read_stats_csv(stack.config.stats_url, *stack.config.stats_auth).lstrip("# ")))
    return next(int(row["scur"]) for row in rows if (row["pxname"], row["svname"]) == ("mcp", "FRONTEND"))


def _wait_for_open_connections(stack: Stack, count: int) -> None:
    deadline = time.monotonic() + 10
    while _open_connections(stack) != count:
        assert time.monotonic() < deadline, f"{_open_connections(stack)} connections open, not {count}"
        time.sleep(0.05)


def test_a_request_on_a_connection_over_the_cap_gets_429_and_others_are_served(capped_stack: Stack) -> None:
    with contextlib.ExitStack() as held:
        served = [held.enter_context(_connect(capped_stack, "127.0.0.2")) for _ in range(CAP)]
        assert [_status(sock) for sock in served] == [200] * CAP
        beyond = held.enter_context(_connect(capped_stack, "127.0.0.2"))
        reply = _get(beyond)
        assert reply is not None
        status, headers, body = reply
        assert status == 429 and headers["retry-after"] == "1"
        assert "close some" in json.loads(body)["error"]["message"]
        # Closed with the answer, so the refused connection does not keep a slot either.
        assert headers["connection"] == "close" and _ended(beyond)
        # The connections within the cap go on serving, and another address is served at once.
        assert _status(served[0]) == 200
        with _connect(capped_stack, "127.0.0.3") as other:
            assert _status(other) == 200
        # A connection closed makes room for a new one.
        served.pop().close()
        _wait_for_open_connections(capped_stack, CAP - 1)
        with _connect(capped_stack, "127.0.0.2") as again:
            assert _status(again) == 200


@pytest.mark.timeout(60)
def test_idle_connections_far_over_the_cap_are_refused_then_dropped(capped_stack: Stack) -> None:
    """An address holding connections it sends nothing on: past twice the cap, new ones are closed as they
    are accepted; the idle ones are closed by `timeout http-request`, and the address is served again."""
    with contextlib.ExitStack() as held:
        idle = [held.enter_context(_connect(capped_stack, "127.0.0.4")) for _ in range(2 * CAP + 1)]
        _wait_for_open_connections(capped_stack, 2 * CAP + 1)
        for _ in range(3):
            assert _refused_at_connect(capped_stack, "127.0.0.4")
        # Meanwhile another address is served.
        with _connect(capped_stack, "127.0.0.5") as other:
            assert _status(other) == 200
        # The idle ones do not hold their slots for long (timeout http-request, 10 s).
        deadline = time.monotonic() + 30
        for sock in idle:
            sock.settimeout(max(deadline - time.monotonic(), 0.1))
            assert _ended_or_408(sock), "an idle connection was kept open"
        _wait_for_open_connections(capped_stack, 0)
        with _connect(capped_stack, "127.0.0.4") as back:
            assert _status(back) == 200


def _refused_at_connect(stack: Stack, source: str) -> bool:
    """A connection closed as soon as it is accepted: reset (even before connect returns), no HTTP answer."""
    try:
        with _connect(stack, source) as sock:
            return _get(sock) is None
    except ConnectionResetError:
        return True


def _ended_or_408(sock: socket.socket) -> bool:
    """Closed by the peer, with nothing said or only a 408 (HAProxy's answer to a request that never came)."""
    try:
        data = sock.recv(4096)
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return data == b"" or (data.startswith(b"HTTP/1.1 408") and _ended(sock))


def test_the_default_caps_are_the_stacks(stack: Stack) -> None:
    """The local stack passes its settings; haproxy.cfg's own defaults are the same numbers."""
    from mcp_ha.ops.stack import DEFAULT_MAX_CONN_PER_SOURCE, DEFAULT_RATE_LIMIT

    env = stack.service("haproxy").env
    assert env["HAPROXY_MAX_CONN_PER_SOURCE"] == str(DEFAULT_MAX_CONN_PER_SOURCE)
    assert env["HAPROXY_RATE_LIMIT"] == str(DEFAULT_RATE_LIMIT)
    cfg = CONFIG.read_text()
    assert cfg.count(f'"${{HAPROXY_MAX_CONN_PER_SOURCE-{DEFAULT_MAX_CONN_PER_SOURCE}}}"') == 2
    assert cfg.count(f'"${{HAPROXY_RATE_LIMIT-{DEFAULT_RATE_LIMIT}}}"') == 1


# -- TLS (issue 6) ----------------------------------------------------------------------


def _trusting(cert: Path) -> ssl.SSLContext:
    """A client context trusting exactly the stack's self-signed certificate, hostname checked."""
    return ssl.create_default_context(cafile=str(cert))


async def test_an_mcp_session_over_tls_with_the_stacks_certificate(stack: Stack) -> None:
    async with httpx2.AsyncClient(verify=_trusting(stack.config.tls_cert), timeout=30) as https:
        session = RawSession(https, stack.config.mcp_https_url)
        await session.initialize()
        assert (await session.call("increment_counter"))["counter"] == 1
        assert (await session.call("add_note", {"note": "over tls"}))["notes_count"] == 1
        assert (await session.call("get_counter"))["counter"] == 1
    # One frontend behind both addresses: plain HTTP still serves, the same session included.
    async with httpx2.AsyncClient(timeout=30) as http:
        plain = RawSession(http, stack.config.mcp_url)
        plain.session_id = session.session_id
        assert (await plain.call("increment_counter"))["counter"] == 2


async def test_a_client_that_does_not_trust_the_certificate_is_refused(stack: Stack) -> None:
    # The system's CAs did not sign it, so it proves nothing to a client that has not been given it.
    async with httpx2.AsyncClient(timeout=10) as untrusting:
        with pytest.raises(httpx2.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await untrusting.get(stack.config.mcp_https_url.removesuffix("/mcp") + "/health")


def test_the_certificate_names_the_stack_and_its_key_is_private(stack: Stack) -> None:
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(stack.config.tls_cert.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == [stack.config.host]
    assert b"PRIVATE KEY" not in stack.config.tls_cert.read_bytes()
    assert b"PRIVATE KEY" in stack.config.tls_pem.read_bytes()
    assert stack.config.tls_pem.stat().st_mode & 0o077 == 0
    assert stack.service("haproxy").env["HAPROXY_TLS_CERT"] == str(stack.config.tls_pem)


def test_config_is_valid_without_tls_and_reads_the_tls_variables(stack: Stack, tmp_path: Path) -> None:
    env = {k: v for k, v in {**os.environ, **stack.service("haproxy").env}.items() if not k.startswith("HAPROXY_TLS_")}
    for unset in ({}, {"HAPROXY_TLS_CERT": ""}):  # empty, as compose passes an unset variable: no TLS either
        plain = subprocess.run(
            ["haproxy", "-c", "-f", str(CONFIG)], env={**env, **unset}, capture_output=True, text=True
        )
        assert plain.returncode == 0, plain.stdout + plain.stderr
    for tls in (
        {"HAPROXY_TLS_CERT": str(tmp_path / "missing.pem")},
        {"HAPROXY_TLS_CERT": str(stack.config.tls_pem), "HAPROXY_TLS_BIND": "127.0.0.1:not-a-port"},
    ):
        broken = subprocess.run(
            ["haproxy", "-c", "-f", str(CONFIG)], env={**env, **tls}, capture_output=True, text=True
        )
        assert broken.returncode != 0, tls


async def test_haproxy_tells_replicas_the_clients_scheme_and_not_what_the_client_claims(
    stack: Stack, header_probe: tuple[dict[str, str], list[dict[str, str]]]
) -> None:
    urls, seen = header_probe
    forged = {"X-Forwarded-Proto": "https", "Forwarded": "proto=https"}
    async with httpx2.AsyncClient(verify=_trusting(stack.config.tls_cert), timeout=10) as client:
        for scheme, expected in (("http", None), ("https", "https")):
            probe = uuid.uuid4().hex
            assert (await client.get(f"{urls[scheme]}/mcp?{probe}", headers=forged)).status_code == 200
            (headers,) = [h for h in seen if h[":path"] == f"/mcp?{probe}"]
            assert headers.get("x-forwarded-proto") == expected, (scheme, headers)
            assert "forwarded" not in headers
            assert headers["x-forwarded-for"] == "127.0.0.1"


async def test_only_haproxys_health_checks_carry_the_balancer_check_header(
    stack: Stack, header_probe: tuple[dict[str, str], list[dict[str, str]]]
) -> None:
    """A draining replica waits for two of HAProxy's checks (drain.py); a client's forged header would
    count as one and let it exit while HAProxy still sends it requests."""
    urls, seen = header_probe
    probe = uuid.uuid4().hex
    async with httpx2.AsyncClient(timeout=10) as client:
        response = await client.get(f"{urls['http']}/health?{probe}", headers={BALANCER_CHECK_HEADER: "1"})
    assert response.status_code == 200
    (forged,) = [h for h in seen if h[":path"] == f"/health?{probe}"]
    assert BALANCER_CHECK_HEADER not in forged
    # Each names this HAProxy (host/pid), the same in every check, so a replica can count its checks apart.
    names = {h.get(BALANCER_CHECK_HEADER) for h in seen if h[":path"] == "/health"}
    assert len(names) == 1 and None not in names
    host, _, pid = names.pop().rpartition("/")
    assert host == socket.gethostname() and pid.isdigit()


# -- routing the client does not choose (issue 25) ---------------------------------------

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _h2_frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _h2_streams_answered(sock: socket.socket, streams: int, path: str = "/health") -> tuple[bytes, int]:
    """An HTTP/2 client with prior knowledge: the preface, then `streams` GETs of `path` at once on this one
    connection. (The server's first bytes, how many of the streams it answered.)"""
    # HPACK without Huffman: :method GET and :scheme http from the static table (2, 6), :path and
    # :authority as literals under the table's names (4, 1).
    block = b"\x82\x86\x04" + bytes([len(path)]) + path.encode() + b"\x01\x03mcp"
    sock.sendall(
        H2_PREFACE + _h2_frame(4, 0, 0) + b"".join(_h2_frame(1, 0x5, 2 * i + 1, block) for i in range(streams))
    )
    received, answered = b"", set()
    while len(answered) < streams and not received.startswith(b"HTTP/"):
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        received += chunk
        frames = received
        while len(frames) >= 9 and len(frames) >= 9 + int.from_bytes(frames[:3], "big"):
            stream = int.from_bytes(frames[5:9], "big") & 0x7FFFFFFF
            if frames[3] == 1 and stream:  # HEADERS of a response
                answered.add(stream)
            frames = frames[9 + int.from_bytes(frames[:3], "big") :]
    return received[:16], len(answered)


def test_http2_with_prior_knowledge_is_refused_on_both_addresses(stack: Stack) -> None:
    """HTTP/2 would carry up to 100 requests at once on each connection the per-address cap counts."""
    with socket.create_connection((stack.config.host, stack.config.http_port), timeout=5) as plain:
        first, answered = _h2_streams_answered(plain, 10)
    assert answered == 0 and (first == b"" or first.startswith(b"HTTP/1.")), first
    tls = _trusting(stack.config.tls_cert)
    tls.set_alpn_protocols(["h2", "http/1.1"])
    with (
        socket.create_connection((stack.config.host, stack.config.https_port), timeout=5) as raw,
        tls.wrap_socket(raw, server_hostname=stack.config.host) as sock,
    ):
        assert sock.selected_alpn_protocol() == "http/1.1"
        first, answered = _h2_streams_answered(sock, 10)
    assert answered == 0 and (first == b"" or first.startswith(b"HTTP/1.")), first
    # HTTP/1.1 is served as ever.
    with socket.create_connection((stack.config.host, stack.config.http_port), timeout=5) as sock:
        assert _status(sock) == 200


async def test_a_request_with_two_session_ids_is_refused_and_moves_no_session(
    stack: Stack, http: httpx2.AsyncClient, mcp_url: str
) -> None:
    """HAProxy's stick table read the last mcp-session-id header, the hash and the replica the first: a
    request carrying its session's id first reached the replica the id hashes to, which adopted it."""
    sessions = [RawSession(http, mcp_url) for _ in range(6)]
    homes = {}
    for session in sessions:
        await session.initialize()
        homes[session.session_id] = (await session.call("increment_counter"))["instance"]
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "increment_counter", "arguments": {}}}
    for session in sessions:
        assert session.session_id is not None
        others = [(k, v) for k, v in session.headers().items() if k != "mcp-session-id"]
        for ids in ((session.session_id, uuid.uuid4().hex), (uuid.uuid4().hex, session.session_id)):
            response = await http.post(mcp_url, headers=[*others, *(("mcp-session-id", i) for i in ids)], json=call)
            assert response.status_code == 400, response.text
            assert response.json()["error"] == {"code": -32600, "message": "More than one mcp-session-id header"}
    for session in sessions:
        result = await session.call("get_counter")
        assert (result["counter"], result["instance"]) == (1, homes[session.session_id])
    assert not [line for sid in homes for line in _access_lines(stack, f"adopted session {sid}")]


async def test_sessionless_requests_with_a_made_up_session_id_go_to_every_replica(
    stack: Stack, http: httpx2.AsyncClient, mcp_url: str
) -> None:
    """A 2026-07-28 request has no session, and the SDK ignores its mcp-session-id: routed by it, every
    request carrying one made-up id went to one replica. (One shaped like the kit's ids was also taken up by
    the replica, which answered 404 for a session it could not find.)"""
    session = SessionlessSession(http, mcp_url)
    for junk in (f"junk-{uuid.uuid4().hex}", uuid.uuid4().hex):
        served = Counter()
        for _ in range(30):
            served[(await session.call_tool("get_server_info", headers={"mcp-session-id": junk}))["instance"]] += 1
        assert set(served) == set(stack.config.replica_names()), served


def test_the_session_era_versions_are_the_sdks() -> None:
    """HAProxy tells a sessionless request by its MCP-Protocol-Version, as the SDK's router does."""
    (line,) = [line for line in CONFIG.read_text().splitlines() if "acl session_era_version" in line]
    assert line.split(" -m str ")[1].split() == list(HANDSHAKE_PROTOCOL_VERSIONS)


METRICS_SPELLINGS = (
    "/metrics",
    "/%6detrics",
    "/%6Detrics",
    "/%6d%65%74%72%69%63%73",
    "//metrics",
    "/./metrics",
    "/mcp/../metrics",
    "/health/../metrics",
    "/%2Fmetrics",
    "/METRICS",
    "/Metrics",
    "/metrics/",
    "/metrics?x=1",
    "/metrics;x",
    "http://mcp/metrics",
)


def _answer(stack: Stack, path: str) -> tuple[int, bytes]:
    """GET `path` through HAProxy exactly as written (httpx would normalise it): (status, body)."""
    with socket.create_connection((stack.config.host, stack.config.http_port), timeout=5) as sock:
        reply = _get(sock, path)
    assert reply is not None, path
    return reply[0], reply[2]


async def test_metrics_is_refused_through_haproxy_however_it_is_spelled(
    stack: Stack, http: httpx2.AsyncClient, raw: RawSession
) -> None:
    # uvicorn decodes the path: straight to a replica, a spelling HAProxy would match raw is /metrics.
    replica = stack.config.replica_ports[0]
    assert (await http.get(f"http://127.0.0.1:{replica}/%6detrics")).status_code == 200
    refused = {path: _answer(stack, path) for path in METRICS_SPELLINGS}
    assert {reply[0] for reply in refused.values()} == {404}, refused
    assert json.loads(refused["/%6detrics"][1])["error"]["message"] == "Not found"
    # What is meant to be there is served.
    assert _answer(stack, "/health")[0] == 200 and _answer(stack, "/health?probe=1")[0] == 200
    assert (await raw.call("increment_counter"))["counter"] == 1


@contextlib.contextmanager
def _haproxy(stack: Stack, tmp_path: Path, **env: str) -> Iterator[str]:
    """The stack's haproxy.cfg, its environment with `env` on top, on ports of its own: its base URL."""
    http_port, https_port, stats_port = free_ports(3)
    env = {
        **os.environ,
        **stack.service("haproxy").env,
        "HAPROXY_BIND": f"127.0.0.1:{http_port}",
        "HAPROXY_TLS_BIND": f"127.0.0.1:{https_port}",
        "HAPROXY_STATS_BIND": f"127.0.0.1:{stats_port}",
        **env,
    }
    with open(tmp_path / "haproxy.log", "wb") as log:
        proc = subprocess.Popen(
            ["haproxy", "-db", "-f", str(CONFIG)], cwd=CONFIG.parents[1], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            yield f"http://127.0.0.1:{http_port}"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def _wait_for_health(base: str) -> None:
    """Until HAProxy has a replica up (two good checks)."""
    deadline = time.monotonic() + 15
    while True:
        with contextlib.suppress(httpx2.HTTPError):
            if httpx2.get(f"{base}/health", timeout=2).status_code == 200:
                return
        assert time.monotonic() < deadline, "haproxy served no /health"
        time.sleep(0.1)


def test_the_allowed_paths_come_from_the_environment(stack: Stack, tmp_path: Path) -> None:
    with _haproxy(stack, tmp_path, HAPROXY_ALLOWED_PATHS="/health /elsewhere") as base:
        _wait_for_health(base)
        mcp = httpx2.post(f"{base}/mcp", json={}, timeout=5)
        assert mcp.status_code == 404 and mcp.json()["error"]["message"] == "Not found"
    # Empty, as compose passes an unset variable: the default list.
    with _haproxy(stack, tmp_path, HAPROXY_ALLOWED_PATHS="") as base:
        _wait_for_health(base)
        assert httpx2.post(f"{base}/mcp", json={}, timeout=5).status_code != 404


async def test_health_says_nothing_of_the_stores_memory(stack: Stack, http: httpx2.AsyncClient) -> None:
    """/health answers anyone; how full Redis is, is for the operator, on a replica's /metrics
    (tests/test_server.py::test_health_names_the_replica)."""
    base = stack.config.mcp_url.removesuffix("/mcp")
    assert set((await http.get(f"{base}/health")).json()) == {"status", "instance"}
    for port in stack.config.replica_ports:
        assert set((await http.get(f"http://127.0.0.1:{port}/health")).json()) == {"status", "instance"}


@pytest.mark.haproxy
@pytest.mark.timeout(120)
async def test_a_request_re_sent_when_no_replica_is_left_gets_an_answer(own_cluster: Stack) -> None:
    """In a whole-store outage every replica fails its checks within a second, and HAProxy re-sends the
    requests it was waiting on (a 503, or a replica taken out under them) while they go down. When that
    re-send finds no replica up and the first try had reused a connection to a replica, HAProxy closed
    the client's connection without an answer: an SDK client's POST then ends its session for good.
    Pinned with the one replica hung (SIGSTOP), so it is taken out exactly under a request on the
    connection reused from the one before. HAProxy's log shows the 503 it gave up with either way."""
    own_cluster.start("mcp-server-1")
    own_cluster.start("haproxy")
    own_cluster.wait_healthy("haproxy")
    # One connection, so the request that hangs goes to the replica on the connection the first one used.
    async with httpx2.AsyncClient(timeout=30, limits=httpx2.Limits(max_connections=1)) as http:
        raw = RawSession(http, f"http://{own_cluster.config.host}:{own_cluster.config.http_port}/mcp")
        await raw.initialize()
        await raw.call("increment_counter")
        own_cluster.signal("mcp-server-1", signal.SIGSTOP)
        try:
            response = await raw.post("tools/call", {"name": "increment_counter", "arguments": {}})
        finally:
            own_cluster.signal("mcp-server-1", signal.SIGCONT)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"] == {"code": -32000, "message": "No replica can serve now; retry shortly"}


async def ended(chunks: AsyncIterator[bytes]) -> bool:
    """Whether a streamed answer has ended (or broken) by now: it is open while nothing more comes."""
    try:
        await asyncio.wait_for(anext(chunks), 0.5)
    except TimeoutError:
        return False
    except (StopAsyncIteration, httpx2.HTTPError):
        return True
    return False


@pytest.mark.haproxy
@pytest.mark.timeout(120)
async def test_a_whole_store_outage_takes_the_replicas_out_without_cutting_what_they_hold(
    own_cluster: Stack,
) -> None:
    """A replica whose store is gone answers /health 503, and HAProxy sends it nothing new but cuts
    nothing it holds (NOLB, "stopping"). It used to mark it DOWN, which cuts every request attached to
    the replica (on-marked-down shutdown-sessions, there for hung replicas): with every replica going down
    within a second, a 503 the replica was answering just then reached its client cut after its headers,
    or a request HAProxy was re-sending lost its connection without an answer. Pinned with a GET stream,
    which the replica holds open through the outage."""
    own_cluster.start("mcp-server-1")
    own_cluster.start("haproxy")
    own_cluster.wait_healthy("haproxy")
    async with httpx2.AsyncClient(timeout=30) as http:
        raw = RawSession(http, own_cluster.config.mcp_url)
        await raw.initialize()
        async with http.stream("GET", raw.url, headers=raw.headers()) as stream:
            assert stream.status_code == 200
            chunks = stream.aiter_bytes()
            own_cluster.stop(*own_cluster.config.redis_names())
            deadline = time.monotonic() + 30
            while own_cluster.backend_status() == {"mcp-server-1": "UP"}:
                assert time.monotonic() < deadline, "HAProxy never took the replica out"
                await asyncio.sleep(0.1)
            # Out of rotation, and still so after more checks than it takes to mark a replica DOWN.
            await asyncio.sleep(1.5)
            assert not await ended(chunks), "HAProxy cut the replica's open stream"
            assert own_cluster.backend_status() == {"mcp-server-1": "NOLB"}
            response = await raw.post("tools/call", {"name": "increment_counter", "arguments": {}})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == -32000
