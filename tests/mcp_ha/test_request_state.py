"""2026-07-28 multi-round-trip requests across replicas (`mcp_ha/request_state.py`).

The demo's `reset_counter` asks for a confirmation: its first leg answers with an
`InputRequiredResult` carrying sealed request state, its second leg carries the
answer and that state. Replicas here are started by the test itself, against one
Redis, so each can be given its own key ring and TTL; the legs go to replicas
directly, so which replica serves which leg is the test's choice, not a balancer's.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx2
import pytest
from conftest import replica_on, two_replicas
from fastmcp import Client

from mcp_ha.idempotency import IDEMPOTENCY_KEY
from mcp_ha.ops.check.wire import SessionlessSession, final_message
from mcp_ha.ops.stack import Stack
from mcp_ha.request_state import REPLAYED

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
CONFIRM = {"confirm": {"action": "accept", "content": {"value": True}}}


@contextmanager
def replica(redis: Stack, tmp_path: Path, name: str, keys: list[str], *, ttl: float = 600) -> Iterator[str]:
    """A replica with this key ring and TTL; its MCP URL while it runs."""
    with replica_on(redis, tmp_path, name, REQUEST_STATE_KEYS=",".join(keys), REQUEST_STATE_TTL_SECONDS=str(ttl)) as r:
        yield r.url


def key() -> str:
    return secrets.token_hex(32)


async def first_leg(session: SessionlessSession, handle: str) -> str:
    """The sealed request state of a reset_counter's first leg."""
    message = final_message(
        await session.post("tools/call", {"name": "reset_counter", "arguments": {"session_id": handle}})
    )
    result = message["result"]
    assert result["resultType"] == "input_required" and "confirm" in result["inputRequests"], result
    return result["requestState"]


async def second_leg(session: SessionlessSession, handle: str, state: str, *, key: str | None = None) -> dict:
    """The second leg's JSON-RPC message, whatever it is; `key`: the call's idempotency key."""
    response = await session.post(
        "tools/call",
        {
            "name": "reset_counter",
            "arguments": {"session_id": handle},
            "inputResponses": CONFIRM,
            "requestState": state,
            **({"_meta": {IDEMPOTENCY_KEY: key}} if key else {}),
        },
    )
    assert response.status_code < 500, response.text
    return final_message(response) if response.status_code == 200 else response.json()


async def counter(session: SessionlessSession, handle: str) -> int:
    return (await session.call_tool("get_counter", {"session_id": handle}))["counter"]


def test_both_legs_on_different_replicas_20_times_out_of_20(redis_stack: Stack, tmp_path: Path) -> None:
    with two_replicas(redis_stack, tmp_path) as (r1, r2):
        one, two = r1.url, r2.url

        async def scenario() -> None:
            async with httpx2.AsyncClient(timeout=30) as http:
                urls = [one, two]
                for i in range(20):
                    first, second = SessionlessSession(http, urls[i % 2]), SessionlessSession(http, urls[1 - i % 2])
                    handle = await first.open()
                    await first.call_tool("increment_counter", {"session_id": handle})
                    state = await first_leg(first, handle)
                    done = await second_leg(second, handle, state)
                    result = done["result"]["structuredContent"]
                    assert result == {
                        "reset": True,
                        "was": 1,
                        "counter": 0,
                        "instance": "mcp-server-2" if i % 2 == 0 else "mcp-server-1",
                    }, (i, done)
                    assert await counter(first, handle) == 0

        asyncio.run(scenario())


def test_a_stock_2026_client_confirms_through_the_balancer(stack: Stack) -> None:
    """FastMCP's Client in its default (2026-07-28) mode, through HAProxy: its own driver answers the
    InputRequiredResult, and the reset happens."""

    async def scenario() -> None:
        async def confirm(message: str, response_type: type, params: object, context: object) -> dict:
            return True

        async with Client(stack.config.mcp_url, timeout=30, elicitation_handler=confirm) as client:
            handle = (await client.call_tool("create_session", {})).data["session_id"]
            for _ in range(3):
                await client.call_tool("increment_counter", {"session_id": handle})
            done = (await client.call_tool("reset_counter", {"session_id": handle})).structured_content
            assert done["reset"] is True and done["was"] == 3
            assert (await client.call_tool("get_counter", {"session_id": handle})).data["counter"] == 0

    asyncio.run(scenario())


