"""Bounds on what one client may take (`mcp_ha/limits.py`), through HAProxy and on a replica directly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx2
import pytest
from conftest import replica_on

from mcp_ha.check.wire import ACCEPT, PROTOCOL, RawSession, final_message
from mcp_ha.stack import Stack

pytestmark = pytest.mark.timeout(60)
MAX_BODY_BYTES = 1_048_576


def chunked(size: int) -> Iterator[bytes]:
    """A JSON-RPC ping whose id makes the body `size` bytes, sent in 64 KB chunks (no Content-Length)."""
    head, tail = b'{"jsonrpc":"2.0","method":"ping","id":"', b'"}'
    body = head + b"x" * (size - len(head) - len(tail)) + tail
    for start in range(0, len(body), 65536):
        yield body[start : start + 65536]


def post(url: str, body: Iterator[bytes]) -> httpx2.Response:
    headers = {"accept": ACCEPT, "content-type": "application/json", "mcp-protocol-version": PROTOCOL}
    return httpx2.post(url, content=body, headers=headers, timeout=30)


@pytest.mark.parametrize("where", ["haproxy", "replica"])
def test_a_chunked_body_over_the_bound_gets_413_with_a_json_rpc_error(stack: Stack, where: str) -> None:
    url = stack.config.mcp_url if where == "haproxy" else f"http://127.0.0.1:{stack.config.replica_ports[0]}/mcp"
    response = post(url, chunked(2 * MAX_BODY_BYTES))
    assert response.status_code == 413, response.text
    assert json.loads(response.text)["error"]["code"] == -32600
    # Just within the bound, the same body is read whole and answered by the SDK, not refused for its size.
    within = post(url, chunked(MAX_BODY_BYTES - 1024))
    assert within.status_code != 413, within.text
    assert within.status_code < 500, within.text


def test_an_initialize_with_a_padded_client_info_is_refused_and_records_nothing(stack: Stack) -> None:
    padded = {"name": "x" * 100_000, "version": "1"}
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": PROTOCOL, "capabilities": {}, "clientInfo": padded},
    }
    sessions_before = stack.redis_command("redis", "ZCARD", "mcp:sessions")
    headers = {"accept": ACCEPT, "content-type": "application/json", "mcp-protocol-version": PROTOCOL}
    response = httpx2.post(stack.config.mcp_url, json=body, headers=headers, timeout=30)
    assert response.status_code < 500, response.text
    message = final_message(response) if response.status_code == 200 else response.json()
    assert message["error"]["code"] == -32602 and "clientInfo" in message["error"]["message"], message
    assert stack.redis_command("redis", "ZCARD", "mcp:sessions") == sessions_before
    # A client within the bound opens its session as ever.
    assert "result" in final_message(
        httpx2.post(
            stack.config.mcp_url,
            json={**body, "params": {**body["params"], "clientInfo": {"name": "c", "version": "1"}}},
            headers=headers,
            timeout=30,
        )
    )


# -- a replica with small bounds, against the shared Redis: each test's clients are principals of its own --


@contextmanager
def bounded_replica(redis_stack: Stack, tmp_path: Path, **env: str) -> Iterator[tuple[str, list[str]]]:
    """A replica with static auth for three fresh principals (counted apart from every other test's);
    its MCP URL and their tokens."""
    tokens = [secrets.token_hex(16) for _ in range(3)]
    names = ",".join(f"p{uuid.uuid4().hex[:12]}:{token}" for token in tokens)
    with replica_on(redis_stack, tmp_path, "bounded", MCP_AUTH="static", MCP_AUTH_TOKENS=names, **env) as r:
        yield r.url, tokens


async def test_sessions_past_max_sessions_per_client_get_429_until_one_ends(redis_stack: Stack, tmp_path: Path) -> None:
    with bounded_replica(redis_stack, tmp_path, MAX_SESSIONS_PER_CLIENT="3") as (url, (alice, bob, _)):
        async with httpx2.AsyncClient(timeout=30) as http:
            sessions = [RawSession(http, url, token=alice) for _ in range(3)]
            for session in sessions:
                await session.initialize()
            extra = RawSession(http, url, token=alice)
            response = await extra.post(
                "initialize",
                {"protocolVersion": PROTOCOL, "capabilities": {}, "clientInfo": {"name": "x", "version": "1"}},
            )
            assert response.status_code == 429, response.text
            assert int(response.headers["retry-after"]) > 0
            assert "3 open sessions" in response.json()["error"]["message"]
            # Handles count too: a tool error, nothing minted.
            result = final_message(await sessions[0].post("tools/call", {"name": "create_session", "arguments": {}}))
            assert result["result"]["isError"] is True and "3 open sessions" in result["result"]["content"][0]["text"]
            # Another principal is not held back; ending a session frees its place.
            await RawSession(http, url, token=bob).initialize()
            await sessions[0].close()
            await extra.initialize()
            assert (await extra.call("increment_counter"))["counter"] == 1


async def test_an_answer_over_max_event_bytes_is_resumed_as_an_error_saying_to_call_again(
    redis_stack: Stack, tmp_path: Path
) -> None:
    # analyze_data streams log lines of ~130 bytes first, then answers in ~270.
    with bounded_replica(redis_stack, tmp_path, MAX_EVENT_BYTES="200") as (url, (alice, _, _)):
        async with httpx2.AsyncClient(timeout=30) as http:
            session = RawSession(http, url, token=alice)
            await session.initialize()
            async with session.stream("tools/call", {"name": "analyze_data", "arguments": {"num_items": 0}}) as stream:
                events = [event async for event in stream]
            # Sent live whole...
            answer = events[-1].message
            assert answer is not None and answer["result"]["structuredContent"]["items_processed"] == 0
            assert len(json.dumps(answer)) > 200
            # ...but kept, for resuming, as an error for that request that says to call again.
            assert events[0].id is not None
            async with session.resume(events[0].id) as resumed:
                replayed = [event.message async for event in resumed if event.message]
            assert replayed[-1]["id"] == answer["id"]
            assert "call again" in replayed[-1]["error"]["message"]


async def test_replays_past_max_replays_per_session_get_429(redis_stack: Stack, tmp_path: Path) -> None:
    with bounded_replica(redis_stack, tmp_path, MAX_REPLAYS_PER_SESSION="2") as (url, (alice, _, _)):
        async with httpx2.AsyncClient(timeout=30) as http:
            session = RawSession(http, url, token=alice)
            await session.initialize()
            async with contextlib.AsyncExitStack() as held:
                # A long call's stream, cut after its priming event: resuming it waits for more.
                stream = await held.enter_async_context(
                    session.stream("tools/call", {"name": "analyze_data", "arguments": {"num_items": 100}})
                )
                priming = await anext(aiter(stream))
                assert priming.id is not None
                for _ in range(2):
                    resumed = await held.enter_async_context(session.resume(priming.id))
                    assert resumed.response.status_code == 200
                async with session.resume(priming.id) as refused:
                    assert refused.response.status_code == 429
                    assert int(refused.response.headers["retry-after"]) > 0
                    await refused.response.aread()
                    assert "2 streams being resumed" in refused.response.json()["error"]["message"]


async def test_an_idle_sessions_transport_is_dropped_and_adopted_back(redis_stack: Stack, tmp_path: Path) -> None:
    with bounded_replica(redis_stack, tmp_path, SESSION_IDLE_SECONDS="0.5", METRICS="on") as (url, (alice, _, _)):
        async with httpx2.AsyncClient(timeout=30) as http:
            session = RawSession(http, url, token=alice)
            await session.initialize()
            assert (await session.call("increment_counter"))["counter"] == 1
            metrics_url = url.removesuffix("/mcp") + "/metrics"
            deadline = time.monotonic() + 20
            while held_sessions((await http.get(metrics_url)).text) != 0:
                assert time.monotonic() < deadline, "the idle session's transport was never dropped"
                await asyncio.sleep(0.2)
            # Nothing was lost: the next call adopts the session again, state and all.
            assert (await session.call("increment_counter"))["counter"] == 2


def held_sessions(metrics: str) -> float:
    return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("mcp_sessions_held"))


async def test_concurrent_initializes_never_open_more_than_max_sessions_per_client(
    redis_stack: Stack, tmp_path: Path
) -> None:
    with bounded_replica(redis_stack, tmp_path, MAX_SESSIONS_PER_CLIENT="3") as (url, (alice, _, _)):
        async with httpx2.AsyncClient(timeout=30) as http:
            sessions = [RawSession(http, url, token=alice) for _ in range(12)]
            outcomes = await asyncio.gather(*(session.open() for session in sessions), return_exceptions=True)
            opened = [outcome for outcome in outcomes if isinstance(outcome, str)]
            assert len(opened) == 3, outcomes


async def test_a_request_id_in_flight_on_its_session_is_refused_and_free_again_once_answered(stack: Stack) -> None:
    async with httpx2.AsyncClient(timeout=30) as http:
        session = RawSession(http, stack.config.mcp_url)
        await session.initialize()

        def call(tool: str, arguments: dict) -> dict:
            return {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": tool, "arguments": arguments}}

        long = asyncio.create_task(
            http.post(session.url, headers=session.headers(), json=call("analyze_data", {"num_items": 30}))
        )
        await asyncio.sleep(0.5)
        duplicate = await http.post(session.url, headers=session.headers(), json=call("increment_counter", {}))
        assert duplicate.status_code == 409, duplicate.text
        assert duplicate.json()["id"] == 7 and "still in flight" in duplicate.json()["error"]["message"]
        # The first call gets its own answer, not another tool's.
        answer = final_message(await long)
        assert answer["id"] == 7 and answer["result"]["structuredContent"]["items_processed"] == 30, answer
        # Answered, the id is free again at once, and nothing was applied by the refused call.
        again = final_message(
            await http.post(session.url, headers=session.headers(), json=call("increment_counter", {}))
        )
        assert again["result"]["structuredContent"]["counter"] == 1
