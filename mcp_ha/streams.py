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
  was added to its own stream (`EventFeed`, one subscription per replica
  while any replay waits), then reads only what was added after the last
  event it read (`SessionStore.stream_since`), however long the log. The
  replays of a quiet call share one check per `RUNNER_CHECK_SECONDS` per
  replica that its replica still runs it (`Runs.alive`), and one mark every
  third of `abandoned_seconds` that someone reads its stream;
- `CheckResumption` lets at most `max_per_session` replays run per session
  (429) and `max_replays` per replica (503), both with Retry-After;
- a call nobody reads is cancelled: once its client's connection has closed
  (`_sdk.py` tells `SessionEvents.unread`), the call holds its session on
  its replica until it answers, and if no replay on any replica has read its
  stream for `abandoned_seconds` (ABANDONED_CALL_SECONDS), it is cancelled
  as its client's `notifications/cancelled` would, its stream ending with the
  SDK's "Request cancelled" error;
- a call's re-run record (its request, up to `MAX_RERUN_REQUEST_BYTES`) is
  dropped as soon as the call's answer is in the log.

A 2026-07-28 (sessionless) call has no event log and cannot resume: it ends
with its stream, whose closing is how the client cancels it. When its replica
dies, the TypeScript client would still wait out its request timeout (60 s),
as it learns of a cut only by reconnecting, and reconnects only to a stream
whose events carry ids. So `CutCalls` opens each such streamed call with a
priming event whose id names the request (`CUT_MARK`), and `CheckResumption`
answers the reconnecting GET, on any replica and without the store, with a
JSON-RPC error for that request: the call is not running, a retry is safe
(`data: {"retryable": true}`), and its idempotency key makes it apply once.

