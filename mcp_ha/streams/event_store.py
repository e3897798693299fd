"""The SDK's event store over one session's event log in the shared store: what resuming reads."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import secrets
from collections.abc import Awaitable, Callable
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
from starlette.requests import Request

from ..principals import client_of
from ..session_store import LimitExceeded, SessionStore, StoreUnavailable, event_position
from .feed import EventFeed, reading_claim
from .lease import RUNNER_CHECK_SECONDS, Runs
from .reruns import Rerun, Reruns

log = logging.getLogger(__name__)

# No client needs a request id this long; a stream under one is sent live but never kept.
MAX_STREAM_ID_BYTES = 256
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


def _log_place(session_id: str, event_id: str) -> tuple[int, ...]:
    """Where an event id of the session's log (its "<n>-<m>") lies, to compare with another's."""
    position = event_position(session_id, event_id) or "0-0"
    return tuple(int(part) for part in position.split("-"))


_messages: TypeAdapter[JSONRPCMessage] = TypeAdapter(JSONRPCMessage)


class SessionEvents(EventStore):
    """The SDK's EventStore over one session's event log in the shared store."""

    def __init__(
        self,
        store: SessionStore,
        session_id: str,
        *,
        max_event_bytes: int,
        abandoned_seconds: float,
        call_ttl_seconds: int,
        feed: EventFeed | None = None,
        on_answer: Callable[[str, str], None] | None = None,
        runs: Runs | None = None,
        reruns: Reruns | None = None,
        idle_seconds: float = 30.0,
    ) -> None:
        """`feed`: the replica's (without, one of its own). `on_answer(session_id, request_id)` is told of
        each request's answer as it is stored, before it is sent. With `runs`, a call's stream names the
        run that streams it, and a replay runs it again (through `reruns`) once that run is gone; without, a replay with
        nothing new for `idle_seconds` ends (its client may resume again). A call nobody reads for
        `abandoned_seconds` is cancelled (`unread`)."""
        self.store = store
        self.session_id = session_id
        self.max_event_bytes = max_event_bytes
        self.feed = feed if feed is not None else EventFeed(store)
        self.on_answer = on_answer
        self.runs = runs
        self.reruns = reruns
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

    def rerun_into(self, stream_id: str) -> str | None:
        """The stream in the log a request about to stream runs into, when it is a re-run (`Reruns.take`)."""
        return None if self.reruns is None else self.reruns.take(self.session_id, stream_id)

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
                if await self.store.claimed(reading_claim(self.session_id, run)) is not None:
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
                        await self._progress_so_far(call, cursor, progressed)
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

    async def _progress_so_far(self, call: dict[str, Any], cursor: str, progressed: dict[Any, float]) -> None:
        """Note the progress the call's stream reported up to `cursor`, before as well as after the event
        the client resumed from: a re-run reports from the start again, and that must not reach it. What
        came after `cursor` is not noted: it has not been sent, and is sent as it is read from there."""
        try:
            found = await self.store.events_after(self.session_id, call.get("first", ""))
        except StoreUnavailable:
            return
        sent = _log_place(self.session_id, cursor)
        for event_id, text in found[1] if found is not None else ():
            if _log_place(self.session_id, event_id) > sent:
                return
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
        request = call.get("request")
        # Refused (the session ended meanwhile, say): the error goes to the log, and this replay, following
        # it, ends with it.
        refused = functools.partial(self._end, run, call)
        rerun = (
            None
            if request is None
            else Rerun(
                self.session_id,
                run,
                str(call.get("id", run.rpartition(STREAM_MARK)[0])),
                request,
                call.get("key"),
                refused,
            )
        )
        if rerun is not None and self.reruns is not None and self.reruns.start(rerun):
            log.info("call %s of session %s runs again here: its replica %s is gone", run, self.session_id, runner)
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
