"""Adoption: a session outlives its replica, under the same id, and only while the store knows it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx2
import pytest
from conftest import replica_on

from mcp_ha.adoption import Ownership, Stalls
from mcp_ha.ops.check.wire import RawSession, final_message, last_jsonrpc_message
from mcp_ha.ops.stack import Stack


def direct(stack: Stack, http: httpx2.AsyncClient, replica: str, session_id: str) -> RawSession:
    """The same session, spoken to one replica directly, bypassing HAProxy."""
    session = RawSession(http, f"http://127.0.0.1:{stack.service(replica).port}/mcp")
    session.session_id = session_id
    return session


def redis_cli(stack: Stack, *args: str) -> str:
    result = subprocess.run(
        ["redis-cli", "-p", str(stack.config.redis_port), *args],
        capture_output=True,
        text=True,
        env=stack.config.redis_cli_env,
    )
    return result.stdout.strip()


async def test_a_killed_replicas_session_goes_on_under_the_same_id(healed_stack: Stack, raw: RawSession) -> None:
    for _ in range(3):
        replica = (await raw.call("increment_counter"))["instance"]
    await raw.call("add_note", {"note": "kept"})

    healed_stack.signal(replica, signal.SIGKILL)

    after = await raw.call("increment_counter")
    assert after["instance"] != replica and after["counter"] == 4
    assert (await raw.call("list_notes"))["notes"] == ["kept"]
    # ctx.session_id on the adopting replica is the id the client holds.
    assert (await raw.call("resume_session", {"old_session_id": raw.session_id}))["status"] == "same_session"


async def test_every_replica_can_serve_a_session_and_a_stale_owner_cannot_write(
    stack: Stack, raw: RawSession, http: httpx2.AsyncClient
) -> None:
    first = (await raw.call("increment_counter"))["instance"]
    others = [name for name in stack.config.replica_names() if name != first]
    adopter = direct(stack, http, others[0], raw.session_id)
    assert await adopter.call("increment_counter") == {"counter": 2, "instance": others[0]}

    # The first replica still holds the session in memory, at an older epoch: its write is refused.
    stale = direct(stack, http, first, raw.session_id)
    response = await stale.post("tools/call", {"name": "increment_counter", "arguments": {}})
    result = last_jsonrpc_message(response)["result"]
    assert result["isError"] and result["content"][0]["text"] == "This session moved to another replica; call again."
    # ...and its next request adopts the session afresh.
    assert await stale.call("increment_counter") == {"counter": 3, "instance": first}
    assert (await raw.call("get_counter"))["counter"] == 3


async def test_an_answer_says_when_its_replica_adopted_the_session_and_haproxy_keeps_it_to_itself(
    stack: Stack, raw: RawSession, http: httpx2.AsyncClient
) -> None:
    """The balancer learns a session's new replica from this header alone (haproxy.cfg), so it is on the
    answer of the request that took the session over, on no later one, and never reaches a client."""
    first = (await raw.call("increment_counter"))["instance"]
    other = next(name for name in stack.config.replica_names() if name != first)
    adopter = direct(stack, http, other, raw.session_id)
    call = {"name": "get_counter", "arguments": {}}
    taking = await adopter.post("tools/call", call)
    held = await adopter.post("tools/call", call)
    assert (taking.headers.get("x-mcp-ha-adopted"), held.headers.get("x-mcp-ha-adopted")) == ("1", None)
    # A GET only reads: it takes nothing over, and says nothing.
    reading = direct(stack, http, first, raw.session_id)
    async with http.stream("GET", reading.url, headers={**reading.headers(), "Accept": "text/event-stream"}) as got:
        assert got.status_code == 200 and "x-mcp-ha-adopted" not in got.headers
    # Through HAProxy, which has the session on `first`: its write there is fenced (keyed by HAProxy's request
    # id), so `first` takes the session back and runs the call once more, served, not "moved".
    retaken = last_jsonrpc_message(await raw.post("tools/call", {"name": "increment_counter", "arguments": {}}))
    assert retaken["result"]["structuredContent"] == {"counter": 2, "instance": first}
    back = await raw.post("tools/call", call)
    assert last_jsonrpc_message(back)["result"]["structuredContent"] == {"counter": 2, "instance": first}
    assert "x-mcp-ha-adopted" not in back.headers


async def test_a_burst_of_first_requests_on_an_adopting_replica_all_succeed(
    stack: Stack, raw: RawSession, http: httpx2.AsyncClient
) -> None:
    first = (await raw.call("increment_counter"))["instance"]
    other = next(name for name in stack.config.replica_names() if name != first)
    # As many as one session may have in flight on a replica (MAX_CALLS_PER_SESSION).
    burst = [direct(stack, http, other, raw.session_id) for _ in range(16)]
    for i, session in enumerate(burst):
        session._next_id = 100 * (i + 1)  # JSON-RPC ids must differ within a session
    # One request adopts; the others arrive while it does, and must not find a half-built transport.
    results = await asyncio.gather(*(s.call("increment_counter") for s in burst))
    assert sorted(r["counter"] for r in results) == list(range(2, 18))


async def test_an_id_the_store_does_not_know_is_404_on_every_replica(stack: Stack, http: httpx2.AsyncClient) -> None:
    unknown = uuid.uuid4().hex
    for replica in stack.config.replica_names():
        response = await direct(stack, http, replica, unknown).post("tools/call", {"name": "get_counter"})
        assert response.status_code == 404
    assert redis_cli(stack, "EXISTS", f"mcp:session:{unknown}") == "0"


async def test_delete_ends_the_session_everywhere(stack: Stack, raw: RawSession, http: httpx2.AsyncClient) -> None:
    await raw.call("increment_counter")
    response = await http.delete(raw.url, headers=raw.headers())
    assert response.status_code == 200
    assert redis_cli(stack, "HEXISTS", f"mcp:session:{raw.session_id}", ".epoch") == "0"
    assert redis_cli(stack, "HEXISTS", f"mcp:session:{raw.session_id}", ".client") == "0"
    for replica in stack.config.replica_names():
        response = await direct(stack, http, replica, raw.session_id).post("tools/call", {"name": "get_counter"})
        assert response.status_code == 404, replica
    assert (await http.delete(raw.url, headers=raw.headers())).status_code == 404


@pytest.mark.parametrize(
    ("field", "value"),
    [
        (".client", "not json at all"),
        (".client", "[1, 2]"),
        (".capabilities", '"none"'),
        (".version", '"1999-01-01"'),
        (".version", "2025-11-25"),
    ],
)
async def test_a_corrupt_or_unsupported_record_is_404_not_5xx(
    stack: Stack, raw: RawSession, http: httpx2.AsyncClient, field: str, value: str
) -> None:
    owner = (await raw.call("get_counter"))["instance"]
    redis_cli(stack, "HSET", f"mcp:session:{raw.session_id}", field, value)
    other = next(name for name in stack.config.replica_names() if name != owner)
    response = await direct(stack, http, other, raw.session_id).post("tools/call", {"name": "get_counter"})
    assert response.status_code == 404
    log = (stack.log_dir / f"{other}.log").read_text()
    assert f"not adopting {raw.session_id}" in log
    assert all(stack.pid(name) for name in stack.config.replica_names())


@pytest.mark.timeout(60)
async def test_a_paused_replica_cannot_apply_its_write_after_another_adopted(
    healed_stack: Stack, raw: RawSession
) -> None:
    """The zombie write: a replica paused mid-call wakes up after adoption; its write is fenced off."""
    replica = (await raw.call("increment_counter"))["instance"]
    slow = asyncio.create_task(raw.post("tools/call", {"name": "analyze_data", "arguments": {"num_items": 20}}))
    await asyncio.sleep(0.3)
    healed_stack.signal(replica, signal.SIGSTOP)
    while replica in healed_stack.backends_up():  # noqa: ASYNC110  polls HAProxy; bounded by the test's timeout
        await asyncio.sleep(0.05)

    moved = await raw.call("increment_counter")  # another replica adopts the session
    assert moved["instance"] != replica and moved["counter"] == 2

    healed_stack.signal(replica, signal.SIGCONT)
    # HAProxy cut the paused call's stream when it took the replica out; the replica,
    # woken up, runs the call to its end, and its final write is refused.
    with contextlib.suppress(httpx2.HTTPError):
        await slow
    log = healed_stack.log_dir / f"{replica}.log"
    deadline = asyncio.get_running_loop().time() + 15
    while "write fenced off during analyze_data" not in log.read_text():
        assert asyncio.get_running_loop().time() < deadline, "the woken replica never tried its write"
        await asyncio.sleep(0.1)
    summary = await raw.post("resources/read", {"uri": f"resource://session/{raw.session_id}/summary"})
    assert json.loads(last_jsonrpc_message(summary)["result"]["contents"][0]["text"])["analysis_result"] is None
    assert (await raw.call("get_counter"))["counter"] == 2


def session_epoch(stack: Stack, session_id: str) -> str:
    return redis_cli(stack, "HGET", f"mcp:session:{session_id}", ".epoch")


async def held_post(port: int, raw: RawSession, name: str) -> None:
    """A `tools/call` written to a replica's socket as HAProxy forwards it (its request id, the idempotency key),
    then the connection closed: the client is gone. A paused replica reads it only once it runs again."""
    body = json.dumps({"jsonrpc": "2.0", "id": 99, "method": "tools/call", "params": {"name": name, "arguments": {}}})
    headers = {**raw.headers(), "X-Request-Id": uuid.uuid4().hex, "Host": f"127.0.0.1:{port}"}
    head = "POST /mcp HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head += f"Content-Length: {len(body)}\r\n\r\n"
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head.encode() + body.encode())
    await writer.drain()
    writer.close()


@pytest.mark.timeout(90)
async def test_a_paused_replica_that_comes_back_takes_nothing_over_for_the_requests_it_held(
    healed_stack: Stack, raw: RawSession
) -> None:
    """SIGSTOP; a call held in the paused replica's socket, its client gone; another replica adopts the session;
    the pause outlasts SESSION_IDLE_SECONDS (the held session's transport idles out); SIGCONT; the next call. The
    woken replica takes nothing over for the request it held, so the next call is served, not "moved"."""
    replica = (await raw.call("increment_counter"))["instance"]
    healed_stack.signal(replica, signal.SIGSTOP)
    stopped_at = time.monotonic()
    await held_post(healed_stack.service(replica).port, raw, "increment_counter")
    while replica in healed_stack.backends_up():  # noqa: ASYNC110  polls HAProxy; bounded by the test's timeout
        await asyncio.sleep(0.05)
    moved = await raw.call("increment_counter")
    assert moved["instance"] != replica and moved["counter"] == 2
    epoch = session_epoch(healed_stack, raw.session_id)
    # The clock runs through a pause: past the idle time, the paused replica's transport idles out on waking.
    await asyncio.sleep(max(0.0, stopped_at + 5.5 - time.monotonic()))
    healed_stack.signal(replica, signal.SIGCONT)
    log = healed_stack.log_dir / f"{replica}.log"
    # Whatever it does with it, it logs: declines it, meets a fence, or (what it must not) adopts the session.
    answered = (
        f"session {raw.session_id} not taken over",
        "write fenced off during increment_counter",
        f"adopted session {raw.session_id}",
    )
    deadline = time.monotonic() + 20
    while not any(line in log.read_text() for line in answered):
        assert time.monotonic() < deadline, "the woken replica never read the request it held"
        await asyncio.sleep(0.1)
    assert session_epoch(healed_stack, raw.session_id) == epoch
    after = await raw.call("increment_counter")
    assert after == {"counter": 3, "instance": moved["instance"]}


@pytest.mark.quick
async def test_a_stall_is_seen_at_once_and_for_a_moment_after_the_loop_ticks_again() -> None:
    now = [0.0]
    stalls = Stalls(stall_seconds=1.0, clock=lambda: now[0])
    assert not stalls.just_woke()  # not watching: never refuses
    watch = asyncio.create_task(stalls.watch())
    try:
        await asyncio.sleep(0.15)
        assert not stalls.just_woke()
        now[0] = 5.0  # the loop stood still 5 s: the first requests read find no tick since
        assert stalls.just_woke()
        await asyncio.sleep(0.15)  # it ticked late, at 5.0
        now[0] = 5.6
        assert stalls.just_woke()
        await asyncio.sleep(0.15)
        now[0] = 6.1
        await asyncio.sleep(0.15)
        assert not stalls.just_woke()
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    assert not stalls.just_woke()


def test_ownership_forgets_sessions_no_longer_served() -> None:
    ownership = Ownership()
    ownership.epochs.update({"a" * 32: 1, "b" * 32: 3})
    ownership.lost("b" * 32)
    ownership.prune(lambda sid: sid == "a" * 32)
    assert ownership.epochs == {"a" * 32: 1} and ownership.stale == set()


async def raw_request(port: int, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One HTTP/1.1 request written byte for byte (clients refuse to send such headers); status and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def store_operations(text: str) -> float:
    """Every store operation a replica has timed so far (/metrics): any that touched Redis."""
    return sum(float(n) for n in re.findall(r"^mcp_store_operation_duration_seconds_count\{[^}]*\} (\S+)$", text, re.M))


@pytest.mark.parametrize("form", ["short", "uppercase", "a path", "non-ASCII", "control characters", "very long"])
async def test_a_session_id_the_kit_never_minted_is_a_4xx_and_reaches_neither_redis_nor_a_log(
    stack: Stack, http: httpx2.AsyncClient, form: str
) -> None:
    marker = uuid.uuid4().hex[:20]
    session_id = {
        "short": marker.encode(),
        "uppercase": (marker + "ABCDEF012345").encode(),
        "a path": f"{marker}/../../admin".encode(),
        "non-ASCII": marker.encode() + "é€".encode() + b"\xff",
        "control characters": marker.encode() + b"\x1b[2J\x07\x00",
        "very long": marker.encode() * 500,
    }[form]
    body = json.dumps(
        {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "get_counter", "arguments": {}}}
    ).encode()

    def head(value: bytes) -> bytes:
        return (
            b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Accept: application/json, text/event-stream\r\nMCP-Protocol-Version: 2025-11-25\r\n"
            b"mcp-session-id: " + value + b"\r\n"
        )

    replicas = stack.config.replica_names()
    metrics = [f"http://127.0.0.1:{stack.service(name).port}/metrics" for name in replicas]
    unknown = await raw_request(stack.service(replicas[0]).port, head(uuid.uuid4().hex.encode()), body)
    before = [store_operations((await http.get(url)).text) for url in metrics]

    for port in (stack.config.http_port, *(stack.service(name).port for name in replicas)):
        status, answer = await raw_request(port, head(session_id), body)
        assert 400 <= status < 500, (port, status, answer)
        if status == 404:  # a replica's answer: the SDK's to an unknown id, byte for byte
            assert (status, answer) == unknown

    assert [store_operations((await http.get(url)).text) for url in metrics] == before
    await asyncio.sleep(0.5)  # a log line is written as the answer goes out: give the last one time to land
    for name in replicas:
        assert marker not in (stack.log_dir / f"{name}.log").read_text(errors="replace")


# -- what a session costs a replica: SESSION_IDLE_SECONDS, MAX_TRANSPORTS_PER_CLIENT --


async def held(http: httpx2.AsyncClient, url: str) -> int:
    """How many session transports the replica at `url` holds (its /metrics)."""
    text = (await http.get(url.removesuffix("/mcp") + "/metrics")).text
    return int(float(re.search(r"^mcp_sessions_held (\S+)$", text, re.M).group(1)))  # type: ignore[union-attr]


LONG_CALL = {"name": "analyze_data", "arguments": {"num_items": 60}}  # 3 s of work, streamed


async def test_past_max_transports_per_client_its_least_recently_used_idle_ones_are_forgotten(
    redis_stack: Stack, tmp_path: Path
) -> None:
    with replica_on(redis_stack, tmp_path, "transports", MAX_TRANSPORTS_PER_CLIENT="3", METRICS="on") as replica:
        async with httpx2.AsyncClient(timeout=30) as http:
            busy = RawSession(http, replica.url)
            await busy.initialize()
            async with busy.stream("tools/call", LONG_CALL) as stream:
                events = aiter(stream)
                await anext(events)
                # Every session here is one client's (one address): five more, each used once.
                sessions = [RawSession(http, replica.url) for _ in range(5)]
                for session in sessions:
                    await session.initialize()
                    assert (await session.call("increment_counter"))["counter"] == 1
                assert await held(http, replica.url) == 3
                # The least recently used one was busy with a call: it was not forgotten, and its call ends well.
                answer = [event.message async for event in events if event.message][-1]
                assert answer["result"]["structuredContent"]["items_processed"] == 60
            log = replica.log.read_text()
            forgotten = [s for s in sessions if f"forgot the transport of session {s.session_id}" in log]
            assert [s.session_id for s in forgotten] == [s.session_id for s in sessions[:3]]
            assert f"forgot the transport of session {busy.session_id}" not in log
            # A forgotten one is adopted back on its next request, its state whole.
            for session in forgotten:
                assert (await session.call("increment_counter"))["counter"] == 2
            assert await held(http, replica.url) == 3


async def test_a_session_with_a_call_running_or_a_stream_open_is_not_idle(redis_stack: Stack, tmp_path: Path) -> None:
    with replica_on(redis_stack, tmp_path, "idle", SESSION_IDLE_SECONDS="1", METRICS="on") as replica:
        async with httpx2.AsyncClient(timeout=30) as http:
            session = RawSession(http, replica.url)
            await session.initialize()
            # A call three times the idle timeout long, whose client hangs up after its first event: the
            # session stays, the call runs to its end, and the stream resumed afterwards delivers its answer.
            async with session.stream("tools/call", LONG_CALL) as stream:
                first = await anext(aiter(stream))
            assert first.id is not None
            await asyncio.sleep(3.5)
            async with session.resume(first.id) as resumed:
                messages = [event.message async for event in resumed if event.message]
            assert messages[-1]["result"]["structuredContent"]["items_processed"] == 60
            assert "adopted session" not in replica.log.read_text()
            # An open GET stream holds the session too; closed, the session idles out.
            headers = {**session.headers(), "Accept": "text/event-stream"}
            async with http.stream("GET", replica.url, headers=headers) as listening:
                assert listening.status_code == 200
                await asyncio.sleep(2.5)
                assert await held(http, replica.url) == 1
            deadline = time.monotonic() + 15
            while await held(http, replica.url):
                assert time.monotonic() < deadline, "the idle session was never forgotten"
                await asyncio.sleep(0.2)
            # Forgotten, not lost: the next call adopts it again.
            response = await session.post("tools/call", {"name": "increment_counter", "arguments": {}})
            assert final_message(response)["result"]["structuredContent"]["counter"] == 1


async def test_a_request_that_meets_its_transport_ending_is_served_not_404(redis_stack: Stack, tmp_path: Path) -> None:
    """A transport ending (idle, or forgotten for another of its client's) is still in the SDK's table until
    its task unwinds; a request for its session then must be adopted again, not told the session is gone."""
    with replica_on(
        redis_stack, tmp_path, "ending", MAX_TRANSPORTS_PER_CLIENT="1", SESSION_IDLE_SECONDS="0.2"
    ) as replica:
        async with httpx2.AsyncClient(timeout=30) as http:
            sessions = [RawSession(http, replica.url) for _ in range(2)]
            for session in sessions:
                await session.initialize()
            # One client, two sessions, one transport: each call forgets the other session's transport, and
            # each pause lets the idle timeout end it. Bounded: 60 rounds.
            statuses: list[int] = []
            for round_ in range(60):
                responses = await asyncio.gather(
                    *(s.post("tools/call", {"name": "increment_counter", "arguments": {}}) for s in sessions)
                )
                statuses += [r.status_code for r in responses]
                await asyncio.sleep(0.19 + (round_ % 5) * 0.005)
            assert statuses == [200] * 120, [(i, s) for i, s in enumerate(statuses) if s != 200][:5]
            for session in sessions:
                assert (await session.call("get_counter"))["counter"] == 60
