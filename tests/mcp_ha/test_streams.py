"""Resumable streams: a call's SSE stream, cut mid-way, resumes on any replica with every event exactly once.

Through HAProxy and the real replicas; the resuming `GET` goes either through
HAProxy (back to the replica running the call) or straight to another one.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx2
import pytest
import uvicorn
from conftest import Replica, free_ports, move_slot, rerun_bound, slot_owner, starts, two_replicas
from mcp.server.streamable_http import EventMessage
from mcp.shared.exceptions import MCPError
from redis.crc import key_slot
from starlette.responses import PlainTextResponse

from mcp_ha._sdk import InlineClient
from mcp_ha.idempotency import IDEMPOTENCY_KEY
from mcp_ha.ops.check.wire import Event, RawSession, SessionlessSession, final_message
from mcp_ha.ops.stack import REDIS_KIT_ACL, Stack
from mcp_ha.session_store import SessionStore, mint_event_id
from mcp_ha.stores.memory_store import InMemorySessionStore
from mcp_ha.stores.redis_store import RedisSessionStore
from mcp_ha.streams.cut import CUT, CUT_KEYED, CUT_MARK, CUT_RETRY_MS, cut_call_named, cut_error, cut_event_id
from mcp_ha.streams.event_store import MAX_RERUN_REQUEST_BYTES, SessionEvents
from mcp_ha.streams.feed import EventFeed
from mcp_ha.streams.lease import Runs
from mcp_ha.streams.reruns import Rerun, Reruns
from mcp_ha.streams.resumption import MALFORMED, UNAVAILABLE, UNKNOWN, CheckResumption

ITEMS = 30
ANALYSIS = {"name": "analyze_data", "arguments": {"num_items": ITEMS}, "_meta": {"progressToken": "analysis"}}
# How long a test waits for an answer (one it may then time against a bound of its own): no measure, only
# against a hang, well inside the tests' own timeouts.
HANG_GUARD_SECONDS = 30


def replica_url(stack: Stack, replica: str) -> str:
    return f"http://127.0.0.1:{stack.service(replica).port}/mcp"


def progress(events: list[Event]) -> list[float]:
    return [
        e.message["params"]["progress"]
        for e in events
        if e.message and e.message.get("method") == "notifications/progress"
    ]


async def analysis_cut_after(raw: RawSession, progress_seen: int) -> tuple[int, list[Event]]:
    """Start a 30-item analysis and cut its stream once `progress_seen` progress events have arrived."""
    events: list[Event] = []
    async with raw.stream("tools/call", ANALYSIS) as stream:
        assert stream.response.status_code == 200
        async for event in stream:
            events.append(event)
            if len(progress(events)) == progress_seen:
                break
    return stream.request_id, events


async def resumed_to_the_end(session: RawSession, last_event_id: str) -> list[Event]:
    """Everything a resumed stream sends; the server ends it after the call's answer."""
    async with session.resume(last_event_id) as stream:
        assert stream.response.status_code == 200, await stream.response.aread()
        return [event async for event in stream]


def assert_every_event_once(before: list[Event], after: list[Event], request_id: int, owner: str) -> None:
    everything = before + after
    ids = [event.id for event in everything]
    assert None not in ids and len(set(ids)) == len(ids), "an event without an id, or one sent twice"
    assert progress(before) and progress(after), "the cut was not mid-call"
    assert sorted(progress(everything)) == list(range(1, ITEMS + 1)), "a progress event lost or repeated"
    answer = after[-1].message
    assert answer["id"] == request_id
    # Computed and written by the replica that ran the call.
    assert answer["result"]["structuredContent"] == {
        "items_processed": ITEMS,
        "total_score": 1.5 * sum(range(1, ITEMS + 1)),
        "instance": owner,
    }


async def test_a_stream_cut_mid_call_resumes_on_another_replica_exactly_once(stack: Stack, raw: RawSession) -> None:
    owner = (await raw.call("get_counter"))["instance"]  # where HAProxy pins the session
    request_id, before = await analysis_cut_after(raw, progress_seen=5)

    elsewhere = next(name for name in stack.config.replica_names() if name != owner)
    after = await resumed_to_the_end(raw.at(replica_url(stack, elsewhere)), before[-1].id)

    assert_every_event_once(before, after, request_id, owner)
    # The owner still owns the session: its next write is not fenced off.
    assert await raw.call("increment_counter") == {"counter": 1, "instance": owner}


async def test_a_stream_cut_mid_call_resumes_through_haproxy_exactly_once(raw: RawSession) -> None:
    owner = (await raw.call("get_counter"))["instance"]
    request_id, before = await analysis_cut_after(raw, progress_seen=5)
    # Back to the replica running the call, whose live copies of the events go nowhere now.
    after = await resumed_to_the_end(raw, before[-1].id)
    assert_every_event_once(before, after, request_id, owner)


async def test_a_stream_resumes_from_its_first_event(raw: RawSession) -> None:
    """A call answers as JSON until it has something to stream: its stream starts with that (a log line),
    carrying the SSE retry field; a client that got nothing else gets the whole call."""
    owner = (await raw.call("get_counter"))["instance"]
    async with raw.stream("tools/call", ANALYSIS) as stream:
        assert stream.response.headers["content-type"].startswith("text/event-stream")
        first = await anext(aiter(stream))
    assert first.id is not None and first.message["method"] == "notifications/message"
    after = await resumed_to_the_end(raw, first.id)
    assert sorted(progress(after)) == list(range(1, ITEMS + 1))
    assert after[-1].message["id"] == stream.request_id
    assert after[-1].message["result"]["structuredContent"]["instance"] == owner


async def test_a_call_with_nothing_to_stream_is_one_json_answer(raw: RawSession) -> None:
    response = await raw.post("tools/call", {"name": "increment_counter", "arguments": {}})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.json()["result"]["structuredContent"]["counter"] == 1


