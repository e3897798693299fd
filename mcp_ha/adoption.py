"""Pattern: a session outlives the replica that created it.

The MCP SDK keeps a session in the memory of the replica that answered its
`initialize`; any other replica answers 404, and the client has to start over.
Here, instead:

1. at `initialize` the replica records the session in the store: the client's
   initialize params and the negotiated protocol version, with the sliding TTL;
2. a replica that gets a request for a session it does not hold, but the store
   knows, *adopts* it: same `mcp-session-id`, already initialized, same state.
   Adoption advances the session's ownership epoch, and every write carries the
   writer's epoch, so a replica that was paused mid-write and wakes up after
   the adoption cannot apply it (the store refuses: `Fenced`);
3. an id the store does not know still gets 404, and `DELETE` ends the session
   everywhere: its record goes, and nobody adopts it afterwards;
4. a `GET` only reads (a resumed stream, `GET` with `Last-Event-ID`,
   `streams/`; or the stream of server notifications) and takes nothing
   over: a replica that does not hold the session serves it from its record
   without advancing the epoch, so the owner's call in flight is not fenced
   off, and the resumed stream delivers its result. (A client's notification
   stream that reconnects to another replica in a failover would otherwise
   adopt the session there and fence its own call, re-sent elsewhere.) The
   next request that may write adopts the session as usual.

With authentication on (`principals.py`), a session belongs to the principal that
opened it: the record names its `owner`, adoption and `DELETE` refuse anyone
else with the same 404 as an unknown id, and the adopted transport is bound to
its owner in the SDK, which refuses anyone else on a replica that holds it.
A request the auth layer will refuse passes untouched, so it gets its 401
having adopted nothing.

Every transport, opened here or adopted, keeps its events in the session's
event log (`streams.SessionEvents`), so its streams resume on any
replica.

A replica whose event loop stood still (SIGSTOP, a frozen VM, a blocking
call) reads, once it runs again, the requests that waited in its sockets
meanwhile. Their clients may have given up, and the balancer may have given
their sessions to another replica: taking a session over for one of them
would fence the replica now serving its client, for an answer nobody reads.
So for a moment after such a stall (`Stalls`) a replica takes no session
over; it answers 503, which HAProxy re-sends elsewhere if its client is
still there. And a keyed call whose write meets a fence (another replica
took the session meanwhile) is not answered "moved": the replica takes the
session back and runs the call once more (`RetakeFenced`); its writes so far
replay, so nothing applies twice.

A session costs a replica its transport (~40 KB) only while it is used:
a transport idle for SESSION_IDLE_SECONDS is forgotten (its next request
adopts it again), and one client holds at most MAX_TRANSPORTS_PER_CLIENT
of them here (`Transports`): when it opens or brings back one more, its
least recently used idle one is forgotten. A session forgotten here keeps
only its entries in `Ownership` and `Transports` (a few hundred bytes)
until they are pruned.

The SDK-facing half (creating a transport under a given id) is in
`_sdk.py`; this module is the policy.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from fastmcp.exceptions import ToolError
from fastmcp.server.dependencies import get_http_request
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from mcp.shared.exceptions import MCPError
from mcp.shared.inbound import MCP_PROTOCOL_VERSION_HEADER
from mcp_types import INVALID_REQUEST, CallToolRequestParams
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import _sdk
from .errors import refusal
from .idempotency import key_of
from .principals import client_of, owned_by, owner, refused_by_auth
from .session_store import Fenced, LimitExceeded, SessionStore, StoreUnavailable, is_session_id
from .streams.event_store import SessionEvents

log = logging.getLogger(__name__)

# The tool error for a write fenced off because another replica adopted the
# session meanwhile. Nothing was applied, so clients may safely call again.
# On the answer to a request this replica took its session over for: the load balancer (haproxy.cfg)
# learns the session's new replica from it, and removes it.
ADOPTED_HEADER = b"x-mcp-ha-adopted"
# A transport ending here unwinds in milliseconds; a request for its session waits this long at most.
ENDING_SECONDS = 5.0


# Past this long without running, a replica's loop stood still: HAProxy (haproxy.cfg: two failed checks of
# 800 ms, half a second apart) may have taken it out and given its sessions to another replica. After such a
# stall it takes no session over for as long again: HAProxy needs two good checks (1 s) to send it new requests,
# so what it reads meanwhile waited in its sockets.
STALL_SECONDS = 1.0
TICK_SECONDS = 0.1
RETRY_ELSEWHERE = "This replica was paused and is catching up; retry"


class Stalls:
    """Whether this replica's event loop has just run again after standing still."""

    def __init__(self, *, stall_seconds: float = STALL_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_seconds = stall_seconds
        self._clock = clock
        self._last = clock()
        self._woke = -float("inf")
        self._watchers = 0  # one per app serving (a process may serve several)

    async def watch(self) -> None:
        """Tick while the app serves (its lifespan runs this); a stall shows as a late tick."""
        self._last = self._clock()
        self._watchers += 1
        try:
            while True:
                await asyncio.sleep(TICK_SECONDS)
                now = self._clock()
                if now - self._last > self.stall_seconds:
                    self._woke = now
                    log.warning(
                        "the event loop stood still for %.1f s: taking no session over for a moment", now - self._last
                    )
                self._last = now
        finally:
            self._watchers -= 1

    def just_woke(self) -> bool:
        """True while requests read now may have waited through a stall: the loop has not ticked since (the
        first requests after it), or ticked late less than `stall_seconds` ago. False when not watching."""
        if not self._watchers:
            return False
        now = self._clock()
        return now - self._last > self.stall_seconds or now - self._woke < self.stall_seconds


class Ownership:
    """The sessions this replica serves, each with the epoch it holds it at."""

    def __init__(self) -> None:
        self.epochs: dict[str, int] = {}
        # Sessions served here without owning them: their writes were fenced
        # (another replica adopted them since), or they were opened here only to
        # resume a stream. The next request that may write adopts them afresh.
        self.stale: set[str] = set()
        # One lock per session being taken over (adopted, or taken back after a fence), so that concurrent
        # requests take it once, in order; an entry disappears when no request holds or awaits its lock.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    def epoch(self, session_id: str) -> int | None:
        return self.epochs.get(session_id)

    def lock(self, session_id: str) -> asyncio.Lock:
        """The lock a takeover of `session_id` holds: one at a time, whichever layer takes it."""
        lock = self._locks.get(session_id)
        if lock is None:
            lock = self._locks[session_id] = asyncio.Lock()
        return lock

    def lost(self, session_id: str) -> None:
        self.stale.add(session_id)

    def prune(self, held: Callable[[str], bool]) -> None:
        """Forget the sessions this replica no longer serves (ended, or idled out in the SDK)."""
        for session_id in [sid for sid in {*self.epochs, *self.stale} if not held(sid)]:
            self.epochs.pop(session_id, None)
            self.stale.discard(session_id)


class Transports:
    """The session transports this replica holds, per client, least recently used first."""

    def __init__(self, max_per_client: int) -> None:
        self.max_per_client = max_per_client
        self._held: dict[str, OrderedDict[str, None]] = {}
        self._client: dict[str, str] = {}

    def used(self, session_id: str) -> None:
        client = self._client.get(session_id)
        if client is not None:
            self._held[client].move_to_end(session_id)

    def opened(self, manager: Any, session_id: str, client: str) -> None:
        """`client` holds a transport for `session_id` here now: past `max_per_client`, its least
        recently used idle ones are forgotten (busy ones stay: other bounds count what keeps them busy)."""
        self._drop(session_id)
        held = self._held.setdefault(client, OrderedDict())
        held[session_id] = None
        self._client[session_id] = client
        if len(held) <= self.max_per_client:
            return
        for other in list(held):
            if len(held) <= self.max_per_client:
                break
            if not _sdk.holds(manager, other):
                self._drop(other)  # forgotten by the SDK already (idle, or ended)
            elif other != session_id and _sdk.idle(manager, other):
                _sdk.forget(manager, other)
                self._drop(other)
                log.info("forgot the transport of session %s: its client holds %d here", other, self.max_per_client)

    def prune(self, held: Callable[[str], bool]) -> None:
        """Forget the entries of transports the SDK no longer holds."""
        for session_id in [sid for sid in self._client if not held(sid)]:
            self._drop(session_id)

    def _drop(self, session_id: str) -> None:
        client = self._client.pop(session_id, None)
        if client is not None:
            held = self._held[client]
            del held[session_id]
            if not held:
                del self._held[client]


class RecordSessions(Middleware):
    """At `initialize`, record what another replica needs to adopt the session, and keep its events."""

    def __init__(
        self,
        store: SessionStore,
        ownership: Ownership,
        *,
        events: Callable[[str], SessionEvents],
        path: str = "/mcp",
        transports: Transports | None = None,
    ) -> None:
        """`events(session_id)`: the session's event log; `transports`: the bound on each client's
        (default: none)."""
        self.store = store
        self.ownership = ownership
        self.path = path
        self.events = events
        self.transports = transports

    async def on_initialize(self, context: MiddlewareContext[Any], call_next: CallNext[Any, Any]) -> Any:
        session_id = context.fastmcp_context.session_id if context.fastmcp_context else None
        params = getattr(context.message, "params", None)
        if not is_session_id(session_id) or params is None:
            return await call_next(context)  # nothing to record: the SDK answers what it is
        scope = get_http_request().scope
        holder = client_of(scope)
        # Recorded before the SDK answers, so a session past a bound is refused on the wire:
        # FastMCP only logs what a middleware raises once the answer exists. (SessionLimits
        # refused most before the SDK saw them; this refuses the races past it, atomically.)
        # Entry by entry, each small: the store keeps them beside the session's state.
        record = {
            "client": params.client_info.model_dump(mode="json", by_alias=True, exclude_none=True),
            "capabilities": params.capabilities.model_dump(mode="json", by_alias=True, exclude_none=True),
            **owned_by(owner()),
        }
        try:
            epoch = await self.store.open_session(session_id, record, holder=holder)
        except LimitExceeded as exc:
            raise MCPError(INVALID_REQUEST, f"Refused: {exc}") from exc
        try:
            result = await call_next(context)
        except BaseException:
            await self.store.end_session(session_id, holder=holder)
            raise
        if result is None:
            await self.store.end_session(session_id, holder=holder)
            return result
        # The version last: a record without one is adopted by nobody.
        await self.store.update_record(session_id, {"version": result.protocol_version})
        self.ownership.epochs[session_id] = epoch
        # Before the answer is routed, so it is the first event of the session's log.
        manager = _sdk.running_session_manager(scope["app"], self.path)
        _sdk.bind_event_store(manager, session_id, self.events(session_id))
        if self.transports is not None:
            self.transports.opened(manager, session_id, holder)
        return result


class RetakeFenced(Middleware):
    """A keyed call whose write was fenced off (another replica took the session since this one last did)
    takes the session back and runs once more, so its client never hears "moved": the writes it made before
    the fence replay under its key, so nothing applies twice. Once: a second fence is answered as usual
    (`errors.StoreErrors`). A call without a key, or on a replica whose loop just stood still, is not run
    again: its first writes could apply twice, or its client be gone."""

    def __init__(
        self,
        store: SessionStore,
        ownership: Ownership,
        *,
        stalls: Stalls | None = None,
        on_adopt: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.ownership = ownership
        self.stalls = stalls
        self.on_adopt = on_adopt

    async def on_call_tool(
        self, context: MiddlewareContext[CallToolRequestParams], call_next: CallNext[CallToolRequestParams, Any]
    ) -> Any:
        session_id = context.fastmcp_context.session_id if context.fastmcp_context else None
        held = self.ownership.epoch(session_id) if is_session_id(session_id) else None
        try:
            return await call_next(context)
        except (ToolError, Fenced) as exc:
            cause = exc.__cause__ if isinstance(exc, ToolError) else exc
            if not isinstance(cause, Fenced) or held is None or session_id is None or key_of(context) is None:
                raise
            if self.stalls is not None and self.stalls.just_woke():
                raise
            if not await self._retake(session_id, held):
                raise
        return await call_next(context)

    async def _retake(self, session_id: str, held: int) -> bool:
        """Own the session again, unless a concurrent call of it already did since `held`; False when gone."""
        async with self.ownership.lock(session_id):
            if self.ownership.epoch(session_id) not in (held, None) and session_id not in self.ownership.stale:
                return True
            found = await self.store.adopt_session(session_id)
            if found is None:
                return False
            self.ownership.epochs[session_id] = found[1]
            self.ownership.stale.discard(session_id)
        log.info("took session %s back at epoch %d after a fenced write, and ran the call again", session_id, found[1])
        if self.on_adopt is not None:
            self.on_adopt()
        return True


# Byte for byte the SDK's answer to an id it does not hold, so an unknown, a
# malformed and another principal's session id all read alike.
SESSION_NOT_FOUND = refusal(404, "Session not found")


def _marked_adopted(send: Send) -> Send:
    async def marked(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (ADOPTED_HEADER, b"1")]}
        await send(message)

    return marked


def session_era(scope: Scope) -> bool:
    """Whether the SDK serves this request by its session header (as its own router decides)."""
    version = Headers(scope=scope).get(MCP_PROTOCOL_VERSION_HEADER)
    return version is None or version in HANDSHAKE_PROTOCOL_VERSIONS


class AdoptSessions:
    """ASGI middleware in front of the MCP endpoint: adopt, or end, sessions held elsewhere."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: SessionStore,
        ownership: Ownership,
        events: Callable[[str], SessionEvents],
        path: str = "/mcp",
        on_adopt: Callable[[], None] | None = None,
        on_serve: Callable[[str, dict[str, Any], Any], None] | None = None,
        transports: Transports | None = None,
        stalls: Stalls | None = None,
    ) -> None:
        """`on_serve(session_id, record, connection)`: told of each session this replica starts serving
        from its record (subscriptions.py restores its subscriptions). `events` and `transports` as for
        RecordSessions; `stalls`: no session is taken over just after this replica's loop stood still."""
        self.app = app
        self.stalls = stalls
        self.transports = transports
        self.events = events
        self.store = store
        self.ownership = ownership
        self.path = path
        self.on_adopt = on_adopt
        self.on_serve = on_serve
        # The SDK forgets idle sessions without telling anyone; prune when the
        # epochs outgrow this (doubling, so pruning costs O(1) per request).
        self._prune_at = 1000

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        session_id = Headers(scope=scope).get("mcp-session-id")
        if session_id is None or refused_by_auth(scope):
            return await self.app(scope, receive, send)
        if not is_session_id(session_id):
            if not session_era(scope):
                return await self.app(scope, receive, send)  # the SDK ignores the header there
            # One this kit never mints: the SDK would answer the same 404, but
            # log the raw header first.
            return await SESSION_NOT_FOUND(scope, receive, send)
        manager = _sdk.running_session_manager(scope["app"], self.path)
        if len(self.ownership.epochs) + len(self.ownership.stale) > self._prune_at:
            self.ownership.prune(lambda sid: _sdk.holds(manager, sid))
            if self.transports is not None:
                self.transports.prune(lambda sid: _sdk.holds(manager, sid))
            self._prune_at = 2 * (len(self.ownership.epochs) + len(self.ownership.stale)) + 1000
        if self.transports is not None:
            self.transports.used(session_id)
        if not await _sdk.ended_here(manager, session_id, seconds=ENDING_SECONDS):
            return await refusal(503, "Session is being closed on this replica; retry")(scope, receive, send)
        adopted = False
        try:
            if scope["method"] == "DELETE":
                if await self.store.owner(session_id) != owner(scope) or not await self._end(
                    manager, session_id, scope
                ):
                    return await SESSION_NOT_FOUND(scope, receive, send)
                if not _sdk.holds(manager, session_id):
                    return await Response(status_code=200)(scope, receive, send)
            elif not _sdk.holds(manager, session_id) or session_id in self.ownership.stale:
                # A GET only reads (a resumed stream, or the stream of server notifications): it takes
                # nothing over, so a client's GET reconnecting elsewhere never fences its own call.
                take_over = scope["method"] != "GET"
                if take_over and self.stalls is not None and self.stalls.just_woke():
                    # Its client may be gone, its session served elsewhere: taking it would fence that replica.
                    log.info("session %s not taken over: this replica's loop just stood still", session_id)
                    return await refusal(503, RETRY_ELSEWHERE, retry_after=1)(scope, receive, send)
                if not await self._adopt(manager, session_id, scope, take_over=take_over):
                    return await SESSION_NOT_FOUND(scope, receive, send)
                adopted = take_over
            elif _sdk.refuses(manager, session_id, scope.get("user")):
                # Another principal's session held here: the SDK would answer the same 404 without
                # asking the store, where an unknown id costs a read of its owner. The same read
                # here, so not even the store's work tells the two apart.
                await self.store.owner(session_id)
                return await SESSION_NOT_FOUND(scope, receive, send)
        except StoreUnavailable as exc:
            # Nothing was processed, so the proxy may safely try another replica.
            log.warning("session %s not served: the store is unavailable (%s)", session_id, exc)
            return await refusal(503, "Session store unavailable")(scope, receive, send)
        await self.app(scope, receive, _marked_adopted(send) if adopted else send)

    async def _adopt(self, manager: Any, session_id: str, scope: Scope, *, take_over: bool) -> bool:
        """Serve the session here; with `take_over`, as its owner (a new epoch), else only to read it.

        Only for the principal that opened it: checked before anything
        changes, so a stranger's attempt does not even advance the epoch.
        """
        async with self.ownership.lock(session_id):  # concurrent first requests adopt once
            if _sdk.holds(manager, session_id) and (session_id not in self.ownership.stale or not take_over):
                return True  # a concurrent request adopted it while we waited, or reading needs no epoch
            if await self.store.owner(session_id) != owner(scope):
                return False
            found = await self._record(session_id, take_over=take_over)
            if found is None:
                return False
            record, epoch = found
            # A stale owner still holds a working transport for the session: only its
            # epoch was out of date, and adopting has just renewed that.
            if not _sdk.holds(manager, session_id) and not await self._serve(manager, session_id, record, scope):
                return False
            if epoch is None:
                self.ownership.stale.add(session_id)
                log.info("serving session %s to resume a stream, without taking it over", session_id)
                return True
            self.ownership.epochs[session_id] = epoch
            self.ownership.stale.discard(session_id)
            log.info("adopted session %s at epoch %d", session_id, epoch)
            if self.on_adopt is not None:
                self.on_adopt()
            return True

    async def _record(self, session_id: str, *, take_over: bool) -> tuple[dict[str, Any], int | None] | None:
        """The session's record, and with `take_over` its new epoch (None when only reading); None for a
        session gone, or a record no replica can serve."""
        found: tuple[dict[str, Any], int | None] | None
        try:
            if take_over:
                found = await self.store.adopt_session(session_id)
            else:
                record = await self.store.session_record(session_id)
                found = None if record is None else (record, None)
        except ValueError as exc:
            log.warning("not adopting %s: corrupt session record (%s)", session_id, exc)
            return None
        if found is not None and found[0].get("version") not in HANDSHAKE_PROTOCOL_VERSIONS:
            version = found[0].get("version")
            log.warning("not adopting %s: corrupt record or unsupported protocol version %r", session_id, version)
            return None
        return found

    async def _serve(self, manager: Any, session_id: str, record: dict[str, Any], scope: Scope) -> bool:
        """A transport for the session here, built from its record; False for a record that cannot build one."""
        version = record["version"]
        try:
            await _sdk.adopt(
                manager,
                session_id,
                client_params={
                    "protocolVersion": version,
                    "capabilities": record["capabilities"],
                    "clientInfo": record["client"],
                },
                protocol_version=version,
                event_store=self.events(session_id),
                user=scope.get("user"),
                on_connected=None if self.on_serve is None else functools.partial(self.on_serve, session_id, record),
            )
        except (KeyError, TypeError, ValidationError) as exc:
            log.warning("not adopting %s: corrupt session record (%s)", session_id, exc)
            return False
        if self.transports is not None:
            self.transports.opened(manager, session_id, client_of(scope))
        return True

    async def _end(self, manager: Any, session_id: str, scope: Scope) -> bool:
        # A handle (handles.py) has an id of the same form and a record under the same key, but
        # it is no MCP session, and a DELETE naming one must not end it: only a session's record names
        # a protocol version (_adopt's test too).
        record = await self.store.session_record(session_id)
        if record is not None and record.get("version") not in HANDSHAKE_PROTOCOL_VERSIONS:
            return False
        ended = await self.store.end_session(session_id, holder=client_of(scope))
        self.ownership.epochs.pop(session_id, None)
        self.ownership.stale.discard(session_id)
        return ended or _sdk.holds(manager, session_id)