Resuming reads a stream and takes nothing over: a replica asked to replay a
session it does not hold serves it without advancing the session's ownership
epoch (`adoption.py`), so the call still running on its owner can
finish and write its result, and the resumed stream delivers that result.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import logging
import math
import secrets
import time
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
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from pydantic import TypeAdapter
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._sdk import STREAM_SCOPE_KEY
from .errors import refusal
from .idempotency import IDEMPOTENCY_KEY
from .principals import client_of, owner, refused_by_auth
from .session_store import RESYNC, LimitExceeded, SessionStore, StoreUnavailable, is_event_id, is_session_id

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
# How often the replays of a quiet call on one replica ask, together, whether the replica running it lives.
RUNNER_CHECK_SECONDS = 0.25
# A call's stream in the log is "<request id>~<token>": one per run, however its client reuses ids.
STREAM_MARK = "~"
# The largest request kept to re-run a call whose replica died (a larger one ends in an error instead).
MAX_RERUN_REQUEST_BYTES = 16 * 1024
NOT_COMPLETED = (
    "The replica running this call stopped before it answered, and the call cannot be run again here "
    "{why}. Retrying it is safe: send it again (a tools/call with the same idempotency key is applied once)."
)
# Why a call nobody read is cancelled (the reason of the notifications/cancelled it gets).
ABANDONED = "nobody read this call's stream for {seconds:g} s (ABANDONED_CALL_SECONDS): its client is gone"
# A sessionless call's priming event id: this, then base64url(JSON [request id, whether it has a key]).
CUT_MARK = "mcp-ha-cut."
CUT = (
    "This call's response stream was cut before its answer (its replica stopped, or the connection broke), "
    "and a 2026-07-28 call ends with its stream: it is not running any more. {retry}"
)
CUT_KEYED = "Retrying is safe: send it again with the same idempotency key, and its writes apply once."
CUT_UNKEYED = (
    "Send it again to complete it. It carried no idempotency key ({key} in _meta), so writes it made "
    "before the cut may apply again; a tools/call with a key applies them once."
)
# The client's reconnection delay: any replica answers it at once (HAProxy skips a dead one).
CUT_RETRY_MS = 250
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
        # Each run asked about lately: when, and the answer (shared by everyone who asks meanwhile).
        self._asked: dict[str, tuple[float, asyncio.Future[bool]]] = {}
        # The re-runs this run has claimed, until their claims lapse: each is run once here, however many
        # replays here find its runner gone.
        self._claimed: dict[str, float] = {}

    async def keep_alive(self) -> None:
        while True:
            try:
                await self.store.claim(f"alive:{self.run_id}", self.run_id, self.ttl_seconds)
            except StoreUnavailable as exc:
                log.debug("lease not renewed: %s", exc)
            await asyncio.sleep(self.renew_seconds)

    async def alive(self, run_id: str) -> bool:
        """Whether `run_id`'s lease is live. The store is asked at most once per RUNNER_CHECK_SECONDS
        per run, however many replays here wait on its calls."""
        if run_id == self.run_id:
            return True
        now = time.monotonic()
        asked = self._asked.get(run_id)
        if asked is None or now - asked[0] >= RUNNER_CHECK_SECONDS:
            if len(self._asked) >= 256:  # runs no replay asked about lately (dead ones, mostly)
                self._asked = {r: a for r, a in self._asked.items() if now - a[0] < RUNNER_CHECK_SECONDS}
            answer = asyncio.ensure_future(self._ask(run_id))
            # Read here, so an answer nobody awaits any more (its replay ended) is not logged as lost.
            answer.add_done_callback(lambda done: done.cancelled() or done.exception())
            asked = self._asked[run_id] = (now, answer)
        # Shielded: one asker cancelled (its client gone) must not cancel the answer for the others.
        return await asyncio.shield(asked[1])

    async def _ask(self, run_id: str) -> bool:
        return await self.store.claimed(f"alive:{run_id}") == run_id

    async def claim_rerun(self, name: str, ttl_seconds: int) -> bool:
        """Take the re-run `name` for this run: True for one caller, here and on every replica."""
        now = time.monotonic()
        self._claimed = {n: until for n, until in self._claimed.items() if until > now}
        if name in self._claimed:
            return False  # another replay here runs it again
        self._claimed[name] = now + ttl_seconds  # before the store answers: a replay here may ask meanwhile
        try:
            taken = await self.store.claim(name, self.run_id, ttl_seconds)
        except BaseException:
            del self._claimed[name]
            raise
        if not taken:
            del self._claimed[name]
        return taken

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
    """Per replica: wakes the replays following a stream when an event is added to it, on any replica.

    One subscription (`store.watch(events=True)`) while any replay waits, whose messages name the session
    and the stream: a replay wakes for its own stream's events only, however chatty its session, and a
    thousand waiting replays cost the store nothing until their streams grow. It also marks the streams
    followed here as read (`mark_read`), once per interval per stream however many replays follow it.
    """

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self._waiting: dict[tuple[str, str], set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None
        # Each stream followed here: when it was last marked read in the store.
        self._marked: dict[tuple[str, str], float] = {}

    def register(self, session_id: str, stream_id: str) -> asyncio.Event:
        woken = asyncio.Event()
        self._waiting.setdefault((session_id, stream_id), set()).add(woken)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._listen())
        return woken

    def forget(self, session_id: str, stream_id: str, woken: asyncio.Event) -> None:
        waiting = self._waiting.get((session_id, stream_id))
        if waiting is not None:
            waiting.discard(woken)
            if not waiting:
                del self._waiting[session_id, stream_id]
                self._marked.pop((session_id, stream_id), None)
        if not self._waiting and self._task is not None:
            self._task.cancel()
            self._task = None

    async def mark_read(self, session_id: str, stream_id: str, ttl_seconds: int) -> None:
        """Tell the replica running the stream's call that someone reads it (`SessionEvents.unread`): a
        claim for `ttl_seconds`, renewed every third of it while any replay here follows the stream."""
        now = time.monotonic()
        if now - self._marked.get((session_id, stream_id), -math.inf) < ttl_seconds / 3:
            return
        self._marked[session_id, stream_id] = now
        try:
            # Charged to nobody: a few bytes for ttl_seconds, one per stream followed, within MAX_REPLAYS.
            await self.store.claim(_reading(session_id, stream_id), "read", ttl_seconds)
        except StoreUnavailable as exc:
            self._marked.pop((session_id, stream_id), None)
            log.warning("stream %s of session %s not marked read: %s", stream_id, session_id, exc)

    def _wake_all(self) -> None:
        for waiting in self._waiting.values():
            for woken in waiting:
                woken.set()

    async def _listen(self) -> None:
        while self._waiting:
            try:
                async with self.store.watch(events=True) as added:
                    # Whatever was added before the subscription began is read by the replays woken here.
                    self._wake_all()
                    async for message in added:
                        if message == RESYNC:  # some events may have been missed: every replay reads
                            self._wake_all()
                            continue
                        session_id, _, stream_id = message.partition(" ")
                        for woken in self._waiting.get((session_id, stream_id), ()):
                            woken.set()
            except StoreUnavailable as exc:
                # What the feed carried while lost is gone: every replay reads afresh, now and once back.
                log.warning("event feed lost (%s); replays read again once it is back", exc)
                self._wake_all()
                await asyncio.sleep(1.0)


