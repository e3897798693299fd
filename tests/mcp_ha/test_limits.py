"""Bounds on what one client may take (`mcp_ha/limits.py`), through HAProxy and on a replica directly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2
import pytest
from conftest import replica_on
from fastmcp import Client
from hypothesis import given, settings
from hypothesis import strategies as st

from mcp_ha import limits
from mcp_ha.limits import Call, InFlight, structure, structure_bound, unescaped
from mcp_ha.ops.check.wire import ACCEPT, PROTOCOL, RawSession, SessionlessSession, final_message
from mcp_ha.ops.stack import Stack

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


# -- the structure of a request body: MAX_REQUEST_ITEMS, MAX_REQUEST_DEPTH --

MAX_REQUEST_ITEMS, MAX_REQUEST_DEPTH = 10_000, 32
# A tools/call's own keys (jsonrpc, id, method, params; name, arguments) and depth (to inside `arguments`).
ENVELOPE_ITEMS, ENVELOPE_DEPTH = 6, 3


def counted(value: Any) -> tuple[int, int]:
    """Keys and array elements in all, and depth, counted on the parsed value."""
    if isinstance(value, dict | list):
        inner = [counted(v) for v in (value.values() if isinstance(value, dict) else value)]
        return len(value) + sum(i for i, _ in inner), 1 + max((d for _, d in inner), default=0)
    return 0, 0


JSON_TEXT = st.text(alphabet=st.sampled_from(list('ab,:[]{}"\\ \n\u00e9')), max_size=6)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | JSON_TEXT,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(JSON_TEXT, children, max_size=4),
    max_leaves=30,
)


@pytest.mark.quick
@settings(max_examples=400, deadline=None)
@given(value=JSON_VALUES, indent=st.sampled_from([None, 1, "\t"]), ascii=st.booleans())
def test_a_bodys_structure_is_counted_exactly_however_it_is_written(value: Any, indent: Any, ascii: bool) -> None:
    """Strings full of commas, brackets, quotes and backslashes, whitespace anywhere: the count is the parser's."""
    body = json.dumps(value, indent=indent, ensure_ascii=ascii).encode()
    items, depth = counted(value)
    assert structure(unescaped(body), 10**9) == (items, depth)
    bound_items, bound_depth = structure_bound(body)
    assert bound_items >= items and bound_depth >= depth


def tool_call(arguments: str, tool: str = "increment_counter", request_id: int = 1) -> bytes:
    return (
        f'{{"jsonrpc":"2.0","id":{request_id},"method":"tools/call",'
        f'"params":{{"name":"{tool}","arguments":{arguments}}}}}'
    ).encode()


def keys(count: int, pad: str = "") -> str:
    return "{" + ",".join(f'"k{i}{pad}":0' for i in range(count)) + "}"


def nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def assert_past_structure(response: httpx2.Response, setting: str) -> None:
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == -32600 and setting in error["message"], error


def assert_served(response: httpx2.Response) -> None:
    """Past the structure bound: the SDK's answer (a tool error, for arguments no tool takes)."""
    assert response.status_code == 200, response.text[:300]
    assert "result" in final_message(response) or "error" in final_message(response)


@pytest.fixture
async def direct(stack: Stack, http: httpx2.AsyncClient) -> RawSession:
    """A session on one replica, spoken to directly."""
    session = RawSession(http, f"http://127.0.0.1:{stack.config.replica_ports[0]}/mcp")
    await session.initialize()
    return session


