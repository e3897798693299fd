"""Pattern: SSE streams that resume on any replica.

A session-era (2025-11-25) call answers over an SSE stream: a priming event,
progress and logs, then the result, each event with an id. When the
connection breaks, the client reconnects with `GET /mcp` and `Last-Event-ID`
(the last id it got), and the server replays what came after. The MCP SDK
does this through an `EventStore`, to which each transport writes every
outgoing message before sending it. FastMCP, though, gives each transport a
randomly prefixed view of its store, so a stream resumes only on the replica
that sent it; and without a store (as this kit had) it resumes nowhere.

Here:

1. every event of a session goes to the session's event log in the shared
   store (`SessionStore.add_event`: one Redis list per session, bounded by
   count and kept a few minutes after its latest event), so every replica
   can read it. `SessionEvents` is the SDK's
   `EventStore` bound to one session; `adoption.py` gives one to the
   transport of every session a replica opens or adopts (`_sdk.py`
   does the reaching into the SDK);
2. a replay *follows* the stream in the store until the stream's final event
   (the call's response), rather than sending what is stored so far. After a
   replay the SDK forwards only what its own transport produces, and when the
   call runs on another replica its later events reach this one only through
   the store. When the call runs on this replica, its live messages go to the
   broken connection's stream or, once that is gone, nowhere (the SDK stores
   a message first, then drops it when no stream waits for it), never to the
   resumed one. So following the store delivers each event exactly once in
   both cases. The replay then ends the response: it returns no stream id,
   because with one the SDK would attach a live stream to the response, which
   after the final event never ends, and before it sends what the store
   already delivers;
3. `CheckResumption` (ASGI middleware) answers a bad `Last-Event-ID` before
   the SDK opens a 200 stream: 400 for a malformed id, 404 for an id this
   session has no event under (unknown, expired, trimmed or another
   session's: one answer for all, revealing nothing), 503 when the store
   cannot be reached. With authentication on (`principals.py`), a session another
   principal opened gets that same 404, and a request the auth layer will
   refuse passes untouched to get its 401, having read nothing.

Bounded (issue: nothing one client sends takes what all share):

- an event over `max_event_bytes` (MAX_EVENT_BYTES) is sent live but not
  kept: a call's answer is kept as a short error saying to call again, so a
  resumed stream still ends; a stream whose id (the request's id) is over
  `MAX_STREAM_ID_BYTES` is not kept at all. The store bounds each session's
  log in bytes too (MAX_SESSION_LOG_BYTES);
- a waiting replay does not poll: it sleeps until the store says an event
  was added to its session's log (`EventFeed`, one subscription per replica
  while any replay waits), with a slow poll only in case that word is lost;
- `CheckResumption` lets at most `max_per_session` replays run per session
  (429) and `max_replays` per replica (503), both with Retry-After.

Resuming reads a stream and takes nothing over: a replica asked to replay a
session it does not hold serves it without advancing the session's ownership
epoch (`adoption.py`), so the call still running on its owner can
finish and write its result, and the resumed stream delivers that result.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

import anyio
from mcp.server.streamable_http import EventCallback, EventId, EventMessage, EventStore, StreamId
from mcp_types import (
    INTERNAL_ERROR,
    ErrorData,
    JSONRPCError,
    JSONRPCMessage,
    JSONRPCNotification,
    JSONRPCRequest,
    JSONRPCResponse,
)
from pydantic import TypeAdapter
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._sdk import STREAM_SCOPE_KEY
from .principals import owner, refused_by_auth
from .session_store import SessionStore, StoreUnavailable, is_event_id, is_session_id

log = logging.getLogger(__name__)

MALFORMED = (
    "Malformed Last-Event-ID: send the id of the last event received on this session's stream, "
    "or open a new stream without one."
)
UNKNOWN = (
    "This session has no event with that Last-Event-ID (it may have expired), so the stream cannot be "
    "resumed: send the request again (a tools/call with the same idempotency key is applied once)."
)
UNAVAILABLE = "Session store unavailable; try again shortly."
# No client needs a request id this long; a stream under one is sent live but never kept.
MAX_STREAM_ID_BYTES = 256
# A waiting replay's check of the store when no word came: only in case the word was lost.
FALLBACK_POLL_SECONDS = 5.0
# How often a replay with nothing new asks whether the replica running its call still lives.
RUNNER_CHECK_SECONDS = 0.25
# A call's stream in the log is "<request id>~<token>": one per run, however its client reuses ids.
STREAM_MARK = "~"
# The largest request kept to re-run a call whose replica died (a larger one ends in an error instead).
MAX_RERUN_REQUEST_BYTES = 16 * 1024
NOT_COMPLETED = (
    "The replica running this call stopped before it answered, and the call cannot be run again here "
    "{why}. Retrying it is safe: send it again (a tools/call with the same idempotency key is applied once)."
)
# How a replay re-runs a call, set by CheckResumption for the request it serves: (stream, request, key,
# and what to do when the re-run is refused: given why).
_Refused = Callable[[str], Awaitable[Any]]
_rerun: ContextVar[Callable[[str, str, str | None, _Refused], Awaitable[None]] | None] = ContextVar(
    "rerun", default=None
)


class Runs:
    """This replica's lease in the store, renewed while it runs: a lapsed one means the replica is gone.

    The calls it streams are recorded under its run id (`SessionEvents.start_stream`), so a replay on
    another replica knows, within `ttl_seconds`, that nobody will finish them, and runs them again.
    """

    # A lease lapses a second after its last renewal: a replica whose loop stalls that long (four renewals
    # missed) is taken for gone, and a call it streams may run twice, its writes applied once (same key).
    def __init__(self, store: SessionStore, instance: str, *, ttl_seconds: int = 1, renew_seconds: float = 0.25):
        self.store = store
        # A restarted replica is another run: the calls of the one before are not its to finish.
        self.run_id = f"{instance}/{secrets.token_hex(6)}"
        self.ttl_seconds = ttl_seconds
        self.renew_seconds = renew_seconds

    async def keep_alive(self) -> None:
        while True:
            try:
                await self.store.claim(f"alive:{self.run_id}", self.run_id, self.ttl_seconds)
            except StoreUnavailable as exc:
                log.debug("lease not renewed: %s", exc)
            await asyncio.sleep(self.renew_seconds)

    async def alive(self, run_id: str) -> bool:
        return run_id == self.run_id or await self.store.claimed(f"alive:{run_id}") == run_id

    async def runner_of(self, call: str, first: str) -> str:
        """The latest run of a call that `first` ran first: each re-run is claimed by the one who runs it."""
        runner = first
        for _ in range(64):  # each link is a replica that died; far fewer in practice
            after = await self.store.claimed(f"rerun:{call}:{runner}")
            if after is None:
                return runner
            runner = after
        return runner


def _progress_repeated(message: JSONRPCMessage, progressed: dict[Any, float]) -> bool:
    """Whether `message` is a progress notification at or below what its token already reported; else
    notes it. A call run again (its replica died) reports its progress from the start once more."""
    if not isinstance(message, JSONRPCNotification) or message.method != "notifications/progress":
        return False
    params = message.params or {}
    token, progress = params.get("progressToken"), params.get("progress")
    if not isinstance(progress, int | float) or isinstance(token, dict | list):
        return False
    if token in progressed and progress <= progressed[token]:
        return True
    progressed[token] = progress
    return False


def _answers(message: JSONRPCMessage, stream_id: str) -> bool:
    """Whether `message` is the answer that ends the stream `stream_id` (a request's id, or a call's run)."""
    if not isinstance(message, JSONRPCResponse | JSONRPCError):
        return False
    request_id = str(message.id)
    return stream_id == request_id or stream_id.rpartition(STREAM_MARK)[0] == request_id


def _not_kept(size: int, max_bytes: int) -> str:
    return (
        f"The answer ({size} bytes) is over the {max_bytes} bytes kept for resuming a stream, so it cannot "
        "be replayed: call again (a tools/call with the same idempotency key is applied once)."
    )


class EventFeed:
    """Wakes the replays waiting on a session's log when an event is added to it, on any replica.

    One subscription (`store.watch(events=True)`) while any replay waits, so a
    thousand waiting replays cost the store nothing until their logs grow.
    """

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self._waiting: dict[str, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None

    def register(self, session_id: str) -> asyncio.Event:
        woken = asyncio.Event()
        self._waiting.setdefault(session_id, set()).add(woken)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._listen())
        return woken

    def forget(self, session_id: str, woken: asyncio.Event) -> None:
        waiting = self._waiting.get(session_id)
        if waiting is not None:
            waiting.discard(woken)
            if not waiting:
                del self._waiting[session_id]
        if not self._waiting and self._task is not None:
            self._task.cancel()
            self._task = None

    def _wake(self, session_ids: list[str]) -> None:
        for session_id in session_ids:
            for woken in self._waiting.get(session_id, ()):
                woken.set()

    async def _listen(self) -> None:
        while self._waiting:
            try:
                async with self.store.watch(events=True) as added:
                    # Whatever was added before the subscription began is read by the replays' next check.
                    self._wake(list(self._waiting))
                    async for session_id in added:
                        self._wake([session_id])
            except StoreUnavailable as exc:
                log.warning("event feed lost (%s); replays poll until it is back", exc)
                self._wake(list(self._waiting))
                await asyncio.sleep(1.0)


_messages: TypeAdapter[JSONRPCMessage] = TypeAdapter(JSONRPCMessage)


class SessionEvents(EventStore):
    """The SDK's EventStore over one session's event log in the shared store."""

    def __init__(
        self,
        store: SessionStore,
        session_id: str,
        *,
        max_event_bytes: int = 64 * 1024,
        feed: EventFeed | None = None,
        on_answer: Callable[[str, str], None] | None = None,
        runs: Runs | None = None,
        call_ttl_seconds: int = 300,
        poll_seconds: float = 0.1,
        idle_seconds: float = 30.0,
    ) -> None:
        """Without a `feed`, a waiting replay polls every `poll_seconds`. `on_answer(session_id,
        request_id)` is told of each request's answer as it is stored, before it is sent. With `runs`,
        a call's stream names the run that streams it, and a replay runs it again once that run is
        gone; without, a replay with nothing new for `idle_seconds` ends (its client may resume again)."""
        self.store = store
        self.session_id = session_id
        self.max_event_bytes = max_event_bytes
        self.feed = feed
        self.on_answer = on_answer
        self.runs = runs
        self.call_ttl_seconds = call_ttl_seconds
        self.poll_seconds = poll_seconds
        self.idle_seconds = idle_seconds
        # The calls streaming now on this transport: request id -> its stream in the log.
        self._streams: dict[str, str] = {}

    async def start_stream(
        self, stream_id: str, request: JSONRPCRequest, http: Request, *, stream: str | None = None
    ) -> None:
        """A call is about to stream (JsonFirstTransport): record what re-running it takes, under
        this run. `stream`: the call's stream in the log, when this is a re-run of it."""
        if self.runs is None or len(stream_id.encode()) > MAX_STREAM_ID_BYTES:
            return
        run = stream or f"{stream_id}{STREAM_MARK}{secrets.token_hex(6)}"
        self._streams[stream_id] = run
        if stream is not None:
            return  # the re-run's replica claimed it (Runs.runner_of) before it began
        # The request as it came (the SDK's wire form), to be sent again as is.
        text = request.model_dump_json(by_alias=True, exclude_unset=True)
        try:
            # A place before the stream's first message, from which a replay can read the whole of it.
            first = await self.store.add_event(self.session_id, run, None)
            call = {
                "first": first,
                "runner": self.runs.run_id,
                "id": request.id,
                "request": text if len(text) <= MAX_RERUN_REQUEST_BYTES else None,
                "key": http.headers.get("x-request-id"),
            }
            await self.store.claim(f"call:{self.session_id}:{run}", json.dumps(call), self.call_ttl_seconds)
        except StoreUnavailable as exc:
            log.warning("call %s of session %s not recorded for re-running: %s", stream_id, self.session_id, exc)

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        if self.on_answer is not None and isinstance(message, JSONRPCResponse | JSONRPCError):
            self.on_answer(self.session_id, str(message.id))
        if len(stream_id.encode()) > MAX_STREAM_ID_BYTES:
            return ""  # sent live, without an id: nothing to resume from
        if stream_id in self._streams:
            run = self._streams[stream_id]
            if message is not None and _answers(message, stream_id):
                del self._streams[stream_id]
            stream_id = run
        # The SDK's own wire form (exclude_unset), so a replayed event reads
        # exactly like the live one. exclude_none would drop the `"id": null`
        # of an error answering no request, and the text would not parse back.
        text = None if message is None else message.model_dump_json(by_alias=True, exclude_unset=True)
        if text is not None and len(text) > self.max_event_bytes // 4 and len(text.encode()) > self.max_event_bytes:
            if not isinstance(message, JSONRPCResponse | JSONRPCError):
                return ""  # a notification: sent live, not kept
            error = ErrorData(code=INTERNAL_ERROR, message=_not_kept(len(text.encode()), self.max_event_bytes))
            text = JSONRPCError(jsonrpc="2.0", id=message.id, error=error).model_dump_json(
                by_alias=True, exclude_unset=True
            )
        try:
            return await self.store.add_event(self.session_id, stream_id, text)
        except StoreUnavailable as exc:
            # Raising here would stop the SDK's message router, and the session
            # with it. The message still goes out, live and without an id: there
            # is no stored place to resume from.
            log.warning("event of session %s not stored: %s", self.session_id, exc)
            return ""

    async def replay_events_after(self, last_event_id: EventId, send_callback: EventCallback) -> StreamId | None:
        """Send the stream's events after `last_event_id`, following it to its final event; then None.

        Gives up (also None, which ends the response) when the store has
        nothing new for `idle_seconds`, e.g. because the replica running the
        call died: the client may resume again from the last event it got.
        """
        woken = None if self.feed is None else self.feed.register(self.session_id)
        try:
            return await self._follow(last_event_id, send_callback, woken)
        finally:
            if woken is not None and self.feed is not None:
                self.feed.forget(self.session_id, woken)

    async def _follow(
        self, last_event_id: EventId, send_callback: EventCallback, woken: asyncio.Event | None
    ) -> StreamId | None:
        cursor = last_event_id
        quiet_since = anyio.current_time()
        checked = quiet_since - RUNNER_CHECK_SECONDS  # a quiet call's runner is asked about at once
        call: dict[str, Any] | None = None  # what the stream's call record says, once read
        progressed: dict[Any, float] = {}  # each progress token's latest progress sent
        while True:
            if woken is not None:
                woken.clear()  # before the read: an event added after it wakes the wait below
            try:
                found = await self.store.events_after(self.session_id, cursor)
            except StoreUnavailable as exc:
                log.warning("replay for session %s stopped: %s", self.session_id, exc)
                return None
            if found is None:
                return None  # unknown (CheckResumption answered that already), or trimmed while following
            stream_id, events = found
            for event_id, text in events:
                cursor = event_id
                if text is None:
                    continue  # a priming event: a place to resume from, nothing to send
                message = _messages.validate_json(text)
                if _progress_repeated(message, progressed):
                    continue  # a re-run's progress, up to where its first run had got: it only ever rises
                await send_callback(EventMessage(message, event_id))
                if _answers(message, stream_id):
                    return None  # the call's answer: the stream is complete
            now = anyio.current_time()
            watched = self.runs is not None and STREAM_MARK in stream_id
            if events:
                quiet_since = now
            elif watched and now - checked >= RUNNER_CHECK_SECONDS:
                checked = now
                if call is None and (call := await self._call_of(stream_id)) is not None:
                    await self._progress_so_far(call, progressed)
                if call is not None and await self._runner_gone(stream_id, call, send_callback):
                    return None
            if not events and call is None and now - quiet_since >= self.idle_seconds:
                return None  # nobody can tell whether the call still runs: its client may resume again
            if woken is None:
                await anyio.sleep(self.poll_seconds)
                continue
            left = RUNNER_CHECK_SECONDS if watched else self.idle_seconds - (now - quiet_since)
            with anyio.move_on_after(max(0.0, min(FALLBACK_POLL_SECONDS, left))):
                await woken.wait()

    async def _call_of(self, run: str) -> dict[str, Any] | None:
        """The record of the call streamed as `run`; None when there is none (the store was out when it
        started, or it expired): such a stream ends after a quiet `idle_seconds`, as an unwatched one."""
        try:
            text = await self.store.claimed(f"call:{self.session_id}:{run}")
        except StoreUnavailable as exc:
            log.warning("call record of %s in session %s not read: %s", run, self.session_id, exc)
            return None
        return None if text is None else json.loads(text)

    async def _progress_so_far(self, call: dict[str, Any], progressed: dict[Any, float]) -> None:
        """Note the progress the call's stream has reported so far, before as well as after the event
        the client resumed from: a re-run reports from the start again, and that must not reach it."""
        try:
            found = await self.store.events_after(self.session_id, call.get("first", ""))
        except StoreUnavailable:
            return
        for _, text in found[1] if found is not None else ():
            if text is not None:
                _progress_repeated(_messages.validate_json(text), progressed)

    async def _runner_gone(self, run: str, call: dict[str, Any], send_callback: EventCallback) -> bool:
        """Whether the call streamed as `run` has ended here: its runner is gone, and it cannot run again.

        Its runner alive: nothing to do. Gone: this replica claims the re-run, and runs the call again
        under its idempotency key (its writes already applied replay), into the same stream; or, when it
        cannot, ends the stream with an error saying a retry is safe. Another replica's claim: it re-runs.
        """
        assert self.runs is not None
        call_name = f"{self.session_id}:{run}"
        try:
            runner = await self.runs.runner_of(call_name, call["runner"])
            if await self.runs.alive(runner):
                return False
            if not await self.store.claim(f"rerun:{call_name}:{runner}", self.runs.run_id, self.call_ttl_seconds):
                return False  # another replica runs it again; its events come through the store
        except StoreUnavailable as exc:
            log.warning("runner of %s in session %s not checked: %s", run, self.session_id, exc)
            return False
        request, rerun = call.get("request"), _rerun.get()
        if request is not None and rerun is not None:
            log.info("re-running call %s of session %s: its replica %s is gone", run, self.session_id, runner)
            # Refused (the session ended meanwhile, say): the error goes to the log, and this replay,
            # following it, ends with it.
            await rerun(run, request, call.get("key"), functools.partial(self._end, run, call))
            return False
        why = "(its request was too large to keep)" if request is None else "(nothing here can run it)"
        error, event_id = await self._end(run, call, why)
        await send_callback(EventMessage(error, event_id))
        return True

    async def _end(self, run: str, call: dict[str, Any], why: str) -> tuple[JSONRPCError, str | None]:
        """End the call's stream in the log with an error for its request saying a retry is safe."""
        error = JSONRPCError(
            jsonrpc="2.0",
            id=call.get("id", run.rpartition(STREAM_MARK)[0]),
            error=ErrorData(code=INTERNAL_ERROR, message=NOT_COMPLETED.format(why=why)),
        )
        try:
            event_id = await self.store.add_event(
                self.session_id, run, error.model_dump_json(by_alias=True, exclude_unset=True)
            )
        except StoreUnavailable:
            event_id = None
        return error, event_id


