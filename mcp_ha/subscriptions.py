"""Pattern: change notifications that reach every replica.

A client hears of changes made through any replica. 2026-07-28 clients send
`subscriptions/listen`, whose response is the stream; session-era clients
send `resources/subscribe` and hear `notifications/resources/updated` on
their session's stream. Here:

- `StoreBus` is the SDK's `SubscriptionBus`, carried by the store's change
  feed (`SessionStore.watch`; in Redis one pub/sub channel). Every write
  publishes the id of the session it changed from inside its own script, so
  a change costs no extra round trip, and the server's own events
  (`HighAvailability.publish`, e.g. `ToolsListChanged`) go the same way, as
  the wire notification's JSON. A replica watches the feed from its first
  listener on and hands each message to the listeners of what it changed,
  found by a dict lookup: an event costs one message per watching replica and
  one call per listener concerned, never replicas x listeners, and a write
  costs a replica the same however many listen to other things.
- A resource template with a `{session_id}` parameter shows that session's
  state: when the session changes, its URI under each such template is
  updated.
- Each listen stream is the SDK's own `ListenHandler`, over a view of the bus
  that hides the sessions the caller does not own: another principal's
  session is listened to like an unknown one (acknowledged, never fired).
- A filter this server cannot serve (a field the spec does not define, a URI
  no resource of this server matches, more than `MAX_URIS`) is refused with
  -32602 before anything is held.
- The bounds: `max_per_client` listen streams per client on a replica (its
  principal, else its address: `principals.client_of`), `max_streams` per
  replica whoever holds them, `MAX_URIS` per stream or session, the SDK's
  buffer per stream (a stream that stops reading is ended).
- A stream ends gracefully when its replica drains, or when the feed is
  lost (Redis gone: what was sent meanwhile is gone); its client listens
  again and refetches, as the spec has it. A replica that dies drops its
  streams, with the same remedy.
- A session-era session's subscriptions are kept in its record, so a
  replica that adopts it restores them, and announces each as updated once:
  what changed while the session had no replica was heard by nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

from mcp.server.subscriptions import (
    ListenHandler,
    PromptsListChanged,
    ResourcesListChanged,
    ResourceUpdated,
    ServerEvent,
    ToolsListChanged,
)
from mcp.shared.exceptions import MCPError
from mcp.shared.subscriptions import event_from_wire, event_to_notification
from mcp_types import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    EmptyResult,
    SubscribeRequestParams,
    SubscriptionFilter,
    SubscriptionsListenRequestParams,
    SubscriptionsListenResult,
    UnsubscribeRequestParams,
)

from .principals import client_of, owner
from .refusals import refused
from .session_store import RESYNC, SessionStore, StoreUnavailable, is_session_id

log = logging.getLogger(__name__)

# Resource URIs one listen stream, or one session, may ask for, and how long one may be.
MAX_URIS = 64
MAX_URI_LENGTH = 512
# The record entry keeping a session-era session's subscriptions, so they follow it to any replica.
RECORD_ENTRY = "subscriptions"
# How long a first listener waits for the feed to start before it is refused.
START_SECONDS = 2.0
# Between attempts to watch the feed again after it was lost.
REWATCH_SECONDS = 0.5
UNAVAILABLE = "Subscriptions are unavailable: the session store does not answer; try again shortly."
TOO_MANY_STREAMS = "This replica serves its limit of listen streams; try again shortly."
TOO_MANY_FOR_CLIENT = (
    "This client holds its limit of listen streams on this replica (MAX_LISTEN_STREAMS_PER_CLIENT); "
    "end one before listening again."
)
# The filter fields the spec (2026-07-28) defines; anything else is a filter this server cannot serve.
FILTER_FIELDS = frozenset({"toolsListChanged", "promptsListChanged", "resourcesListChanged", "resourceSubscriptions"})

Listener = Callable[[ServerEvent], None]


def _encode(event: ServerEvent) -> str:
    notification = event_to_notification(event, {})
    return json.dumps(notification.model_dump(mode="json", by_alias=True, exclude_none=True))


def _decode(message: str) -> ServerEvent | None:
    try:
        wire = json.loads(message)
        return event_from_wire(wire["method"], wire.get("params"))
    except (ValueError, KeyError, TypeError):
        return None


class StoreBus:
    """The SDK's `SubscriptionBus` over the store's change feed: events from every replica."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        # Resource templates showing one session's state, with `{session_id}` in them (`Subscriptions.start`).
        self.session_templates: list[str] = []
        # Listeners of every event (the session-era subscriptions' one), and listen streams by each event
        # they asked for: a message is handed to the listeners it concerns, never to all of them.
        self._everything: dict[object, Listener] = {}
        self._by_event: dict[ServerEvent, dict[object, Listener]] = {}
        self._watching: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        # Told when the feed is lost (what it carried meanwhile is gone), and when it is watched again.
        self.on_lost: Callable[[], None] = lambda: None
        self.on_rewatched: Callable[[], None] = lambda: None

    async def publish(self, event: ServerEvent) -> None:
        await self.store.publish(_encode(event))

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """`listener` hears every event."""
        token = object()
        self._everything[token] = listener

        def unsubscribe() -> None:
            self._everything.pop(token, None)

        return unsubscribe

    def subscribe_to(self, events: Iterable[ServerEvent], listener: Listener) -> Callable[[], None]:
        """`listener` hears `events` only, and costs nothing when anything else happens."""
        token, keys = object(), frozenset(events)
        for event in keys:
            self._by_event.setdefault(event, {})[token] = listener

        def unsubscribe() -> None:
            for event in keys:
                listeners = self._by_event.get(event)
                if listeners is not None:
                    listeners.pop(token, None)
                    if not listeners:
                        del self._by_event[event]

        return unsubscribe

    def start_soon(self) -> None:
        """Begin watching the feed, without waiting for it."""
        if self._watching is None:
            self._watching = asyncio.get_running_loop().create_task(self._watch())

    async def start(self) -> None:
        """Returns once the feed is watched, so nothing published after it is missed; MCPError if it cannot be."""
        self.start_soon()
        try:
            await asyncio.wait_for(self._ready.wait(), START_SECONDS)
        except TimeoutError:
            raise MCPError(INTERNAL_ERROR, UNAVAILABLE) from None

    async def _watch(self) -> None:
        lost = False
        while True:
            try:
                async with self.store.watch() as messages:
                    self._ready.set()
                    if lost:
                        self.on_rewatched()
                    async for message in messages:
                        self._deliver(message)
            except StoreUnavailable as exc:
                log.warning("change feed lost (%s); listeners are ended and told to listen again", exc)
            except Exception:  # whatever it was, the feed must come back: never leave this replica deaf
                log.exception("change feed failed; watching it again")
            finally:
                if self._ready.is_set():
                    self._ready.clear()
                    lost = True
                    self.on_lost()
            await asyncio.sleep(REWATCH_SECONDS)

    def _deliver(self, message: str) -> None:
        if message == RESYNC:
            # A change missed while a slot moved (Redis Cluster) names no session to announce; a
            # resource's next change is announced as ever.
            log.info("change feed resynchronized after a slot moved; a change made meanwhile was not announced")
            return
        if is_session_id(message):
            events: list[ServerEvent] = [
                ResourceUpdated(template.replace("{session_id}", message)) for template in self.session_templates
            ]
        else:
            event = _decode(message)
            events = [event] if event is not None else []
        for event in events:
            concerned = self._by_event.get(event)
            for listener in [*self._everything.values(), *(concerned.values() if concerned else ())]:
                try:
                    listener(event)
                except Exception:  # one listener's fault must not starve the others
                    log.exception("a subscription listener raised")

    def listening(self, notifications: SubscriptionFilter, hidden: frozenset[str]) -> _Stream:
        """The bus as one listen stream asking for `notifications` sees it, `hidden` URIs left out."""
        return _Stream(self, _events_of(notifications) - {ResourceUpdated(uri) for uri in hidden})

    async def aclose(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watching


def _events_of(notifications: SubscriptionFilter) -> frozenset[ServerEvent]:
    """The events a listen filter asks for (as the SDK's `event_matches` reads it)."""
    flags: list[tuple[bool | None, ServerEvent]] = [
        (notifications.tools_list_changed, ToolsListChanged()),
        (notifications.prompts_list_changed, PromptsListChanged()),
        (notifications.resources_list_changed, ResourcesListChanged()),
    ]
    uris = notifications.resource_subscriptions or ()
    return frozenset({event for flag, event in flags if flag is True} | {ResourceUpdated(uri) for uri in uris})


class _Stream:
    """The bus as one listen stream sees it: only the events it asked for, and never a hidden URI's."""

    def __init__(self, bus: StoreBus, events: frozenset[ServerEvent]) -> None:
        self._bus, self._events = bus, events

    async def publish(self, event: ServerEvent) -> None:
        await self._bus.publish(event)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        return self._bus.subscribe_to(self._events, listener)


def _invalid(message: str) -> MCPError:
    return MCPError(INVALID_PARAMS, message)


class Subscriptions:
    """`subscriptions/listen` (2026-07-28) and `resources/subscribe` (session-era), across replicas."""

    def __init__(
        self,
        bus: StoreBus,
        *,
        max_streams: int,
        max_per_client: int,
        resource_matches: Callable[[str], Awaitable[bool]],
        holds: Callable[[str], bool] = lambda session_id: True,
    ) -> None:
        """`holds(session_id)`: whether this replica still serves that session-era session."""
        self.bus = bus
        self.max_streams = max_streams
        self.max_per_client = max_per_client
        self._resource_matches = resource_matches
        self.holds = holds
        self._streams: set[ListenHandler] = set()
        # Session-era: which sessions here subscribed to each URI, and each one's sender (anything with
        # `send_resource_updated`: the session of a request, or the connection of an adopted session).
        self._by_uri: dict[str, set[str]] = {}
        self._sessions: dict[str, tuple[Any, set[str]]] = {}
        # Sessions this replica no longer serves are pruned when the table outgrows this (doubling).
        self._prune_at = 1000
        self._unsubscribe_sessions: Callable[[], None] | None = None
        self._sending: set[asyncio.Task[None]] = set()
        # Listens admitted but not yet streaming, so concurrent ones cannot overshoot max_streams.
        self._starting = 0
        # Listens admitted per client (`client_of`), streaming or not yet: at most max_per_client each.
        self._by_client: Counter[str] = Counter()
        # One subscribe or unsubscribe at a time per session, so its record is written in order.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        bus.on_lost = self.close
        bus.on_rewatched = self._announce_all

    @property
    def streams(self) -> int:
        return len(self._streams)

    async def _checked(self, uris: list[str]) -> frozenset[str]:
        """The URIs to hide from this caller (other principals' sessions); -32602 for what cannot be served."""
        if len(uris) > MAX_URIS:
            raise _invalid(f"At most {MAX_URIS} resource URIs may be subscribed to at once.")
        hidden = set()
        for uri in uris:
            if len(uri) > MAX_URI_LENGTH:
                raise _invalid(f"A resource URI may be at most {MAX_URI_LENGTH} characters.")
            if not await self._resource_matches(uri):
                raise _invalid(f"No resource of this server has the URI {uri[:200]!r}.")
            if not await self._visible(uri):
                hidden.add(uri)
        return frozenset(hidden)

    async def _visible(self, uri: str) -> bool:
        for template in self.bus.session_templates:
            prefix, _, suffix = template.partition("{session_id}")
            if uri.startswith(prefix) and uri.endswith(suffix) and len(uri) >= len(prefix) + len(suffix):
                session_id = uri[len(prefix) : len(uri) - len(suffix)]
                return is_session_id(session_id) and await self.bus.store.owner(session_id) == owner()
        return True

    async def listen(self, ctx: Any, params: SubscriptionsListenRequestParams) -> SubscriptionsListenResult:
        extra = set(params.notifications.model_dump(by_alias=True, exclude_none=True)) - FILTER_FIELDS
        if extra:
            raise _invalid(f"Unsupported subscription filter: {', '.join(sorted(extra))[:200]}.")
        hidden = await self._checked(list(params.notifications.resource_subscriptions or ()))
        client = _client(ctx)
        if self._by_client[client] >= self.max_per_client:
            refused("MAX_LISTEN_STREAMS_PER_CLIENT")
            raise MCPError(INTERNAL_ERROR, TOO_MANY_FOR_CLIENT)
        if len(self._streams) + self._starting >= self.max_streams:
            refused("MAX_LISTEN_STREAMS")
            raise MCPError(INTERNAL_ERROR, TOO_MANY_STREAMS)
        self._by_client[client] += 1
        try:
            self._starting += 1
            try:
                await self.bus.start()
            finally:
                self._starting -= 1
            handler = ListenHandler(self.bus.listening(params.notifications, hidden), max_subscriptions=1)
            self._streams.add(handler)
            try:
                return await handler(ctx, params)
            finally:
                self._streams.discard(handler)
        finally:
            self._by_client[client] -= 1
            if not self._by_client[client]:
                del self._by_client[client]  # a client that listens no more keeps no entry

    def _lock(self, session_id: str) -> asyncio.Lock:
        lock = self._locks.get(session_id)
        if lock is None:
            lock = self._locks[session_id] = asyncio.Lock()
        return lock

    async def subscribe(self, ctx: Any, params: SubscribeRequestParams) -> EmptyResult:
        session_id = _session_id(ctx)
        hidden = await self._checked([params.uri])
        async with self._lock(session_id):
            uris = await self._recorded(session_id)
            if params.uri not in uris and len(uris) >= MAX_URIS:
                raise _invalid(f"A session may subscribe to at most {MAX_URIS} resources.")
            await self.bus.start()
            if not hidden:
                uris.add(params.uri)
                self._hold(session_id, ctx.session, uris)
                await self.bus.store.update_record(session_id, {RECORD_ENTRY: sorted(uris)})
        return EmptyResult()

    async def unsubscribe(self, ctx: Any, params: UnsubscribeRequestParams) -> EmptyResult:
        session_id = _session_id(ctx)
        async with self._lock(session_id):
            uris = await self._recorded(session_id)
            if params.uri in uris:
                uris.discard(params.uri)
                self._forget_uri(params.uri, session_id)
                if not uris:
                    self._sessions.pop(session_id, None)
                await self.bus.store.update_record(session_id, {RECORD_ENTRY: sorted(uris)})
        return EmptyResult()

    async def _recorded(self, session_id: str) -> set[str]:
        """The session's subscriptions: as held here, else as its record has them (held elsewhere before)."""
        held = self._sessions.get(session_id)
        if held is not None:
            return held[1]
        return _recorded_uris(await self.bus.store.session_record(session_id) or {})

    def restore(self, session_id: str, record: dict[str, Any], connection: Any) -> None:
        """A session this replica now serves from its record keeps the subscriptions it had elsewhere."""
        held = _recorded_uris(record)
        if held:
            self._hold(session_id, connection, held)
            # Changes made while the session had no replica, or before the feed is watched here, were
            # heard by nobody: once it is watched, each subscribed resource is announced as updated,
            # and the client refetches (notifications are level triggers).
            self._spawn(self._announce(session_id, connection, held))

    def _spawn(self, sending: Coroutine[Any, Any, None]) -> None:
        """Send without holding up the caller (a bus listener, or adoption); kept until done."""
        task = asyncio.get_running_loop().create_task(sending)
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    def _announce_all(self) -> None:
        """The feed is back: what it carried while lost was heard by nobody, so every subscription is
        announced as updated (the 2026 streams were ended, and their clients listen again)."""
        for session_id, (sender, uris) in list(self._sessions.items()):
            self._spawn(self._announce(session_id, sender, set(uris)))

    async def _announce(self, session_id: str, sender: Any, uris: set[str]) -> None:
        try:
            await self.bus.start()
        except MCPError:
            return  # the feed is down: the lost feed ends what relies on it
        for uri in sorted(uris):
            await self._send(session_id, sender, uri)

    def _hold(self, session_id: str, sender: Any, uris: set[str]) -> None:
        if self._unsubscribe_sessions is None:
            self._unsubscribe_sessions = self.bus.subscribe(self._notify_sessions)
        if len(self._sessions) > self._prune_at:
            for gone in [sid for sid in self._sessions if not self.holds(sid)]:
                self.forget(gone)
            self._prune_at = 2 * len(self._sessions) + 1000
        self.forget(session_id)
        self._sessions[session_id] = (sender, uris)
        for uri in uris:
            self._by_uri.setdefault(uri, set()).add(session_id)

    def _forget_uri(self, uri: str, session_id: str) -> None:
        subscribed = self._by_uri.get(uri)
        if subscribed is not None:
            subscribed.discard(session_id)
            if not subscribed:
                del self._by_uri[uri]

    def forget(self, session_id: str) -> None:
        """The session ended, or moved to another replica: nothing more is sent to it from here."""
        held = self._sessions.pop(session_id, None)
        for uri in held[1] if held else ():
            self._forget_uri(uri, session_id)

    def _notify_sessions(self, event: ServerEvent) -> None:
        if not isinstance(event, ResourceUpdated):
            return
        for session_id in list(self._by_uri.get(event.uri, ())):
            if not self.holds(session_id):  # it moved to another replica, or ended
                self.forget(session_id)
                continue
            sender = self._sessions[session_id][0]
            self._spawn(self._send(session_id, sender, event.uri))

    async def _send(self, session_id: str, sender: Any, uri: str) -> None:
        try:
            await sender.send_resource_updated(uri)
        except Exception as exc:  # the session's stream is gone: it gets nothing more from here
            log.info("session subscription dropped: %s", type(exc).__name__)
            self.forget(session_id)

    def close(self) -> None:
        """End every listen stream here (a drain, or the feed lost): their clients listen again."""
        for handler in list(self._streams):
            handler.close()


def _recorded_uris(record: dict[str, Any]) -> set[str]:
    """The subscriptions a session's record keeps (at most MAX_URIS, strings only)."""
    uris = record.get(RECORD_ENTRY)
    return {uri for uri in uris[:MAX_URIS] if isinstance(uri, str)} if isinstance(uris, list) else set()


def _client(ctx: Any) -> str:
    """Who a listen counts against: the HTTP request's client (`client_of`); one for all off HTTP (stdio)."""
    scope = getattr(ctx.request, "scope", None)
    return client_of(scope) if scope is not None else "local"


def _session_id(ctx: Any) -> str:
    request = ctx.request
    session_id = request.headers.get("mcp-session-id") if request is not None else None
    if session_id is None:
        raise _invalid("resources/subscribe needs a session: this request has none.")
    return str(session_id)