KILL_AFTER_PROGRESS = 3


@dataclass
class Killed:
    """A streamed call whose replica was killed under it: the events before, and when things happened."""

    request_id: int
    before: list[Event]
    owner: str  # the replica killed
    called_at: float  # time.monotonic(), as the call was sent
    killed_at: float  # ... once KILL_AFTER_PROGRESS progress notifications had arrived

    @property
    def before_kill(self) -> float:
        """The call's start and first KILL_AFTER_PROGRESS items, timed in this run."""
        return self.killed_at - self.called_at


async def cut_after_kill(stack: Stack, raw: RawSession, call: dict) -> Killed:
    """Start `call` (an analysis) through HAProxy, and once it streams progress, kill -9 its replica."""
    owner = (await raw.call("get_counter"))["instance"]
    events: list[Event] = []
    called_at = time.monotonic()
    async with raw.stream("tools/call", call) as stream:
        async for event in stream:
            events.append(event)
            if len(progress(events)) == KILL_AFTER_PROGRESS:
                stack.signal(owner, signal.SIGKILL)
                killed_at = time.monotonic()
                break
    return Killed(stream.request_id, events, owner, called_at, killed_at)


async def test_a_streaming_call_whose_replica_is_killed_completes_once_on_resume(
    healed_stack: Stack, raw: RawSession
) -> None:
    """Its replica's lease lapses, and the replica the client resumes on runs the call again under the same
    idempotency key, into the same stream: the client gets the answer, with the call's effects once."""
    await raw.call("increment_counter")
    killed = await cut_after_kill(healed_stack, raw, ANALYSIS)
    elsewhere = next(name for name in healed_stack.config.replica_names() if name != killed.owner)
    # The re-run does the whole analysis again (its first checkpoint was not reached).
    bound = rerun_bound(work_seconds=killed.before_kill * ITEMS / KILL_AFTER_PROGRESS)
    async with asyncio.timeout(HANG_GUARD_SECONDS):
        after = await resumed_to_the_end(raw.at(replica_url(healed_stack, elsewhere)), killed.before[-1].id)
    answered_in = time.monotonic() - killed.killed_at
    print(
        f"raw client: answered {answered_in:.2f} s after the kill of {killed.owner} (the issue's target: 5 s; "
        f"bound here {bound:.2f} s, the call's start and {KILL_AFTER_PROGRESS} items {killed.before_kill:.2f} s)"
    )
    before, request_id = killed.before, killed.request_id
    answer = after[-1].message
    assert answer["id"] == request_id, after[-3:]
    assert answer["result"]["structuredContent"] == {
        "items_processed": ITEMS,
        "total_score": 1.5 * sum(range(1, ITEMS + 1)),
        "instance": elsewhere,
    }
    assert answered_in <= bound, f"answered {answered_in:.2f} s after the kill (bound {bound:.2f} s)"
    # Progress only ever rises (the spec's rule), though the re-run reported its own from the start.
    seen = progress(before + after)
    assert seen == sorted(set(seen)) and seen[-1] == ITEMS, seen
    # The session goes on where the call left it: nothing else changed, nothing applied twice.
    raw_elsewhere = raw.at(replica_url(healed_stack, elsewhere))
    assert (await raw_elsewhere.call("get_counter"))["counter"] == 1


async def test_a_streaming_call_that_cannot_run_again_ends_at_once_saying_a_retry_is_safe(
    healed_stack: Stack, raw: RawSession
) -> None:
    """A request too large to keep for a re-run: once its replica is gone the stream ends with a JSON-RPC
    error for that request, saying a retry is safe, instead of falling silent."""
    padded = {**ANALYSIS, "_meta": {**ANALYSIS["_meta"], "padding": "x" * (MAX_RERUN_REQUEST_BYTES + 1)}}
    killed = await cut_after_kill(healed_stack, raw, padded)
    elsewhere = next(name for name in healed_stack.config.replica_names() if name != killed.owner)
    # No work to do again: the replay's own, no more than the call's start took.
    bound = rerun_bound(work_seconds=killed.before_kill)
    async with asyncio.timeout(HANG_GUARD_SECONDS):
        after = await resumed_to_the_end(raw.at(replica_url(healed_stack, elsewhere)), killed.before[-1].id)
    ended_in = time.monotonic() - killed.killed_at
    print(f"ended {ended_in:.2f} s after the kill (bound {bound:.2f} s, the call's start {killed.before_kill:.2f} s)")
    error = after[-1].message
    assert error["id"] == killed.request_id and "Retrying it is safe" in error["error"]["message"], error
    assert ended_in <= bound, f"ended {ended_in:.2f} s after the kill (bound {bound:.2f} s)"


async def resume_status_and_body(session: RawSession, last_event_id: str) -> tuple[int, str]:
    async with session.resume(last_event_id) as stream:
        return stream.response.status_code, (await stream.response.aread()).decode()


def jsonrpc_error(body: str) -> str:
    message = json.loads(body)
    assert message["jsonrpc"] == "2.0" and message["id"] is None and message["error"]["code"] == -32600
    return message["error"]["message"]


async def test_an_event_id_of_another_session_is_404_and_reveals_nothing(
    stack: Stack, raw: RawSession, http: httpx2.AsyncClient, mcp_url: str
) -> None:
    async with raw.stream("tools/call", {"name": "analyze_data", "arguments": {"num_items": 0}}) as stream:
        events_of_a = [event async for event in stream]
    other = RawSession(http, mcp_url)
    await other.initialize()
    unknown = f"{events_of_a[0].id.split('.')[0]}.{'0' * 8}"  # well-formed, nobody's

    _, answer_for_unknown = await resume_status_and_body(other, unknown)
    for session in [other, *(other.at(replica_url(stack, name)) for name in stack.config.replica_names())]:
        for event in events_of_a:
            status, body = await resume_status_and_body(session, event.id)
            assert status == 404
            # The very answer an id nobody has gets: nothing of the other session in it.
            assert body == answer_for_unknown and jsonrpc_error(body) == UNKNOWN
            assert raw.session_id not in body and "secret" not in body