def resumes_stream(scope: Scope) -> bool:
    """Whether the request resumes a stream (GET with a Last-Event-ID): it reads, and changes nothing."""
    return scope["method"] == "GET" and bool(Headers(scope=scope).get("last-event-id"))


def _error(status: int, message: str, *, retry_after: int | None = None) -> JSONResponse:
    headers = None if retry_after is None else {"Retry-After": str(retry_after)}
    return JSONResponse(
        {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": message}},
        status_code=status,
        headers=headers,
    )


class CheckResumption:
    """ASGI middleware in front of the MCP endpoint: a resuming GET is checked against the store first.

    Without it, the SDK answers any Last-Event-ID with a 200 stream, empty
    when the id is unknown, and the client cannot tell a lost stream from a
    quiet one.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: SessionStore,
        path: str = "/mcp",
        on_resume: Callable[[], None] | None = None,
        max_per_session: int = 8,
        max_replays: int = 256,
    ) -> None:
        self.app = app
        self.store = store
        self.path = path
        self.on_resume = on_resume
        self.max_per_session = max_per_session
        self.max_replays = max_replays
        # Replays running here, per session (a Counter drops none by itself: `_done` does).
        self._running: Counter[str] = Counter()
        self._total = 0
        # Calls run again here, whose replica died (see SessionEvents), until they end.
        self._reruns: set[asyncio.Task[None]] = set()

    async def _rerun(self, scope: Scope, stream: str, request: str, key: str | None, refused: _Refused) -> None:
        """Run `request` again as the resuming client's own POST would, into the call's stream `stream`:
        the session is adopted here, its idempotency key is the first run's, and the replay delivers
        what it streams. It runs on its own, so a resuming client that hangs up does not stop it."""
        body = request.encode()
        replaced = {b"last-event-id", b"content-length", b"content-type", b"accept", b"x-request-id"}
        headers = [(name, value) for name, value in scope["headers"] if name.lower() not in replaced]
        headers += [
            (b"content-type", b"application/json"),
            (b"accept", b"application/json, text/event-stream"),
            (b"content-length", str(len(body)).encode()),
        ]
        if key is not None:
            headers.append((b"x-request-id", key.encode()))
        sub = {**scope, "method": "POST", "headers": headers, "query_string": b"", STREAM_SCOPE_KEY: stream}
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> Message:
            if messages:
                return messages.pop()
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

        status: list[int] = []

        async def send(message: Message) -> None:
            # The stream is in the store, and the replay delivers it; only a refusal matters here.
            if message["type"] == "http.response.start":
                status.append(message["status"])

        async def run() -> None:
            try:
                await self.app(sub, receive, send)
            except Exception:
                log.exception("re-running call %s failed", stream)
            if status[:1] != [200]:
                await refused(f"(the replica that would run it again answered {status[0] if status else 'nothing'})")

        task = asyncio.get_running_loop().create_task(run())
        self._reruns.add(task)
        task.add_done_callback(self._reruns.discard)

    def _busy(self) -> JSONResponse:
        message = f"This replica is resuming {self.max_replays} streams, the most it may; try again shortly."
        return _error(503, message, retry_after=1)

    def _crowded(self) -> JSONResponse:
        message = (
            f"This session has {self.max_per_session} streams being resumed, the most it may; "
            "close one, or try again shortly."
        )
        return _error(429, message, retry_after=1)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] == self.path
            and resumes_stream(scope)
            and not refused_by_auth(scope)
        ):
            headers = Headers(scope=scope)
            session_id = headers.get("mcp-session-id")
            # No session, or one this kit never mints: the SDK answers as usual (400 / 404).
            if is_session_id(session_id):
                last_event_id = headers.get("last-event-id")
                if not is_event_id(last_event_id):
                    return await _error(400, MALFORMED)(scope, receive, send)
                if self._total >= self.max_replays:  # before any read: a flood costs the store nothing
                    return await self._busy()(scope, receive, send)
                try:
                    # The owner first, for everyone: a stranger's answer takes as long as an unknown id's.
                    found = None
                    if await self.store.owner(session_id) == owner(scope):
                        # Past the owner, so a stranger learns nothing from it; before the log is read.
                        if self._running[session_id] >= self.max_per_session:
                            return await self._crowded()(scope, receive, send)
                        found = await self.store.events_after(session_id, last_event_id)
                except StoreUnavailable:
                    return await _error(503, UNAVAILABLE)(scope, receive, send)
                if found is None:
                    return await _error(404, UNKNOWN)(scope, receive, send)
                # Again: others may have started while the store answered.
                if self._total >= self.max_replays:
                    return await self._busy()(scope, receive, send)
                if self._running[session_id] >= self.max_per_session:
                    return await self._crowded()(scope, receive, send)
                if self.on_resume is not None:
                    self.on_resume()
                self._running[session_id] += 1
                self._total += 1
                token = _rerun.set(functools.partial(self._rerun, scope))
                try:
                    return await self.app(scope, receive, send)
                finally:
                    _rerun.reset(token)
                    self._total -= 1
                    self._running[session_id] -= 1
                    if not self._running[session_id]:
                        del self._running[session_id]
        await self.app(scope, receive, send)