async def test_a_body_past_max_request_items_gets_400_and_one_just_within_is_served(direct: RawSession) -> None:
    async def send(arguments: str) -> httpx2.Response:
        return await direct.http.post(direct.url, headers=direct.headers(), content=tool_call(arguments))

    assert_served(await send(keys(MAX_REQUEST_ITEMS - ENVELOPE_ITEMS)))
    assert_past_structure(await send(keys(MAX_REQUEST_ITEMS - ENVELOPE_ITEMS + 1)), "MAX_REQUEST_ITEMS")
    # As many in an array, and in keys long enough that the body nears MAX_BODY_BYTES.
    assert_served(await send("[" + ",".join(["0"] * (MAX_REQUEST_ITEMS - ENVELOPE_ITEMS)) + "]"))
    assert_past_structure(
        await send("[" + ",".join(["0"] * (MAX_REQUEST_ITEMS - ENVELOPE_ITEMS + 1)) + "]"), "MAX_REQUEST_ITEMS"
    )
    assert_served(await send(keys(MAX_REQUEST_ITEMS - ENVELOPE_ITEMS, pad="x" * 90)))
    assert_past_structure(await send(keys(MAX_REQUEST_ITEMS, pad="x" * 90)), "MAX_REQUEST_ITEMS")
    # Commas, brackets and escaped quotes inside strings are no structure: bodies the one-pass bound does not
    # clear, counted exactly, small (on the event loop) and large (in a worker thread).
    for size in (30_000, 600_000):
        text = ('\\"[{,' * size)[:size]
        assert_served(await send(json.dumps({"note": text})))
        assert_served(await send(json.dumps({"notes": [text[: size // 2], text[: size // 2]]})))
    # Strings alone past the bound: a body of many short ones is refused as it is.
    assert_past_structure(await send(json.dumps(["s"] * 30_000)), "MAX_REQUEST_ITEMS")


async def test_a_body_past_max_request_depth_gets_400_and_one_just_within_is_served(
    stack: Stack, direct: RawSession
) -> None:
    async def send(arguments: str) -> httpx2.Response:
        return await direct.http.post(direct.url, headers=direct.headers(), content=tool_call(arguments))

    within = MAX_REQUEST_DEPTH - ENVELOPE_DEPTH
    assert_served(await send(f'{{"x":{nested(within)}}}'))
    past = await send(f'{{"x":{nested(within + 1)}}}')
    assert_past_structure(past, "MAX_REQUEST_DEPTH")
    assert f"{MAX_REQUEST_DEPTH + 1} deep" in past.json()["error"]["message"]
    # Many more brackets than levels: counted exactly.
    siblings = ",".join(["[[]]"] * 100)
    assert_served(await send(f'{{"x":{nested(within)},"y":[{siblings}]}}'))
    assert_past_structure(await send(f'{{"y":[{siblings}],"x":{nested(within + 1)}}}'), "MAX_REQUEST_DEPTH")
    # Through HAProxy as well, and an initialize too (it has no session yet).
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": PROTOCOL, "capabilities": {"x": json.loads(nested(40))}, "clientInfo": {}},
    }
    headers = {"accept": ACCEPT, "content-type": "application/json", "mcp-protocol-version": PROTOCOL}
    response = await direct.http.post(stack.config.mcp_url, headers=headers, json=body)
    assert_past_structure(response, "MAX_REQUEST_DEPTH")


async def test_80000_keys_are_refused_at_the_cost_of_reading_them_and_health_stays_fast(
    stack: Stack, direct: RawSession
) -> None:
    """Finding 3: parsing, validating and digesting such bodies held the event loop, /health failed HAProxy's
    check, and replicas went down one after another. Refused, one costs about what any body its size costs."""
    http = direct.http
    wide = tool_call(keys(80_000))
    plain = tool_call(json.dumps({"note": "n" * (len(wide) - 100)}))  # as large; the one-pass bound clears it

    async def timed(body: bytes) -> float:
        started = time.perf_counter()
        response = await http.post(direct.url, headers=direct.headers(), content=body)
        elapsed = time.perf_counter() - started
        if body is wide:
            assert_past_structure(response, "MAX_REQUEST_ITEMS")
        else:
            assert_served(response)
        return elapsed

    wide_times, plain_times = [], []
    for _ in range(5):  # interleaved, so the machine's load weighs on both alike
        wide_times.append(await timed(wide))
        plain_times.append(await timed(plain))
    assert statistics.median(wide_times) <= 3 * statistics.median(plain_times), (wide_times, plain_times)

    health = f"http://127.0.0.1:{stack.config.replica_ports[0]}/health"

    async def checks(count: int) -> list[float]:
        times = []
        for _ in range(count):
            started = time.perf_counter()
            assert (await http.get(health)).status_code == 200
            times.append(time.perf_counter() - started)
            await asyncio.sleep(0.05)
        return times

    at_rest = await checks(20)
    # 16 clients at once, from a process of their own at the lowest priority (as in the finding): on a shared
    # machine, so that what is measured is the replica's event loop, not the machine's scheduler.
    attack = await asyncio.create_subprocess_exec(
        *("nice", "-n", "19", sys.executable, "-c", ATTACKER, direct.url, json.dumps(direct.headers()), "16", "6"),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    finished = asyncio.ensure_future(attack.communicate(wide))
    await asyncio.sleep(1.5)
    under_attack = await checks(20)
    statuses = json.loads((await asyncio.wait_for(finished, 60))[0])
    assert set(statuses) == {"400"} and statuses["400"] >= 16, statuses
    assert statistics.median(under_attack) <= 5 * statistics.median(at_rest), (at_rest, under_attack)


# Sends the body on stdin to argv[1] with the headers argv[2], from argv[3] clients at once for argv[4] s; prints
# how many answers of each status came.
ATTACKER = """
import asyncio, collections, json, sys, time
import httpx2
url, headers, clients, seconds = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
body = sys.stdin.buffer.read()
statuses = collections.Counter()
async def client(http, stop):
    while time.monotonic() < stop:
        statuses[str((await http.post(url, headers=headers, content=body)).status_code)] += 1
async def main():
    async with httpx2.AsyncClient(timeout=60, limits=httpx2.Limits(max_connections=clients)) as http:
        stop = time.monotonic() + seconds
        await asyncio.gather(*(client(http, stop) for _ in range(clients)))
asyncio.run(main())
print(json.dumps(statuses))
"""


# -- calls in flight: MAX_CALLS_PER_SESSION, MAX_CALLS_PER_CLIENT --


def assert_busy(response: httpx2.Response, setting: str, request_id: int) -> None:
    assert response.status_code == 429, response.text[:300]
    assert response.headers["retry-after"] == "1"
    answer = response.json()
    assert answer["id"] == request_id and answer["error"]["code"] == -32000 and setting in answer["error"]["message"]


LONG_CALL = {"name": "analyze_data", "arguments": {"num_items": 80}}  # 4 s of work, streamed
SHORT_CALL = {"name": "analyze_data", "arguments": {"num_items": 4}}  # 0.2 s of work
INCREMENT = {"name": "increment_counter", "arguments": {}}


async def test_calls_in_flight_past_a_sessions_or_a_clients_bound_get_429_until_they_answer(
    redis_stack: Stack, tmp_path: Path
) -> None:
    # Refused at once (no queue): the bounds themselves. The queue in front of them is tested below.
    env = {"MAX_CALLS_PER_SESSION": "2", "MAX_CALLS_PER_CLIENT": "3", "CALL_QUEUE_SECONDS": "0"}
    with bounded_replica(redis_stack, tmp_path, **env) as (url, (alice, bob, _)):
        async with httpx2.AsyncClient(timeout=30) as http:
            first, second = RawSession(http, url, token=alice), RawSession(http, url, token=alice)
            await first.initialize()
            await second.initialize()
            async with contextlib.AsyncExitStack() as held:
                for _ in range(2):
                    stream = await held.enter_async_context(first.stream("tools/call", LONG_CALL))
                    await anext(aiter(stream))
                assert_busy(await first.post("tools/call", INCREMENT), "MAX_CALLS_PER_SESSION", first._next_id)
                # Another session of hers has room, up to her third call in flight on this replica...
                stream = await held.enter_async_context(second.stream("tools/call", LONG_CALL))
                await anext(aiter(stream))
                assert_busy(await second.post("tools/call", INCREMENT), "MAX_CALLS_PER_CLIENT", second._next_id)
                # ...her sessionless (2026-07-28) calls count against her too...
                sessionless = SessionlessSession(http, url, token=alice)
                refused = await sessionless.post("tools/call", {"name": "get_status", "arguments": {}})
                assert_busy(refused, "MAX_CALLS_PER_CLIENT", sessionless._next_id)
                # ...and another principal is not held back.
                other = RawSession(http, url, token=bob)
                await other.initialize()
                assert (await other.call("increment_counter"))["counter"] == 1
            # She hung up on her calls, but they run on: each counts until it has answered.
            assert_busy(await first.post("tools/call", INCREMENT), "MAX_CALLS_PER_SESSION", first._next_id)
            deadline = time.monotonic() + 30
            while (response := await first.post("tools/call", INCREMENT)).status_code == 429:
                assert time.monotonic() < deadline, "the calls' places were never freed"
                await asyncio.sleep(0.25)
            assert final_message(response)["result"]["structuredContent"]["counter"] == 1
            assert (await second.call("increment_counter"))["counter"] == 1


async def test_a_stock_client_sending_more_calls_than_a_session_may_run_at_once_gets_every_answer(
    redis_stack: Stack, tmp_path: Path
) -> None:
    """Past MAX_CALLS_PER_SESSION (16 by default) a call waits for a place (CALL_QUEUE_SECONDS) before any 429,
    so a client that does not retry a 429, sending 20 at once on one session, 200 calls in all, gets all 200."""
    with bounded_replica(redis_stack, tmp_path) as (url, (alice, _, _)):
        async with Client(url, mode="legacy", auth=alice, timeout=60) as client:
            in_flight = asyncio.Semaphore(20)

            async def one(i: int) -> int:
                async with in_flight:
                    tool = "analyze_data" if i % 10 == 0 else "increment_counter"
                    arguments = {"num_items": 4} if tool == "analyze_data" else {}
                    result = await client.call_tool(tool, arguments)
                    return 1 if tool == "increment_counter" and not result.is_error else 0

            increments = await asyncio.gather(*(one(i) for i in range(200)))
            assert sum(increments) == 180
            assert (await client.call_tool("get_counter", {})).structured_content["counter"] == 180


async def test_a_call_that_waits_past_call_queue_seconds_or_past_the_queues_bound_gets_429(
    redis_stack: Stack, tmp_path: Path
) -> None:
    env = {"MAX_CALLS_PER_SESSION": "1", "CALL_QUEUE_SECONDS": "1", "MAX_QUEUED_CALLS_PER_CLIENT": "1"}
    with bounded_replica(redis_stack, tmp_path, **env) as (url, (alice, _, _)):
        async with httpx2.AsyncClient(timeout=30) as http:
            session = RawSession(http, url, token=alice)
            await session.initialize()
            async with session.stream("tools/call", LONG_CALL) as stream:
                await anext(aiter(stream))
                waiting = asyncio.create_task(session.post("tools/call", INCREMENT))
                await asyncio.sleep(0.2)  # the first to wait holds the queue's one place
                assert_busy(
                    await session.post("tools/call", INCREMENT), "MAX_QUEUED_CALLS_PER_CLIENT", session._next_id
                )
                refused = await waiting
                assert refused.status_code == 429 and "CALL_QUEUE_SECONDS" in refused.json()["error"]["message"]
                assert "MAX_CALLS_PER_SESSION" in refused.json()["error"]["message"]
            # A call that waits less than CALL_QUEUE_SECONDS for a place is served (a new session: the long call,
            # cut, runs on in the first).
            fresh = RawSession(http, url, token=alice)
            await fresh.initialize()
            async with fresh.stream("tools/call", SHORT_CALL) as stream:
                await anext(aiter(stream))
                served = await fresh.post("tools/call", INCREMENT)
            assert final_message(served)["result"]["structuredContent"]["counter"] == 1


@pytest.mark.quick
async def test_while_others_are_active_a_client_has_its_share_of_fair_share_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Alone, a client has MAX_CALLS_PER_CLIENT; with another active, FAIR_SHARE_CALLS / 2 (named when it
    binds), while the other is under its share served at once; a call past its share waits for one of its
    own to end, or for the other to stop being active (ACTIVE_SECONDS after its last call), and no longer
    than CALL_QUEUE_SECONDS."""
    monkeypatch.setattr(limits, "ACTIVE_SECONDS", 0.2)
    in_flight = InFlight(max_per_session=16, max_per_client=6, fair_share=4, queue_seconds=1, max_queued_per_client=4)
    hog = [in_flight.admit(None, "hog") for _ in range(5)]
    assert all(isinstance(call, Call) for call in hog)  # alone: past the share, within its bound
    other = in_flight.admit(None, "other")
    assert isinstance(other, Call)
    refused = in_flight.admit(None, "hog")
    assert isinstance(refused, str) and "FAIR_SHARE_CALLS" in refused
    second = in_flight.admit(None, "other")
    assert isinstance(second, Call)  # 2 of 2: its share
    assert isinstance(in_flight.admit(None, "other"), str)
    second.drop()
    # The hog's next waits: three of its own end (5 - 3 < 2), or the other's last call does and it lapses.
    waiting = asyncio.create_task(in_flight.wait_for_place(None, "hog"))
    for call in hog[:2]:
        call.drop()  # 3 in flight: still past its share
    await asyncio.sleep(0.05)
    assert not waiting.done()
    dropped_at = time.monotonic()
    other.drop()
    # A place (not the refusal CALL_QUEUE_SECONDS ends the wait with): when "other" stopped being active, not before.
    assert isinstance(await waiting, Call)
    assert time.monotonic() - dropped_at >= limits.ACTIVE_SECONDS
    # And with "other" active again, a wait past CALL_QUEUE_SECONDS gets a 429 naming both.
    assert isinstance(in_flight.admit(None, "other"), Call)
    late = await in_flight.wait_for_place(None, "hog")
    assert isinstance(late, str) and "FAIR_SHARE_CALLS" in late and "CALL_QUEUE_SECONDS" in late