@pytest.mark.parametrize(
    "last_event_id",
    [
        "x",
        "999999999999999-0",
        "*",
        "$",
        "+",
        "-",
        "0-0",
        "(1-0",
        "1-0.ZZZZZZZZ",
        "1-0.0123456",
        "99999999999999999999-0.01234567",
        "9" * 8000,
        "1-0.01234567" + "a" * 8000,
    ],
)
async def test_a_malformed_last_event_id_is_a_4xx_everywhere(stack: Stack, raw: RawSession, last_event_id: str) -> None:
    for session in [raw, *(raw.at(replica_url(stack, name)) for name in stack.config.replica_names())]:
        status, body = await resume_status_and_body(session, last_event_id)
        assert 400 <= status < 500, (status, body)
        if status == 400:
            assert jsonrpc_error(body) == MALFORMED


async def test_resuming_an_unknown_session_is_404(raw: RawSession, mcp_url: str) -> None:
    async with raw.stream("tools/call", {"name": "analyze_data", "arguments": {"num_items": 0}}) as stream:
        event_id = (await anext(aiter(stream))).id
    raw.session_id = uuid.uuid4().hex
    assert (await resume_status_and_body(raw, event_id))[0] == 404


@pytest.fixture
async def unreachable_store_app() -> AsyncIterator[str]:
    """CheckResumption in front of an app that answers 200, with Redis on a port nobody listens on."""
    closed_port, port = free_ports(2)
    store = RedisSessionStore(f"redis://127.0.0.1:{closed_port}/0", timeout_seconds=0.3, retry_seconds=0.3)
    app = CheckResumption(
        PlainTextResponse("resumed"), store=store, reruns=Reruns(), max_per_session=8, max_replays=256
    )
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110  uvicorn sets a flag, not an event, once listening
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        server.should_exit = True
        await task
        await store.aclose()


@pytest.mark.timeout(30)
@pytest.mark.quick
async def test_resuming_while_the_store_is_unreachable_is_503(
    unreachable_store_app: str, http: httpx2.AsyncClient
) -> None:
    session = RawSession(http, unreachable_store_app)
    session.session_id = uuid.uuid4().hex
    status, body = await resume_status_and_body(session, mint_event_id(session.session_id, "1-0"))
    assert status == 503 and jsonrpc_error(body) == UNAVAILABLE
    # A malformed id needs no store to be refused.
    assert (await resume_status_and_body(session, "x"))[0] == 400


async def test_a_2026_client_whose_streaming_call_loses_its_replica_is_told_at_once(
    healed_stack: Stack, mcp_url: str
) -> None:
    """2026-07-28 has no stream resumption: a kill -9 of the replica streaming a call cuts the client's stream,
    whose priming event told it to reconnect after CUT_RETRY_MS; any replica then answers that the call ended,
    so a client that retries can do so, instead of waiting out its timeout."""

    started: asyncio.Future[tuple[str, float]] = asyncio.get_running_loop().create_future()

    async def on_log(message) -> None:
        text = message.data["msg"] if isinstance(message.data, dict) else str(message.data)
        if "Starting analysis" in text and not started.done():
            started.set_result((text.rsplit(" ", 1)[-1], time.monotonic()))

    # A client without FastMCP's tasks extension (conftest.py imports it): with it, the call is a task.
    async with InlineClient(mcp_url, timeout=60, log_handler=on_log) as client:
        handle = (await client.call_tool("create_session", {})).data["session_id"]
        called_at = time.monotonic()
        call = asyncio.create_task(
            client.call_tool("analyze_data", {"num_items": 400, "session_id": handle}, raise_on_error=False)
        )
        async with asyncio.timeout(HANG_GUARD_SECONDS):
            replica, running_at = await started
        healed_stack.signal(replica, signal.SIGKILL)
        killed_at = time.monotonic()
        # The client's wait, then a request any replica answers: twice what the call's start took in this run
        # (through HAProxy to a replica, and a message back).
        bound = CUT_RETRY_MS / 1000 + 2 * (running_at - called_at)
        outcome: object = None
        try:
            async with asyncio.timeout(HANG_GUARD_SECONDS):
                outcome = await call
        except TimeoutError:
            outcome = f"no answer within {HANG_GUARD_SECONDS} s"
        except Exception as exc:  # the connection closed under the call: what the client should see
            outcome = exc
        told_after = time.monotonic() - killed_at
        print(
            f"2026-07-28 client told {told_after:.2f} s after its replica's kill (bound {bound:.2f} s, the call's "
            f"start {running_at - called_at:.2f} s): {outcome!r}"[:300]
        )
        # The kit's answer to the cut, not the client's own timeout.
        assert isinstance(outcome, MCPError) and outcome.error.data == {"retryable": True}, outcome
        assert CUT.format(retry="") in outcome.error.message, outcome
        assert told_after <= bound, f"told after {told_after:.2f} s (bound {bound:.2f} s): {outcome!r}"