def _reading(session_id: str, stream_id: str) -> str:
    """The claim saying that a replay somewhere reads the stream (`EventFeed.mark_read`)."""
    return f"reading:{session_id}:{stream_id}"


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
        idle_seconds: float = 30.0,
        abandoned_seconds: float = 30.0,
    ) -> None:
        """`feed`: the replica's (without, one of its own). `on_answer(session_id, request_id)` is told of
        each request's answer as it is stored, before it is sent. With `runs`, a call's stream names the
        run that streams it, and a replay runs it again once that run is gone; without, a replay with
        nothing new for `idle_seconds` ends (its client may resume again). A call nobody reads for
        `abandoned_seconds` is cancelled (`unread`)."""
        self.store = store
        self.session_id = session_id
        self.max_event_bytes = max_event_bytes
        self.feed = feed if feed is not None else EventFeed(store)
        self.on_answer = on_answer
        self.runs = runs
        self.call_ttl_seconds = call_ttl_seconds
        self.idle_seconds = idle_seconds
        self.abandoned_seconds = abandoned_seconds
        # The calls streaming now on this transport, until they answer: request id -> its stream in the log.
        self._streams: dict[str, str] = {}
        # Those of them nobody reads here, each waiting to be cancelled unless a replay reads it (`unread`).
        self._unread: dict[str, asyncio.Task[None]] = {}

    async def start_stream(
        self, stream_id: str, request: JSONRPCRequest, http: Request, *, stream: str | None = None
    ) -> None:
        """A call is about to stream (JsonFirstTransport): record what re-running it takes, under
        this run. `stream`: the call's stream in the log, when this is a re-run of it."""
        if self.runs is None or len(stream_id.encode()) > MAX_STREAM_ID_BYTES:
            # Nothing to re-run it from; still a call streaming, until its answer (`unread`).
            self._streams[stream_id] = stream_id
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
            await self.store.claim(
                f"call:{self.session_id}:{run}", json.dumps(call), self.call_ttl_seconds, holder=client_of(http.scope)
            )
        except (StoreUnavailable, LimitExceeded) as exc:
            log.warning("call %s of session %s not recorded for re-running: %s", stream_id, self.session_id, exc)

    def unread(self, stream_id: str, cancel: Callable[[str], Awaitable[None]]) -> None:
        """Nobody reads the call `stream_id` here any more (its client's connection closed; a re-run has
        none): unless a replay, here or on another replica, reads its stream within `abandoned_seconds`,
        `cancel(why)` cancels it. Nothing for a call that has answered."""
        run = self._streams.get(stream_id)
        if run is None or stream_id in self._unread:
            return
        task = asyncio.get_running_loop().create_task(self._cancel_unless_read(stream_id, run, cancel))
        self._unread[stream_id] = task

        def done(_: asyncio.Task[None]) -> None:
            if self._unread.get(stream_id) is task:
                del self._unread[stream_id]

        task.add_done_callback(done)

    async def _cancel_unless_read(self, stream_id: str, run: str, cancel: Callable[[str], Awaitable[None]]) -> None:
        wait = self.abandoned_seconds
        while True:
            await asyncio.sleep(wait)
            if self._streams.get(stream_id) != run:
                return  # answered meanwhile
            try:
                if await self.store.claimed(_reading(self.session_id, run)) is not None:
                    # A replay reads it (EventFeed.mark_read): its client is back. Once its last reader has
                    # gone, the mark lapses within `abandoned_seconds`, and the call goes a third later.
                    wait = self.abandoned_seconds / 3
                    continue
            except StoreUnavailable as exc:
                log.warning("whether call %s of session %s is read was not checked: %s", run, self.session_id, exc)
                continue
            log.info(
                "cancelling call %s of session %s: nobody read it for %g s",
                run,
                self.session_id,
                self.abandoned_seconds,
            )
            await cancel(ABANDONED.format(seconds=self.abandoned_seconds))
            return

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        if self.on_answer is not None and isinstance(message, JSONRPCResponse | JSONRPCError):
            self.on_answer(self.session_id, str(message.id))
        run = self._streams.get(stream_id)
        answered = run is not None and message is not None and _answers(message, stream_id)
        if answered:
            del self._streams[stream_id]
            waiting = self._unread.pop(stream_id, None)
            if waiting is not None:
                waiting.cancel()
        if len(stream_id.encode()) > MAX_STREAM_ID_BYTES:
            return ""  # sent live, without an id: nothing to resume from
        stream_id = run or stream_id
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
            event_id = await self.store.add_event(self.session_id, stream_id, text)
        except (StoreUnavailable, LimitExceeded) as exc:
            # Raising here would stop the SDK's message router, and the session
            # with it. The message still goes out, live and without an id: there
            # is no stored place to resume from.
            log.warning("event of session %s not stored: %s", self.session_id, exc)
            return ""
        if answered:
            await self._drop_call_record(stream_id)
        return event_id

    async def _drop_call_record(self, run: str) -> None:
        """The call's answer is in the log: a replay reads it there, and nobody will run the call again."""
        if STREAM_MARK not in run:
            return
        try:
            await self.store.release(f"call:{self.session_id}:{run}")
        except StoreUnavailable as exc:
            log.debug("call record of %s in session %s not dropped (it expires): %s", run, self.session_id, exc)

    async def replay_events_after(self, last_event_id: EventId, send_callback: EventCallback) -> StreamId | None:
        """Send the stream's events after `last_event_id`, following it to its final event; then None.

        Gives up (also None, which ends the response) when the store has
        nothing new for `idle_seconds`, e.g. because the replica running the
        call died: the client may resume again from the last event it got.
        """
        try:
            found = await self.store.events_after(self.session_id, last_event_id)
        except StoreUnavailable as exc:
            log.warning("replay for session %s stopped: %s", self.session_id, exc)
            return None
        if found is None:
            return None  # unknown: CheckResumption answered that already
        stream_id, events = found
        woken = self.feed.register(self.session_id, stream_id)
        try:
            # What was added between that read and the registration is read at once.
            woken.set()
            cursor = events[-1][0] if events else last_event_id
            return await self._follow(stream_id, cursor, events, send_callback, woken)
        finally:
            self.feed.forget(self.session_id, stream_id, woken)

    async def _follow(
        self,
        stream_id: str,
        cursor: str,
        events: list[tuple[str, str | None]],
        send_callback: EventCallback,
        woken: asyncio.Event,
    ) -> StreamId | None:
        """Deliver `events`, then what the stream adds after `cursor` (the last event read of the log),
        read when the feed says the stream grew: until its answer, or until the call has ended."""
        quiet_since = anyio.current_time()
        checked = quiet_since - RUNNER_CHECK_SECONDS  # a quiet call's runner is asked about at once
        watched = self.runs is not None and STREAM_MARK in stream_id
        call: dict[str, Any] | None = None  # what the stream's call record says, once read
        progressed: dict[Any, float] = {}  # each progress token's latest progress sent
        read_ttl = max(1, math.ceil(self.abandoned_seconds))
        while True:
            for event_id, text in events:
                if text is None:
                    continue  # a priming event: a place to resume from, nothing to send
                message = _messages.validate_json(text)
                if _progress_repeated(message, progressed):
                    continue  # a re-run's progress, up to where its first run had got: it only ever rises
                await send_callback(EventMessage(message, event_id))
                if _answers(message, stream_id):
                    return None  # the call's answer: the stream is complete
            now = anyio.current_time()
            if events:
                quiet_since = now
            elif watched and now - checked >= RUNNER_CHECK_SECONDS:
                checked = now
                if call is None:
                    call = await self._call_of(stream_id)
                    if call is None:
                        watched = False  # no record (the store was out, or it expired): nobody re-runs it
                    else:
                        await self._progress_so_far(call, progressed)
                if call is not None and await self._runner_gone(stream_id, call, send_callback):
                    return None
            if not events and call is None and now - quiet_since >= self.idle_seconds:
                return None  # nobody can tell whether the call still runs: its client may resume again
            await self.feed.mark_read(self.session_id, stream_id, read_ttl)
            if not woken.is_set():
                left = RUNNER_CHECK_SECONDS if watched else self.idle_seconds - (now - quiet_since)
                with anyio.move_on_after(max(0.0, min(read_ttl / 3, left))):
                    await woken.wait()
            events = []
            if woken.is_set():
                woken.clear()  # before the read: an event added after it wakes the next wait
                try:
                    found = await self.store.stream_since(self.session_id, stream_id, cursor)
                except StoreUnavailable as exc:
                    log.warning("replay for session %s stopped: %s", self.session_id, exc)
                    return None
                if found is None:
                    return None  # trimmed while following, or expired
                cursor, events = found

    async def _call_of(self, run: str) -> dict[str, Any] | None:
        """The record of the call streamed as `run`; None when there is none (the store was out when it
        started, it expired, or the call has answered): such a stream ends after a quiet `idle_seconds`,
        as an unwatched one."""
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
        `call["runner"]` follows the latest runner known: a run gone stays gone, so while the one it
        names lives, there is no later one to look for.
        """
        assert self.runs is not None
        call_name = f"{self.session_id}:{run}"
        try:
            if await self.runs.alive(call["runner"]):
                return False
            runner = call["runner"] = await self.runs.runner_of(call_name, call["runner"])
            if await self.runs.alive(runner):
                return False
            if not await self.runs.claim_rerun(f"rerun:{call_name}:{runner}", self.call_ttl_seconds):
                return False  # another replay or replica runs it again; its events come through the store
        except StoreUnavailable as exc:
            log.warning("runner of %s in session %s not checked: %s", run, self.session_id, exc)
            return False
        call["runner"] = self.runs.run_id
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
        except (StoreUnavailable, LimitExceeded):
            return error, None
        await self._drop_call_record(run)
        return error, event_id


def resumes_stream(scope: Scope) -> bool:
    """Whether the request resumes a stream (GET with a Last-Event-ID): it reads, and changes nothing."""
    return scope["method"] == "GET" and bool(Headers(scope=scope).get("last-event-id"))


def _sessionless(scope: Scope) -> bool:
    """A 2026-07-28 request: the SDK routes by this header alone (`adoption.session_era`, negated)."""
    version = Headers(scope=scope).get("mcp-protocol-version")
    return version is not None and version not in HANDSHAKE_PROTOCOL_VERSIONS


def cut_event_id(request_id: object, keyed: bool) -> str | None:
    """The priming event id naming a sessionless request; None for an id that cannot be named by one
    (not an integer or string, or too long)."""
    if isinstance(request_id, bool) or not isinstance(request_id, int | str):
        return None
    text = json.dumps([request_id, keyed], separators=(",", ":"))
    if len(text) > MAX_STREAM_ID_BYTES:
        return None
    return CUT_MARK + base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def cut_call_named(last_event_id: str | None) -> tuple[int | str, bool] | None:
    """The (request id, keyed) a `cut_event_id` names; None for any other id, however malformed."""
    if not last_event_id or not last_event_id.startswith(CUT_MARK) or len(last_event_id) > 2 * MAX_STREAM_ID_BYTES:
        return None
    encoded = last_event_id.removeprefix(CUT_MARK)
    try:
        found = json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
    except (ValueError, RecursionError):  # binascii.Error and UnicodeDecodeError are ValueErrors
        return None
    if not isinstance(found, list) or len(found) != 2:
        return None
    request_id, keyed = found
    if isinstance(request_id, bool) or not isinstance(request_id, int | str) or not isinstance(keyed, bool):
        return None
    return request_id, keyed


def cut_error(request_id: int | str, keyed: bool) -> JSONRPCError:
    """What the client of a cut sessionless call is told: the call ended, and a retry is safe."""
    retry = CUT_KEYED if keyed else CUT_UNKEYED.format(key=IDEMPOTENCY_KEY)
    error = ErrorData(code=INTERNAL_ERROR, message=CUT.format(retry=retry), data={"retryable": True})
    return JSONRPCError(jsonrpc="2.0", id=request_id, error=error)


async def _answer_cut(send: Send, request_id: int | str, keyed: bool) -> None:
    """A 200 stream of one event, the cut call's error: only a message with the request's id ends the
    TypeScript client's call (any other status leaves it to its timeout)."""
    text = cut_error(request_id, keyed).model_dump_json(by_alias=True, exclude_unset=True)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache, no-transform")],
        }
    )
    await send({"type": "http.response.body", "body": f"event: message\r\ndata: {text}\r\n\r\n".encode()})