def test_forged_truncated_foreign_and_expired_state_is_refused_and_changes_nothing(
    redis_stack: Stack, tmp_path: Path
) -> None:
    ring = [key()]
    with (
        replica(redis_stack, tmp_path, "mcp-server-1", ring, ttl=2) as one,
        replica(redis_stack, tmp_path, "mcp-server-3", [key()]) as stranger,
    ):

        async def refused(session: SessionlessSession, handle: str, state: str) -> None:
            done = await second_leg(session, handle, state)
            assert "error" in done and done["error"]["code"] == -32602, done
            assert "requestState" in done["error"]["message"], done
            assert await counter(session, handle) == 1, "a refused leg changed something"

        async def scenario() -> None:
            async with httpx2.AsyncClient(timeout=30) as http:
                session = SessionlessSession(http, one)
                handle = await session.open()
                other = await session.open()
                for h in (handle, other):
                    await session.call_tool("increment_counter", {"session_id": h})
                state = await first_leg(session, handle)
                await refused(session, handle, "v1." + secrets.token_urlsafe(60))  # forged
                await refused(session, handle, state[:-5])  # truncated
                await refused(session, other, state)  # minted for another request
                # Sealed under a ring this replica does not hold (another deployment's).
                await refused(session, handle, await first_leg(SessionlessSession(http, stranger), handle))
                await asyncio.sleep(2.5)
                await refused(session, handle, state)  # expired

        asyncio.run(scenario())


def test_a_replayed_state_is_refused_on_any_replica_and_a_retry_of_its_request_is_not(
    redis_stack: Stack, tmp_path: Path
) -> None:
    with two_replicas(redis_stack, tmp_path) as (r1, r2):
        one, two = r1.url, r2.url

        async def scenario() -> None:
            async with httpx2.AsyncClient(timeout=30) as http:
                first, other = SessionlessSession(http, one), SessionlessSession(http, two)
                handle = await first.open()
                await first.call_tool("increment_counter", {"session_id": handle})
                state = await first_leg(first, handle)
                done = await second_leg(other, handle, state, key="leg-2")
                assert done["result"]["structuredContent"]["reset"] is True, done
                await first.call_tool("increment_counter", {"session_id": handle})
                # The same request again (a retry: the same idempotency key) answers, and resets nothing twice.
                again = await second_leg(first, handle, state, key="leg-2")
                assert again["result"]["structuredContent"]["reset"] is True, again
                assert await counter(first, handle) == 1
                # A state on a method the SDK never opens one for is not claimed: sent twice, never refused.
                for _ in range(2):
                    listed = final_message(await first.post("tools/list", {"requestState": "never-opened"}))
                    assert "result" in listed, listed
                # Another request bringing the same state, on either replica: refused, nothing changes.
                for session, call_key in ((first, "replay"), (other, None)):
                    refused = await second_leg(session, handle, state, key=call_key)
                    assert refused["error"]["code"] == -32602, refused
                    assert refused["error"]["message"] == REPLAYED
                    assert await counter(first, handle) == 1

        asyncio.run(scenario())


def test_rotating_the_ring_replica_by_replica_refuses_no_leg(redis_stack: Stack, tmp_path: Path) -> None:
    """docs/operations.md's steps: [old] -> [old, new] -> [new, old] -> [new], every replica at each step
    before the next. A state minted at any step opens on every replica of the next."""
    old, new = key(), key()
    steps = [[old], [old, new], [new, old], [new]]

    async def legs(minting: str, opening: str) -> None:
        async with httpx2.AsyncClient(timeout=30) as http:
            first = SessionlessSession(http, minting)
            handle = await first.open()
            state = await first_leg(first, handle)
            done = await second_leg(SessionlessSession(http, opening), handle, state)
            assert done.get("result", {}).get("structuredContent", {}).get("reset") is True, done

    for before, after in itertools.pairwise(steps):
        # Mid-rollout: one replica still on the step before, one already on the next; legs both ways.
        with (
            replica(redis_stack, tmp_path, "mcp-server-1", before) as one,
            replica(redis_stack, tmp_path, "mcp-server-2", after) as two,
        ):
            asyncio.run(legs(one, two))
            asyncio.run(legs(two, one))