async def test_a_re_run_the_replica_refuses_is_reported_with_its_answer() -> None:
    """A re-run answered other than 200 (the session ended meanwhile, the store out) is told to the replay,
    which ends the call's stream with an error saying a retry is safe, instead of waiting for it. A re-run
    runs only for a session whose replay is served here, and its stream is expected only until it ends."""
    reruns = Reruns()
    told: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    posted: list[dict] = []

    async def gone(scope: dict, receive: object, send: object) -> None:
        posted.append(scope)
        assert reruns.take("s", "5") == "5~0123456789ab"  # what its transport asks, once
        assert reruns.take("s", "5") is None
        await PlainTextResponse("gone", status_code=404)(scope, receive, send)  # type: ignore[arg-type]

    async def refused(why: str) -> None:
        told.set_result(why)

    scope = {"type": "http", "method": "GET", "path": "/mcp", "headers": [(b"last-event-id", b"1-0.x")]}
    request = json.dumps({"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": {"name": "t", "arguments": {}}})
    rerun = Rerun("s", "5~0123456789ab", "5", request, "a-key", refused)
    assert reruns.start(rerun) is False  # no replay of "s" served here
    with reruns.replaying("s", scope, gone):
        assert reruns.start(rerun) is True
    assert "answered 404" in await asyncio.wait_for(told, 5)
    (post,) = posted
    assert post["method"] == "POST" and (b"x-request-id", b"a-key") in post["headers"]
    assert not any(name == b"last-event-id" for name, _ in post["headers"])


# -- a 2026-07-28 call whose stream is cut: told at once, by any replica (issue 26) -----------------------------


def analysis_of(items: int, handle: str | None = None, *, key: str | None = None) -> dict:
    arguments = {"num_items": items, **({"session_id": handle} if handle else {})}
    meta = {"progressToken": "p", **({IDEMPOTENCY_KEY: key} if key else {})}
    return {"name": "analyze_data", "arguments": arguments, "_meta": meta}


def cut_id(text: str) -> str:
    """A cut-call event id for a JSON text of our choosing (well-formed or not)."""
    return CUT_MARK + base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
async def test_a_sessionless_streamed_call_opens_with_an_event_naming_its_request(
    mcp_url: str, http: httpx2.AsyncClient, keyed: bool
) -> None:
    session = SessionlessSession(http, mcp_url)
    call = analysis_of(3, await session.open(), key=uuid.uuid4().hex if keyed else None)
    async with session.stream("tools/call", call) as stream:
        text = (await stream.response.aread()).decode()
    priming, _, _ = text.partition("\r\n\r\n")
    event_id, retry, data = priming.split("\r\n")
    assert event_id.startswith(f"id: {CUT_MARK}") and (retry, data) == (f"retry: {CUT_RETRY_MS}", "data: "), text[:300]
    assert cut_call_named(event_id.removeprefix("id: ")) == (stream.request_id, keyed)
    # The call is answered as ever.
    answer = final_message(stream.response)
    assert answer["id"] == stream.request_id and answer["result"]["structuredContent"]["items_processed"] == 3


async def test_listen_streams_and_session_era_streams_get_no_cut_event(
    raw: RawSession, mcp_url: str, http: httpx2.AsyncClient
) -> None:
    """A listen stream's client learns at once that it ended; a session-era stream resumes from its log."""
    listening = SessionlessSession(http, mcp_url)
    async with listening.stream("subscriptions/listen", {"notifications": {"toolsListChanged": True}}) as stream:
        assert stream.response.headers["content-type"].startswith("text/event-stream")
        first = await anext(aiter(stream))
    assert first.message is not None and first.message["method"] == "notifications/subscriptions/acknowledged", first
    async with raw.stream("tools/call", analysis_of(3)) as stream:
        event_ids = [event.id for event in [event async for event in stream]]
    assert event_ids and not any(str(event_id).startswith(CUT_MARK) for event_id in event_ids), event_ids


@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
async def test_resuming_a_cut_sessionless_call_answers_its_error_on_any_replica(
    stack: Stack, mcp_url: str, http: httpx2.AsyncClient, keyed: bool
) -> None:
    """The GET a client sends once its stream is cut is answered at once, by any replica and with no store
    read, with an error for the cut request: the call is not running, and a retry is safe."""
    session = SessionlessSession(http, mcp_url)
    call = analysis_of(40, await session.open(), key=uuid.uuid4().hex if keyed else None)
    async with session.stream("tools/call", call) as stream:
        priming = await anext(aiter(stream))
    # Leaving the block cut the stream, which ends a 2026-07-28 call.
    assert priming.message is None and str(priming.id).startswith(CUT_MARK), priming
    expected = cut_error(stream.request_id, keyed).model_dump(by_alias=True, exclude_unset=True)
    for at in [session, *(session.at(replica_url(stack, name)) for name in stack.config.replica_names())]:
        async with asyncio.timeout(5), at.resume(str(priming.id)) as resumed:
            assert resumed.response.status_code == 200
            assert resumed.response.headers["content-type"].startswith("text/event-stream")
            events = [event async for event in resumed]
        assert [event.message for event in events] == [expected]
    error = expected["error"]
    assert error["code"] == -32603 and error["data"] == {"retryable": True}
    assert (CUT_KEYED in error["message"]) is keyed and (IDEMPOTENCY_KEY in error["message"]) is not keyed


BAD_CUT_IDS = [
    CUT_MARK,
    CUT_MARK + "!!!",
    CUT_MARK + "A" * 8000,
    CUT_MARK + "\xfc",
    cut_id("[1]"),
    cut_id("[1,true,3]"),
    cut_id("[1.5,true]"),
    cut_id("[true,true]"),
    cut_id("[null,false]"),
    cut_id('[1,"yes"]'),
    cut_id('{"id":1}'),
    cut_id("not json"),
    cut_id("[" * 300),
    cut_id(json.dumps(["x" * 400, True])),  # well-formed, but longer than any the kit mints
    CUT_MARK + base64.urlsafe_b64encode(b"\xff\xfe[1,true]").decode(),
    cut_id("[1,true]") + "%",
]


@pytest.mark.quick
def test_only_the_ids_the_kit_mints_name_a_cut_call() -> None:
    for request_id in [0, -1, 2**63, "", "a b", '\u00fc\n"', "x" * 200]:
        for keyed in (False, True):
            minted = cut_event_id(request_id, keyed)
            assert minted is not None and cut_call_named(minted) == (request_id, keyed)
    # Ids a cut event cannot name: no priming event, so the client does as it did without one.
    assert [cut_event_id(rid, False) for rid in (None, True, 1.5, [1], {"a": 1}, "x" * 300)] == [None] * 6
    assert [cut_call_named(bad) for bad in BAD_CUT_IDS] == [None] * len(BAD_CUT_IDS)