class CutCalls:
    """ASGI middleware: a sessionless call answered as an SSE stream opens with a priming event whose id
    names the request (`cut_event_id`) and a short `retry:`, so a client whose stream is cut reconnects
    with it and `CheckResumption` tells it at once that the call ended.

    Listen streams are left alone: the TypeScript client already ends those when they end."""

    def __init__(self, app: ASGIApp, *, path: str = "/mcp", retry_ms: int = CUT_RETRY_MS) -> None:
        self.app = app
        self.path = path
        self.retry_ms = retry_ms

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        posted = scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == self.path
        if not (posted and _sessionless(scope)):
            return await self.app(scope, receive, send)
        body: list[bytes] = []  # BodyLimit, outside, bounds it

        async def keep_body() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                body.append(message.get("body", b""))
            return message

        async def send_priming(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.start":
                content_type = Headers(raw=message.get("headers", [])).get("content-type", "")
                if content_type.startswith("text/event-stream") and (event_id := self._event_id(b"".join(body))):
                    event = f"id: {event_id}\r\nretry: {self.retry_ms}\r\ndata: \r\n\r\n"
                    await send({"type": "http.response.body", "body": event.encode(), "more_body": True})

        await self.app(scope, keep_body, send_priming)

    @staticmethod
    def _event_id(body: bytes) -> str | None:
        """The priming event id for the request in `body`; None when it gets none. Parsed only once the
        answer streams: the SDK has parsed it already, so it is a valid request."""
        try:
            request = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(request, dict) or request.get("method") == "subscriptions/listen":
            return None
        params = request.get("params")
        meta = params.get("_meta") if isinstance(params, dict) else None
        keyed = isinstance(meta, dict) and isinstance(meta.get(IDEMPOTENCY_KEY), str)
        return cut_event_id(request.get("id"), keyed)


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
        started = asyncio.Event()

        async def receive() -> Message:
            if messages:
                return messages.pop()
            # Nobody reads the response: once it has started, its "connection" closes, and the call runs on
            # as any whose client left, for as long as a replay reads its stream (SessionEvents.unread).
            await started.wait()
            return {"type": "http.disconnect"}

        status: list[int] = []

        async def send(message: Message) -> None:
            # The stream is in the store, and the replay delivers it; only a refusal matters here.
            if message["type"] == "http.response.start":
                status.append(message["status"])
                started.set()

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
        return refusal(503, message, retry_after=1)

    def _crowded(self) -> JSONResponse:
        message = (
            f"This session has {self.max_per_session} streams being resumed, the most it may; "
            "close one, or try again shortly."
        )
        return refusal(429, message, retry_after=1)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] == self.path
            and resumes_stream(scope)
            and not refused_by_auth(scope)
        ):
            headers = Headers(scope=scope)
            cut = cut_call_named(headers.get("last-event-id")) if _sessionless(scope) else None
            if cut is not None:
                # A cut sessionless call (CutCalls): nothing to read anywhere, the call has ended.
                return await _answer_cut(send, *cut)
            session_id = headers.get("mcp-session-id")
            # No session, or one this kit never mints: the SDK answers as usual (400 / 404).
            if is_session_id(session_id):
                last_event_id = headers.get("last-event-id")
                if not is_event_id(last_event_id):
                    return await refusal(400, MALFORMED)(scope, receive, send)
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
                    return await refusal(503, UNAVAILABLE)(scope, receive, send)
                if found is None:
                    return await refusal(404, UNKNOWN)(scope, receive, send)
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