async def test_a_malformed_cut_id_is_refused_cleanly_everywhere(
    stack: Stack, raw: RawSession, mcp_url: str, http: httpx2.AsyncClient
) -> None:
    """A forged or broken id of the cut-call form gets the SDK's usual answer to a 2026-07-28 GET (405), and
    a session's GET the 400 of any malformed id: never a 5xx."""
    session = SessionlessSession(http, mcp_url)
    urls = [mcp_url, *(replica_url(stack, name) for name in stack.config.replica_names())]
    statuses = set()
    for url in urls:
        for bad in BAD_CUT_IDS:
            headers = {**session.headers(), "Last-Event-ID": bad.encode("latin-1")}
            response = await http.get(url, headers=headers)
            statuses.add(response.status_code)
            assert 400 <= response.status_code < 500, (url, bad[:40], response.status_code, response.text[:200])
    assert statuses <= {400, 405, 431}, statuses
    status, body = await resume_status_and_body(raw, cut_event_id(1, True) or "")
    assert status == 400 and jsonrpc_error(body) == MALFORMED


@pytest.mark.parametrize("body", [b"not json", b"[" * 100_000, b'{"jsonrpc":"2.0","id":1}', b"\xff\xfe"])
async def test_a_sessionless_post_that_is_no_request_is_answered_as_without_the_kit(
    mcp_url: str, http: httpx2.AsyncClient, body: bytes
) -> None:
    headers = SessionlessSession(http, mcp_url).headers()
    response = await http.post(mcp_url, headers=headers, content=body)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:200])
    assert CUT_MARK not in response.text


# -- what following a stream costs (issue 25) ------------------------------------------------------------------

NOTE = json.dumps({"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": "x"}})


# Marked by what `getfixturevalue` below starts (conftest's hook cannot see it): the memory case stays quick.
@pytest.fixture(
    params=[
        "memory",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=[pytest.mark.redis, pytest.mark.slow]),
    ]
)
async def events_store(request: pytest.FixtureRequest) -> AsyncIterator[SessionStore]:
    if request.param == "memory":
        yield InMemorySessionStore(max_events=8)
        return
    prefix = f"mcp:t{uuid.uuid4().hex[:8]}"
    if request.param == "cluster":
        cluster: Stack = request.getfixturevalue("redis_cluster")
        nodes = [(cluster.config.host, port) for port in cluster.config.cluster_ports]
        store = RedisSessionStore(cluster_nodes=nodes, **cluster.config.redis_auth, prefix=prefix, max_events=8)
    else:
        redis_stack: Stack = request.getfixturevalue("redis_stack")
        store = RedisSessionStore(
            redis_stack.config.redis_url, **redis_stack.config.redis_auth, prefix=prefix, max_events=8
        )
    try:
        yield store
    finally:
        await store.aclose()


@pytest.mark.timeout(30)
async def test_stream_since_gives_the_streams_events_after_any_event_and_the_latest(events_store: SessionStore) -> None:
    sid, other = uuid.uuid4().hex, uuid.uuid4().hex
    first = await events_store.add_event(sid, "a", None)
    b1 = await events_store.add_event(sid, "b", '"b1"')
    a1 = await events_store.add_event(sid, "a", '"a1"')
    b2 = await events_store.add_event(sid, "b", '"b2"')
    await events_store.add_event(other, "a", '"of another session"')
    assert await events_store.stream_since(sid, "a", first) == (b2, [(a1, '"a1"')])
    # From an event of another stream: what followed it, of this one.
    assert await events_store.stream_since(sid, "a", b1) == (b2, [(a1, '"a1"')])
    assert await events_store.stream_since(sid, "b", a1) == (b2, [(b2, '"b2"')])
    assert await events_store.stream_since(sid, "a", b2) == (b2, [])
    # Nothing of another session's, nor its ids.
    assert await events_store.stream_since(other, "a", first) is None
    assert await events_store.stream_since(sid, "a", mint_event_id(sid, "1-0")) is None
    # Trimmed (the log keeps 8 here): None, as events_after says.
    for i in range(8):
        await events_store.add_event(sid, "b", json.dumps(i))
    assert await events_store.stream_since(sid, "a", first) is None
    latest = await events_store.add_event(sid, "a", '"a2"')
    assert await events_store.stream_since(sid, "a", b2) is None
    assert await events_store.stream_since(sid, "b", latest) == (latest, [])


@pytest.mark.timeout(30)
async def test_a_waiting_replay_is_woken_by_its_own_stream_only(events_store: SessionStore) -> None:
    """The feed's messages name the session and the stream: an event of another stream of the same session
    wakes nobody following this one."""
    sid = uuid.uuid4().hex
    feed = EventFeed(events_store)
    a, b = feed.register(sid, "a"), feed.register(sid, "b")
    try:
        async with asyncio.timeout(5):
            await a.wait()  # the feed's subscription began (it wakes everyone, to read what came before)
        a.clear()
        b.clear()
        await events_store.add_event(sid, "a", NOTE)
        async with asyncio.timeout(5):
            await a.wait()
        await asyncio.sleep(0.3)
        assert not b.is_set(), "a replay of stream b was woken by stream a's event"
        await events_store.add_event(sid, "b", NOTE)
        async with asyncio.timeout(5):
            await b.wait()
    finally:
        feed.forget(sid, "a", a)
        feed.forget(sid, "b", b)


@pytest.mark.timeout(60)
async def test_a_replay_waiting_on_a_cluster_is_woken_when_its_sessions_slot_moves(redis_cluster: Stack) -> None:
    """An event added while the session's slot moves may go unheard (redis_cluster.FeedWatch): the feed
    says so once it hears the slot again, and every waiting replay reads afresh."""
    nodes = [(redis_cluster.config.host, port) for port in redis_cluster.config.cluster_ports]
    store = RedisSessionStore(
        cluster_nodes=nodes, **redis_cluster.config.redis_auth, prefix="mcp:t" + uuid.uuid4().hex[:8]
    )
    sid = uuid.uuid4().hex
    slot = key_slot(f"{{{sid}}}".encode())
    source = slot_owner(redis_cluster, slot)
    target = next(name for name in redis_cluster.cluster_primaries() if name != source)
    feed = EventFeed(store)
    woken = feed.register(sid, "a")
    try:
        async with asyncio.timeout(5):
            await woken.wait()  # the feed's subscription began
        woken.clear()
        move_slot(redis_cluster, slot, source, target)
        async with asyncio.timeout(5):
            await woken.wait()
    finally:
        feed.forget(sid, "a", woken)
        move_slot(redis_cluster, slot, target, source)
        await store.aclose()


class AddsWhileTheRunnerIsChecked(InMemorySessionStore):
    """Adds `pending` to its stream when a replay reads the call's record: after the replay's last read of
    the stream, before the runner check reads the stream from its start."""

    pending: tuple[str, str, str] | None = None

    async def claimed(self, name: str) -> str | None:
        if name.startswith("call:") and self.pending is not None:
            await self.add_event(*self.pending)
            self.pending = None
        return await super().claimed(name)


def progress_note(value: int) -> str:
    params = {"progressToken": "p", "progress": value}
    return json.dumps({"jsonrpc": "2.0", "method": "notifications/progress", "params": params})


async def test_progress_added_while_a_replay_checks_the_calls_runner_is_sent() -> None:
    """The runner check notes the progress already sent, so a re-run's repeats are dropped; progress added
    after the replay's last read is not yet sent, and goes out (CI lost one this way, under load)."""
    store, sid, run = AddsWhileTheRunnerIsChecked(), uuid.uuid4().hex, "7~0123456789ab"
    runs = Runs(store, "here")
    events = SessionEvents(store, sid, max_event_bytes=65536, abandoned_seconds=30, call_ttl_seconds=60, runs=runs)
    first = await store.add_event(sid, run, None)
    record = {"first": first, "runner": runs.run_id, "id": 7, "request": None, "key": None}
    await store.claim(f"call:{sid}:{run}", json.dumps(record), 60)
    for value in (1, 2):
        last = await store.add_event(sid, run, progress_note(value))
    store.pending = (sid, run, progress_note(3))
    sent: list[dict] = []
    heard = asyncio.Event()

    async def send(event: EventMessage) -> None:
        sent.append(event.message.model_dump(by_alias=True, exclude_unset=True))
        heard.set()

    replay = asyncio.create_task(events.replay_events_after(last, send))
    async with asyncio.timeout(5):
        await heard.wait()
        await store.add_event(sid, run, json.dumps({"jsonrpc": "2.0", "id": 7, "result": {}}))
        assert await replay is None
    assert [m.get("params", {}).get("progress") for m in sent] == [3, None], sent


def commandstats(stack: Stack) -> dict[str, tuple[int, int]]:
    """INFO commandstats: (calls, usec) per command."""
    text = stack.redis_command("redis", "INFO", "commandstats")
    assert isinstance(text, str)
    found = {}
    for line in text.splitlines():
        if line.startswith("cmdstat_"):
            name, _, fields = line.removeprefix("cmdstat_").partition(":")
            values = dict(part.split("=") for part in fields.split(","))
            found[name] = (int(values["calls"]), int(values["usec"]))
    return found


def delta(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], name: str) -> tuple[int, int]:
    calls, usec = after.get(name, (0, 0))
    calls_before, usec_before = before.get(name, (0, 0))
    return calls - calls_before, usec - usec_before


def _docket_only() -> set[str]:
    """The commands only Docket may run (REDIS_KIT_ACL grants them under mcp:tasks alone): the demo's task
    worker runs them all the time, whatever the streams do."""
    root, _, selector = REDIS_KIT_ACL.partition("(")
    granted = {word[1:].rstrip(")") for word in selector.split() if word.startswith("+")}
    return granted - {word[1:] for word in root.split() if word.startswith("+")}


DOCKET_ONLY = _docket_only()


def commands(stats: dict[str, tuple[int, int]]) -> int:
    """Commands counted, but for INFO (the test's) and Docket's own."""
    return sum(calls for name, (calls, _) in stats.items() if name != "info" and name not in DOCKET_ONLY)


@pytest.fixture(scope="module")
@starts("slow")
def replicas(redis_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Replica, Replica]]:
    """Two replicas of the demo server, straight (no HAProxy), that cancel a call nobody reads after 1 s and
    forget a session idle for 1 s."""
    env = {"ABANDONED_CALL_SECONDS": str(ABANDONED), "SESSION_IDLE_SECONDS": "1"}
    with two_replicas(redis_stack, tmp_path_factory.mktemp("streams"), **env) as pair:
        yield pair


ABANDONED = 1.0


@pytest.fixture
async def kit_store(redis_stack: Stack) -> AsyncIterator[RedisSessionStore]:
    """The replicas' store, as they see it."""
    store = RedisSessionStore(redis_stack.config.redis_url, **redis_stack.config.redis_auth)
    try:
        yield store
    finally:
        await store.aclose()


@pytest.mark.timeout(60)
async def test_a_replay_reads_what_was_added_after_its_cursor_not_the_log(
    redis_stack: Stack, replicas: tuple[Replica, Replica], kit_store: RedisSessionStore, http: httpx2.AsyncClient
) -> None:
    """Each event added to a followed stream costs its replay the same in Redis whether the session's log holds
    a few events or 900: the replay reads from the last event it read (commandstats: LRANGE's time per event)."""
    one, _ = replicas
    added = 40

    async def lrange_per_event(filler: int) -> tuple[float, int]:
        session = RawSession(http, one.url)
        sid = await session.initialize()
        first = await kit_store.add_event(sid, "followed", None)
        for i in range(filler):
            await kit_store.add_event(sid, "other", json.dumps(i))
        got: list[Event] = []
        caught_up, all_in = asyncio.Event(), asyncio.Event()

        async def follow() -> None:
            async with session.resume(first) as stream:
                assert stream.response.status_code == 200
                caught_up.set()
                async for event in stream:
                    got.append(event)
                    if len(got) == added:
                        all_in.set()

        task = asyncio.create_task(follow())
        try:
            async with asyncio.timeout(10):
                await caught_up.wait()
            await asyncio.sleep(1.0)  # its first read from the cursor (the 900 once) is done
            before = commandstats(redis_stack)
            for _ in range(added):
                await kit_store.add_event(sid, "followed", NOTE)
                await asyncio.sleep(0.01)
            async with asyncio.timeout(10):
                await all_in.wait()
            after = commandstats(redis_stack)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        calls, usec = delta(before, after, "lrange")
        return usec / added, calls

    small, small_calls = await lrange_per_event(5)
    large, large_calls = await lrange_per_event(900)
    print(f"LRANGE per event followed: {small:.1f} us (a 6-event log), {large:.1f} us (906 events)")
    assert 0 < small_calls <= 2 * added and 0 < large_calls <= 2 * added, (small_calls, large_calls)
    # Reading the whole log each time costs ~100x here; from the cursor, the same.
    assert large <= 4 * max(small, 1.0), f"{large:.1f} us per event with a 906-event log, {small:.1f} with 6"


@contextlib.asynccontextmanager
async def watching(session: RawSession, seconds: int = 30) -> AsyncIterator[str]:
    """A quiet call (watch_counter) streaming on `session`, its connection kept read: its first event's id."""
    first: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def read() -> None:
        async with session.stream(
            "tools/call", {"name": "watch_counter", "arguments": {"duration_seconds": seconds}}
        ) as stream:
            async for event in stream:
                if event.id and not first.done():
                    first.set_result(event.id)

    task = asyncio.create_task(read())
    try:
        await asyncio.sleep(0.3)
        await session.call("increment_counter")  # something for it to stream
        async with asyncio.timeout(10):
            event_id = await first
        yield event_id
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.timeout(90)
async def test_waiting_replays_of_a_quiet_call_share_one_check_per_interval(
    redis_stack: Stack, replicas: tuple[Replica, Replica], http: httpx2.AsyncClient
) -> None:
    """8 replays on one replica of a quiet call running on another cost Redis what one does: one check per
    RUNNER_CHECK_SECONDS that the call's replica lives and one mark every third of ABANDONED_CALL_SECONDS that
    the stream is read (commandstats, commands of every kind); no reads until the stream grows."""
    one, two = replicas
    session = RawSession(http, one.url)
    await session.initialize()
    window = 3.0

    async def rate() -> float:
        """Redis commands/s over `window` (those run by the kit's functions included)."""
        before = commandstats(redis_stack)
        await asyncio.sleep(window)
        return (commands(commandstats(redis_stack)) - commands(before)) / window

    async def follow(event_id: str) -> None:
        async with session.at(two.url).resume(event_id) as stream:
            assert stream.response.status_code == 200
            async for _ in stream:
                pass

    async with watching(session) as event_id:
        await asyncio.sleep(0.5)
        idle = await rate()
        replays = [asyncio.create_task(follow(event_id))]
        await asyncio.sleep(1.0)
        with_one = await rate()
        replays += [asyncio.create_task(follow(event_id)) for _ in range(7)]
        await asyncio.sleep(1.5)
        with_eight = await rate()
        assert not any(task.done() for task in replays), [task for task in replays if task.done()]
        for task in replays:
            task.cancel()
        await asyncio.gather(*replays, return_exceptions=True)
    one_costs, eight_cost = with_one - idle, with_eight - idle
    print(f"Redis commands/s: the call alone {idle:.1f}, +1 replay {one_costs:.1f}, +8 replays {eight_cost:.1f}")
    # Each replay polling on its own cost ~12 commands/s: 8 cost ~100, 8 times one. Shared: a check every
    # RUNNER_CHECK_SECONDS, a mark every third of a second here (ABANDONED_CALL_SECONDS is 1), the feed's ping.
    # 3 s windows of every command Redis runs are noisy on a 2-core machine (CI saw 2.1 times one): at most 3.
    assert eight_cost <= 3 * one_costs + 3, f"8 waiting replays added {eight_cost:.1f} commands/s, 1 {one_costs:.1f}"
    # Against the ~100 a second of replays polling each on its own: at most 40 (CI measured 26, with one
    # replay alone at 18.7, in a busy run).
    assert eight_cost <= 40, f"8 waiting replays added {eight_cost:.1f} commands/s"


async def first_progress(session: RawSession, items: int) -> tuple[int, str]:
    """Start an analysis of `items` (50 ms each) and cut its connection at its first progress: (its request id,
    the last event id received)."""
    call = {"name": "analyze_data", "arguments": {"num_items": items}, "_meta": {"progressToken": "p"}}
    async with session.stream("tools/call", call) as stream:
        async for event in stream:
            if event.message and event.message.get("method") == "notifications/progress":
                return stream.request_id, str(event.id)
    raise AssertionError("the analysis streamed no progress")


@pytest.mark.timeout(60)
async def test_a_call_whose_client_left_is_cancelled_after_the_grace(
    replicas: tuple[Replica, Replica], kit_store: RedisSessionStore, http: httpx2.AsyncClient
) -> None:
    """Nobody resumes it within ABANDONED_CALL_SECONDS: the call is cancelled (it never writes its result), and
    its stream ends with the SDK's "Request cancelled" error, which a late resume gets, its replay ending there."""
    one, _ = replicas
    session = RawSession(http, one.url)
    sid = await session.initialize()
    left_at = time.monotonic()
    request_id, last = await first_progress(session, 80)  # 4 s of work
    await asyncio.sleep(ABANDONED + 1.0)
    async with asyncio.timeout(HANG_GUARD_SECONDS):  # the error is in the log: a replay that waits for more hangs
        after = await resumed_to_the_end(session, last)
    answer = after[-1].message
    assert answer["id"] == request_id and answer["error"]["code"] == -32800, answer
    await asyncio.sleep(max(0.0, left_at + 4 * 1.5 - time.monotonic()))
    assert await kit_store.get(sid, "analysis_result") is None, "the abandoned call ran to its end"


@pytest.mark.timeout(60)
async def test_a_call_resumed_within_the_grace_runs_to_its_end(
    replicas: tuple[Replica, Replica], kit_store: RedisSessionStore, http: httpx2.AsyncClient
) -> None:
    """Its client resumes on another replica within ABANDONED_CALL_SECONDS and reads for longer than both it
    and SESSION_IDLE_SECONDS: the call runs to its end on its own replica, its answer delivered once."""
    one, two = replicas
    session = RawSession(http, one.url)
    sid = await session.initialize()
    request_id, last = await first_progress(session, 80)
    await asyncio.sleep(ABANDONED / 3)
    async with asyncio.timeout(15):
        after = await resumed_to_the_end(session.at(two.url), last)
    answer = after[-1].message
    assert answer["id"] == request_id and "result" in answer, answer
    assert answer["result"]["structuredContent"]["items_processed"] == 80
    assert answer["result"]["structuredContent"]["instance"] == "mcp-server-1"
    assert await kit_store.get(sid, "analysis_result") == {"total_score": 1.5 * sum(range(81)), "items_processed": 80}


@pytest.mark.timeout(60)
async def test_a_call_whose_resumed_stream_is_left_too_is_cancelled(
    replicas: tuple[Replica, Replica], kit_store: RedisSessionStore, http: httpx2.AsyncClient
) -> None:
    """A resume keeps the call only while it reads: once its client leaves that stream too, the call is
    cancelled within about the grace again."""
    one, two = replicas
    session = RawSession(http, one.url)
    sid = await session.initialize()
    started = time.monotonic()
    request_id, last = await first_progress(session, 120)  # 6 s of work
    async with session.at(two.url).resume(last) as stream:
        async for event in stream:
            last = str(event.id) if event.id else last
            if time.monotonic() - started > ABANDONED + 1.0:
                break  # read past the grace, then gone again
    await asyncio.sleep(2 * ABANDONED + 1.0)
    async with asyncio.timeout(HANG_GUARD_SECONDS):
        after = await resumed_to_the_end(session, last)
    answer = after[-1].message
    assert answer["id"] == request_id and answer["error"]["code"] == -32800, answer
    await asyncio.sleep(max(0.0, started + 6 * 1.5 - time.monotonic()))
    assert await kit_store.get(sid, "analysis_result") is None, "the call ran to its end"


@pytest.mark.timeout(60)
async def test_a_2026_call_whose_client_left_is_cancelled(
    replicas: tuple[Replica, Replica], kit_store: RedisSessionStore, http: httpx2.AsyncClient
) -> None:
    """2026-07-28 has no resuming: a streamed call whose connection closes is cancelled, and writes nothing
    more. The same call read to its end writes its result (so the check can fail)."""
    one, _ = replicas
    session = SessionlessSession(http, one.url)
    await session.open()

    async def analysis(cut: bool) -> str:
        handle = (await session.call("create_session"))["session_id"]
        call = {"name": "analyze_data", "arguments": {"num_items": 40, "session_id": handle}}
        async with session.stream("tools/call", {**call, "_meta": {"progressToken": "p"}}) as stream:
            assert stream.response.headers["content-type"].startswith("text/event-stream")
            async for _ in stream:
                if cut:
                    break
        return handle

    cut, read = await analysis(cut=True), await analysis(cut=False)
    await asyncio.sleep(40 * 0.05 + 1.0)  # the cut call's work, had it gone on
    assert await kit_store.get(read, "analysis_result") is not None
    assert await kit_store.get(cut, "analysis_result") is None, "the call ran on after its client left"


@pytest.mark.timeout(60)
async def test_a_calls_re_run_record_is_dropped_once_it_has_answered(
    redis_stack: Stack, replicas: tuple[Replica, Replica], kit_store: RedisSessionStore, http: httpx2.AsyncClient
) -> None:
    """While a streamed call runs, the store keeps its request to run it again should its replica die; once its
    answer is in the log, nothing (it was kept for 300 s, up to 16 KB each)."""
    one, _ = replicas
    session = RawSession(http, one.url)
    sid = await session.initialize()
    call = {"name": "analyze_data", "arguments": {"num_items": 20}, "_meta": {"progressToken": "p"}}
    record: str | None = None
    async with session.stream("tools/call", call) as stream:
        async for event in stream:
            if record is None:
                log = redis_stack.redis_command("redis", "LRANGE", f"mcp:events:{sid}", "0", "-1")
                assert isinstance(log, list), log
                # Entries are "<position> <stream's length> <stream><message>"; the call's stream has a run mark.
                streams = [rest[: int(length)] for _, length, rest in (str(entry).split(" ", 2) for entry in log)]
                record = f"call:{sid}:{next(stream for stream in streams if '~' in stream)}"
                assert await kit_store.claimed(record) is not None, "no re-run record while the call runs"
            answer = event.message
    assert answer is not None and "result" in answer, answer
    assert record is not None and await kit_store.claimed(record) is None, "the re-run record outlived the answer"
