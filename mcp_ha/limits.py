"""Pattern: nothing one client sends can take what every client shares.

A bound on each shared resource, each a setting with a safe default, each
answered with a clear error when hit (docs/operations.md lists them).

- `BodyLimit`: a request body to the MCP endpoint is at most
  MAX_BODY_BYTES, however it is sent. HAProxy refuses a larger declared
  Content-Length itself, but a chunked body declares none, and HAProxy only
  measures what it buffered; so the replica counts what arrives and answers
  413 with a JSON-RPC error past the bound, before the SDK sees a byte. A
  body within it is read whole first (MCP messages are small, and HAProxy
  buffers them anyway), so the app gets it as it was sent. A client that
  hangs up before its body has arrived is let go: nothing is run for it.

  Then its JSON's structure is bounded before anything parses it: at most
  MAX_REQUEST_ITEMS keys and array elements in all, nested at most
  MAX_REQUEST_DEPTH deep, else 400 with JSON-RPC -32600. Parsing, validating
  and digesting a megabyte of 80,000 keys kept the event loop for most of a
  second, so that 32 of them at once stalled /health past HAProxy's check
  and took the replica out. Counting costs far less: one pass over the bytes
  bounds both from above (every item but a container's first follows a
  comma; no JSON nests deeper than its opening brackets), which settles
  nearly every body at once. A body that bound does not clear is refused
  when its strings alone take it past (a few more passes: so are 80,000
  keys), else counted exactly, strings set aside (`structure`): on the event
  loop when it is small, else in a worker thread, one at a time, so bodies
  made to need it wait their turn instead of holding the loop.

  What the event loop spends on a body grows with its size and its items,
  and /health waits behind whatever the loop has to do (HAProxy takes a
  replica out after two checks over 800 ms). So heavy bodies (over 64 KiB,
  or over 1,000 items by that bound) take turns, HEAVY_AT_ONCE at a time:
  reading, bounding and the SDK's parsing and validating, until the answer
  starts. One waiting its turn stays unread in its client's socket, and a
  turn lasts HEAVY_TURN_SECONDS at most: a client too slow to send its body
  within it waits for another, holding nobody up. Everything else, /health
  included, passes at once.
- `SessionLimits`: an `initialize` is refused before the SDK opens anything
  for it (a refused initialize would otherwise leave a transport behind
  until it idles out): 400 (JSON-RPC -32602) when its clientInfo and
  capabilities, kept in the session's record for its life, take more than
  MAX_SESSION_RECORD_BYTES; 429 when its client (principal, or address when
  unauthenticated: `principals.client_of`) holds MAX_SESSIONS_PER_CLIENT
  sessions and handles; 503 when the store holds MAX_SESSIONS. Both with
  Retry-After. The store enforces the same two counts atomically when the
  session is recorded, so a race past this check is refused there.

- `CallsInFlight`: calls (JSON-RPC requests) in flight on this replica, at
  most MAX_CALLS_PER_SESSION per session and MAX_CALLS_PER_CLIENT per
  client (sessionless 2026-07-28 ones count per client only). One more
  waits for a place, up to CALL_QUEUE_SECONDS, so a burst a little past a
  bound is served rather than refused (stock clients do not retry a 429);
  past that wait, or with MAX_QUEUED_CALLS_PER_CLIENT of its client's calls
  already waiting, it gets 429 with Retry-After and a JSON-RPC error naming
  the bound, before the SDK reads it.

  And a client's share of the replica's time: while others have calls on
  the replica too, a client may start one only while it has fewer than
  FAIR_SHARE_CALLS / (the clients active there) in flight (at least one);
  alone, MAX_CALLS_PER_CLIENT. Past its share a call waits like one past a
  bound (same queue, same 429, naming FAIR_SHARE_CALLS). A count, not a
  clock, because what a replica's calls cost a bystander is their turns on
  the one event loop: a streamed call's notifications come in bursts, and
  64 of one client's kept a bystander's quick call behind theirs (p99 x4
  to x11 on one replica; x28 through HAProxy in issue 35). A client is active while it has calls
  in flight or waiting, and ACTIVE_SECONDS after: one that calls now and
  then keeps its share between its calls. A call running is never cut
  short: a client whose calls filled the replica before another came gets
  back to its share as they end.

  A call is in flight from its request's receipt until both its answer has
  gone and its handler has ended (`CallsRunning`, a middleware of the SDK's):
  a call whose client hung up runs on, so it still counts. A
  `subscriptions/listen` stream is no call: its own bounds count it
  (`subscriptions.py`).

  And a request whose JSON-RPC id is still in flight on its session gets
  409 with a JSON-RPC error, instead of the SDK keying both calls' answers
  by that id and one of them never answering. An id is in flight from its
  request until its answer is on its way: released when the event log takes
  the answer (an SSE answer; before it is sent), when a JSON answer starts,
  or when the request ends however it ends, so a client that reuses an id
  after reading its answer is never refused.

Elsewhere, each where the resource is: the event log's bounds
(`streams.SessionEvents`, the store's `max_log_bytes`), replays per session
and per replica (`streams.CheckResumption`), a session's state
(`max_state_bytes`) and a handle's count (`errors.py` answers both), listen
streams (`subscriptions.py`), and idle transports (SESSION_IDLE_SECONDS).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import operator
import re
import time
from collections import Counter, OrderedDict
from typing import Any, NamedTuple

import anyio
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .adoption import session_era
from .errors import refusal
from .principals import client_of, refused_by_auth
from .session_store import SessionStore, StoreUnavailable

# A client over a count waits for sessions to end or expire: a minute, not a hot loop.
RETRY_AFTER_SECONDS = 60


# The bound a call's refusal names (InFlight.admit's messages each name one, first).
_CALL_BOUND = re.compile(
    r"\b(MAX_CALLS_PER_SESSION|MAX_CALLS_PER_CLIENT|FAIR_SHARE_CALLS|MAX_QUEUED_CALLS_PER_CLIENT)\b"
)


def _bound_named(message: str) -> str:
    if "(MAX_QUEUED_CALLS_PER_CLIENT)" in message:  # it names the call's bound too, which it could not wait out
        return "MAX_QUEUED_CALLS_PER_CLIENT"
    found = _CALL_BOUND.search(message)
    return found.group(1) if found else "MAX_CALLS_PER_CLIENT"


def _too_large(max_bytes: int) -> JSONResponse:
    return refusal(413, f"Request body over {max_bytes} bytes", bound="MAX_BODY_BYTES")


# Delete tables for bytes.translate (C speed, one pass): what is left is what is counted.
_ALL = bytes(range(256))
_NOT_COMMAS_OR_OPENS = _ALL.translate(None, b",[{")
_NOT_BRACKETS = _ALL.translate(None, b"[]{}")
_WHITESPACE = b" \t\r\n"
_AS_BRACES = bytes.maketrans(b"[]", b"{}")
# A body up to this size that the bound does not clear is counted exactly on the event loop (under a
# millisecond); a larger one in a worker thread.
INLINE_BYTES = 64 * 1024
# Heavy bodies (over INLINE_BYTES, or over HEAVY_ITEMS by the one-pass bound) are read, bounded and handed
# to the SDK this many at a time, each turn HEAVY_TURN_SECONDS at most (it ends when the answer starts).
HEAVY_AT_ONCE = 1
HEAVY_ITEMS = 1000
HEAVY_TURN_SECONDS = 1.0


def structure_bound(body: bytes) -> tuple[int, int]:
    """Upper bounds on a JSON text's (keys and array elements, depth), in one pass over its bytes: each
    item but a container's first follows a comma, and nothing nests deeper than its opening brackets
    (commas and brackets inside strings only raise them)."""
    kept = body.translate(None, _NOT_COMMAS_OR_OPENS)
    return len(kept), len(kept) - kept.count(b",")


def unescaped(body: bytes) -> bytes:
    """The JSON text without its escaped backslashes, then its escaped quotes: each quote left opens or
    closes a string."""
    return body.replace(b"\\\\", b"").replace(b'\\"', b"")


def over_by_strings(text: bytes, max_items: int) -> bool:
    """Whether an `unescaped` JSON text's strings alone take it past `max_items`: each is a key, a key's
    value, an array element or the whole text, so there are at most 2 x items + 1 of them."""
    return text.count(b'"') // 2 > 2 * max_items + 1


def structure(text: bytes, max_items: int) -> tuple[int, int]:
    """An `unescaped` JSON text's keys and array elements in all, and its depth: exact for valid JSON
    (invalid JSON gets bounds from above, and its parser refuses it). Past `max_items`, the depth is only
    bounded from above: its opening brackets."""
    # Outside the strings, a string a value like any other: every comma and bracket left is structure.
    outside = b"0".join(text.split(b'"')[::2]).translate(None, _WHITESPACE)
    opens = outside.count(b"{") + outside.count(b"[")
    items = outside.count(b",") + opens - outside.count(b"{}") - outside.count(b"[]")
    closes = outside.count(b"}") + outside.count(b"]")
    if items > max_items or closes != opens:
        return items, opens
    # Within valid JSON every container but the outermost is an item, so there are at most max_items + 1
    # runs of opening brackets, each ended by one close: the depth before the n-th close is the length
    # of the runs before it less the n - 1 closes before that.
    runs = outside.translate(_AS_BRACES, _NOT_BRACKETS).split(b"}")
    return items, max(map(operator.sub, itertools.accumulate(map(len, runs)), itertools.count()), default=0)


class _Slot:
    """A request's turn among the heavy ones (BodyLimit): HEAVY_TURN_SECONDS at most, given back once."""

    def __init__(self, places: anyio.Semaphore) -> None:
        self.places = places
        self._ends: asyncio.TimerHandle | None = None

    @property
    def held(self) -> bool:
        return self._ends is not None

    async def take(self) -> None:
        if self._ends is None:
            await self.places.acquire()
            self._ends = asyncio.get_running_loop().call_later(HEAVY_TURN_SECONDS, self.give_back)

    def give_back(self) -> None:
        if self._ends is not None:
            self._ends.cancel()
            self._ends = None
            self.places.release()


class BodyLimit:
    """ASGI middleware on the MCP endpoint: a body over `max_bytes` gets 413, a structure past `max_items` or
    `max_depth` 400; heavy bodies take turns (module docstring)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, max_items: int, max_depth: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_items = max_items
        self.max_depth = max_depth
        # Exact counts of large bodies: one at a time, off the event loop.
        self._counting = anyio.CapacityLimiter(1)
        self._heavy = anyio.Semaphore(HEAVY_AT_ONCE)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _too_large(self.max_bytes)(scope, receive, send)
        slot = _Slot(self._heavy)
        try:
            if declared is not None and declared.isdigit() and int(declared) > INLINE_BYTES:
                await slot.take()  # before reading: a body waiting its turn stays in its client's socket
            chunks: list[bytes] = []
            size = 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away before its request arrived: nothing to run, nobody to answer
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_bytes:
                    return await _too_large(self.max_bytes)(scope, receive, send)
                if size > INLINE_BYTES:
                    await slot.take()  # again, if its client was too slow to send the body within its turn
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            body = b"".join(chunks)
            items, depth = structure_bound(body)
            if items > HEAVY_ITEMS:
                await slot.take()
            refused = None if items <= self.max_items and depth <= self.max_depth else await self._refusal(body)
            if refused is not None:
                return await refused(scope, receive, send)

            async def answer(message: Message) -> None:
                if message["type"] == "http.response.start":
                    slot.give_back()
                await send(message)

            await self.app(scope, _replay([{"type": "http.request", "body": body}], then=receive), answer)
        finally:
            slot.give_back()

    async def _refusal(self, body: bytes) -> JSONResponse | None:
        """For a body the one-pass bound does not clear: the refusal, if its structure is past a bound."""
        text = unescaped(body)
        if over_by_strings(text, self.max_items):
            items, depth = self.max_items + 1, 0  # many keys or strings: refused without counting them all
        elif len(text) <= INLINE_BYTES:
            items, depth = structure(text, self.max_items)
        else:
            items, depth = await anyio.to_thread.run_sync(structure, text, self.max_items, limiter=self._counting)
        if items > self.max_items:
            message = f"The request holds over {self.max_items:,} JSON keys and array elements (MAX_REQUEST_ITEMS)"
            return refusal(400, message, bound="MAX_REQUEST_ITEMS")
        if depth > self.max_depth:
            return refusal(
                400,
                f"The request nests JSON {depth} deep; this server takes at most {self.max_depth} (MAX_REQUEST_DEPTH)",
                bound="MAX_REQUEST_DEPTH",
            )
        return None


def _replay(messages: list[Message], *, then: Receive | None = None) -> Receive:
    """A receive that gives `messages`, then whatever `then` gives (a disconnect, for a streaming answer)."""
    pending = list(messages)

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        if then is None:
            return {"type": "http.disconnect"}
        return await then()

    return receive


class SessionLimits:
    """ASGI middleware: an initialize past a bound is refused before the SDK sees it (module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: SessionStore,
        max_record_bytes: int,
        max_sessions: int,
        max_sessions_per_client: int,
    ) -> None:
        self.app = app
        self.store = store
        self.max_record_bytes = max_record_bytes
        self.max_sessions = max_sessions
        self.max_sessions_per_client = max_sessions_per_client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["method"] != "POST"
            or "mcp-session-id" in Headers(scope=scope)
            or not session_era(scope)
            or refused_by_auth(scope)
        ):
            return await self.app(scope, receive, send)
        request, replay = await _peek_json(receive)
        if not isinstance(request, dict) or request.get("method") != "initialize":
            return await self.app(scope, replay, send)
        params = request.get("params")
        params = params if isinstance(params, dict) else {}
        size = sum(
            len(json.dumps(params.get(part), separators=(",", ":"), ensure_ascii=False).encode()) for part in _RECORDED
        )
        if size > self.max_record_bytes:
            message = (
                f"clientInfo and capabilities take {size} bytes; this server keeps at most {self.max_record_bytes}"
            )
            refused = refusal(400, message, code=-32602, id=request.get("id"), bound="MAX_SESSION_RECORD_BYTES")
            return await refused(scope, replay, send)
        try:
            mine = await self.store.count_sessions(holder=client_of(scope))
            everyone = await self.store.count_sessions() if mine < self.max_sessions_per_client else 0
        except StoreUnavailable:
            return await refusal(503, "Session store unavailable", retry_after=1)(scope, replay, send)
        if mine >= self.max_sessions_per_client:
            message = (
                f"You hold {self.max_sessions_per_client} open sessions, the most one client may: "
                "end some (DELETE) or wait for them to expire"
            )
            refused = refusal(
                429, message, id=request.get("id"), retry_after=RETRY_AFTER_SECONDS, bound="MAX_SESSIONS_PER_CLIENT"
            )
            return await refused(scope, replay, send)
        if everyone >= self.max_sessions:
            message = f"This server holds {self.max_sessions} sessions, the most it may; try again later"
            refused = refusal(503, message, id=request.get("id"), retry_after=RETRY_AFTER_SECONDS, bound="MAX_SESSIONS")
            return await refused(scope, replay, send)
        await self.app(scope, replay, send)


# What a session's record keeps of its initialize.
_RECORDED = ("clientInfo", "capabilities")


async def _peek_json(receive: Receive) -> tuple[Any, Receive]:
    """The request's body as JSON (None if it is not JSON: the SDK answers that itself), and a receive
    that gives the app the body again. BodyLimit, outside, has bounded it."""
    messages: list[Message] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    try:
        request = json.loads(b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request"))
    except (ValueError, RecursionError):
        request = None
    return request, _replay(messages, then=receive)


# Where CallsInFlight leaves a request's `Call` in its ASGI scope, for CallsRunning to find in the handler.
CALL_SCOPE_KEY = "mcp_ha.call"
# Not calls: a listen stream lasts as long as its client wants, and subscriptions.py bounds them itself.
UNCOUNTED_METHODS = frozenset({"subscriptions/listen"})


class Call:
    """One call in flight: counted while anything holds it (its HTTP exchange, its handler)."""

    __slots__ = ("_holds", "client", "in_flight", "session_id")

    def __init__(self, in_flight: InFlight, session_id: str | None, client: str) -> None:
        self.in_flight = in_flight
        self.session_id = session_id
        self.client = client
        self._holds = 0

    def hold(self) -> None:
        if not self._holds:
            self.in_flight.count(self, 1)
        self._holds += 1

    def drop(self) -> None:
        self._holds -= 1
        if not self._holds:
            self.in_flight.count(self, -1)


class _Waiter(NamedTuple):
    """A call waiting for a place (InFlight.wait_for_place): its `Call` is set on `place` when it has one."""

    place: asyncio.Future[Call]
    session_id: str | None
    client: str


# A client counts as active on a replica this long after its last call there ended, so that one calling now
# and then (a person, a model between turns) still has its share when its next call comes.
ACTIVE_SECONDS = 5.0


class InFlight:
    """On this replica: the JSON-RPC ids in flight on each session, and the calls in flight per session
    and per client, each client's within its fair share while others are active."""

    def __init__(
        self,
        *,
        max_per_session: int,
        max_per_client: int,
        queue_seconds: float = 0.0,
        max_queued_per_client: int = 0,
        fair_share: int = 8,
    ) -> None:
        self.max_per_session = max_per_session
        self.max_per_client = max_per_client
        self.queue_seconds = queue_seconds
        self.max_queued_per_client = max_queued_per_client
        self.fair_share = fair_share
        self._ids: dict[str, set[str]] = {}
        # A Counter drops no key by itself: `count` does, so a session or client gone costs nothing.
        self._per_session: Counter[str] = Counter()
        self._per_client: Counter[str] = Counter()
        self._queued: Counter[str] = Counter()
        # Clients with nothing in flight or waiting, still active until when (time.monotonic), soonest first.
        self._lapsing: OrderedDict[str, float] = OrderedDict()
        # The calls waiting for a place, in the order they came: each call that ends offers its place to them.
        self._waiting: list[_Waiter] = []
        self._lapse_timer: asyncio.TimerHandle | None = None

    def take(self, session_id: str, request_id: str) -> bool:
        """Mark `request_id` in flight on `session_id`; False if it already is."""
        ids = self._ids.setdefault(session_id, set())
        if request_id in ids:
            return False
        ids.add(request_id)
        return True

    def release(self, session_id: str, request_id: str) -> None:
        ids = self._ids.get(session_id)
        if ids is not None:
            ids.discard(request_id)
            if not ids:
                del self._ids[session_id]

    def active(self, client: str) -> int:
        """How many clients are active on this replica, `client` (about to call) among them."""
        self._forget_lapsed()
        busy = len(self._per_client) + sum(1 for c in self._queued if c not in self._per_client)
        idle = client not in self._per_client and client not in self._queued and client not in self._lapsing
        return busy + len(self._lapsing) + idle

    def admit(self, session_id: str | None, client: str) -> Call | str:
        """A new call, held (its caller drops it); or, past a bound or its client's share, why not."""
        if session_id is not None and self._per_session[session_id] >= self.max_per_session:
            return (
                f"This session has {self.max_per_session} calls in flight on this replica, the most one session "
                "may (MAX_CALLS_PER_SESSION): wait for one to answer, then send this again"
            )
        if self._per_client[client] >= self.max_per_client:
            return (
                f"You have {self.max_per_client} calls in flight on this replica, the most one client may "
                "(MAX_CALLS_PER_CLIENT): wait for one to answer, then send this again"
            )
        # Every client's share is at least one call: only one with calls in flight needs the count.
        active = self.active(client) if self._per_client[client] else 1
        if active > 1 and self._per_client[client] >= max(1, self.fair_share // active):
            return (
                f"You have {self._per_client[client]} calls in flight on this replica, your share while "
                f"{active} clients use it (FAIR_SHARE_CALLS {self.fair_share} shared between them): wait for "
                "one to answer, then send this again"
            )
        call = Call(self, session_id, client)
        call.hold()
        return call

    async def wait_for_place(self, session_id: str | None, client: str) -> Call | str:
        """`admit`, but a call past a bound waits up to `queue_seconds` for a place first (one of the same
        session's or client's calls ending, or another client no longer active), so a burst a little past a
        bound is served, not refused; at most `max_queued_per_client` of a client's calls wait, the next is
        refused at once."""
        call = self.admit(session_id, client)
        if not isinstance(call, str) or self.queue_seconds <= 0:
            return call
        if self._queued[client] >= self.max_queued_per_client:
            return f"{call}. {self.max_queued_per_client} more of your calls wait here (MAX_QUEUED_CALLS_PER_CLIENT)"
        self._queued[client] += 1
        self._lapsing.pop(client, None)
        waiter = _Waiter(asyncio.get_running_loop().create_future(), session_id, client)
        self._waiting.append(waiter)
        self._watch_lapses()
        try:
            async with asyncio.timeout(self.queue_seconds):
                # Until a call that ends, or a client that stops being active, leaves it a place. Shielded: a
                # place handed over as the wait runs out is seen below, not lost with a cancelled future.
                await asyncio.shield(waiter.place)
        except TimeoutError:
            if not waiter.place.done():
                return f"{call}, having waited {self.queue_seconds:g} s for a place (CALL_QUEUE_SECONDS)"
        except BaseException:
            if waiter.place.done():
                waiter.place.result().drop()  # given a place just as its request was cancelled
            raise
        finally:
            if waiter in self._waiting:
                self._waiting.remove(waiter)
            self._queued[client] -= 1
            if self._queued[client] <= 0:
                del self._queued[client]
                self._lapse(client)
        return waiter.place.result()

    def _offer(self, waiter: _Waiter) -> None:
        """Admit `waiter`'s call if it now has a place, and hand it over."""
        call = self.admit(waiter.session_id, waiter.client)
        if not isinstance(call, str):
            self._waiting.remove(waiter)
            waiter.place.set_result(call)

    def _forget_lapsed(self) -> None:
        now = time.monotonic()
        while self._lapsing and next(iter(self._lapsing.values())) <= now:
            self._lapsing.popitem(last=False)

    def _watch_lapses(self) -> None:
        """While calls wait, offer them the places a client that stops being active leaves: when the first
        still active only for ACTIVE_SECONDS stops."""
        if self._waiting and self._lapsing and self._lapse_timer is None:
            ends = next(iter(self._lapsing.values()))
            self._lapse_timer = asyncio.get_running_loop().call_later(ends - time.monotonic(), self._lapsed)

    def _lapsed(self) -> None:
        self._lapse_timer = None
        self._forget_lapsed()
        for waiter in list(self._waiting):
            self._offer(waiter)
        self._watch_lapses()

    def _lapse(self, client: str) -> None:
        """`client` has nothing in flight or waiting any more: active ACTIVE_SECONDS more."""
        if client not in self._per_client and client not in self._queued:
            self._lapsing[client] = time.monotonic() + ACTIVE_SECONDS
            self._lapsing.move_to_end(client)

    def count(self, call: Call, change: int) -> None:
        for counter, key in ((self._per_session, call.session_id), (self._per_client, call.client)):
            if key is not None:
                counter[key] += change
                if counter[key] <= 0:
                    del counter[key]
        if change > 0:
            self._lapsing.pop(call.client, None)
        else:
            self._lapse(call.client)
        if change < 0:
            # Each waiter tries the place freed, in order, here rather than woken to try (a waiter woken costs
            # the event loop far more than a check): it may suit only one further back.
            for waiter in list(self._waiting):
                self._offer(waiter)
            self._watch_lapses()


class CallsInFlight:
    """ASGI middleware inside the auth layer (a client is its principal): calls in flight past a bound
    get 429, a request id still in flight on its session 409 (module docstring)."""

    def __init__(self, app: ASGIApp, *, in_flight: InFlight) -> None:
        self.app = app
        self.in_flight = in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST" or refused_by_auth(scope):
            return await self.app(scope, receive, send)
        request, replay = await _peek_json(receive)
        if not isinstance(request, dict) or "method" not in request or request.get("id") is None:
            return await self.app(scope, replay, send)  # a notification, a response, or not JSON-RPC
        request_id = request["id"]
        method = request.get("method")
        if not isinstance(method, str) or method in UNCOUNTED_METHODS:
            return await self.app(scope, replay, send)  # not a call (the SDK refuses a method that is no string)
        session_id = Headers(scope=scope).get("mcp-session-id") if session_era(scope) else None
        call = await self.in_flight.wait_for_place(session_id, client_of(scope))
        if isinstance(call, str):
            answer_id = None if isinstance(request_id, dict | list) else request_id
            refused = refusal(429, call, code=-32000, id=answer_id, retry_after=1, bound=_bound_named(call))
            return await refused(scope, replay, send)
        scope[CALL_SCOPE_KEY] = call
        try:
            if session_id is None or isinstance(request_id, bool | dict | list):
                return await self.app(scope, replay, send)
            await self._one_answer_per_id(scope, replay, send, session_id, request_id)
        finally:
            call.drop()

    async def _one_answer_per_id(
        self, scope: Scope, receive: Receive, send: Send, session_id: str, request_id: Any
    ) -> None:
        key = str(request_id)  # as the SDK keys a request's stream
        if not self.in_flight.take(session_id, key):
            message = (
                f"A request with id {json.dumps(request_id)[:64]} is still in flight on this session; use another id"
            )
            return await refusal(409, message, id=request_id)(scope, receive, send)

        async def send_answer(message: Message) -> None:
            if message["type"] == "http.response.start":
                content_type = Headers(raw=message.get("headers", [])).get("content-type", "")
                if not content_type.startswith("text/event-stream"):
                    self.in_flight.release(session_id, key)  # a whole answer, before a byte of it is sent
            await send(message)

        try:
            await self.app(scope, receive, send_answer)
        finally:
            self.in_flight.release(session_id, key)


class CallsRunning:
    """A middleware of the SDK's, around every request's handler: while a call's handler runs, its `Call`
    stays in flight, though its client may have hung up (module docstring)."""

    async def __call__(self, ctx: Any, call_next: Any) -> Any:
        call = getattr(ctx.request, "scope", {}).get(CALL_SCOPE_KEY)
        if call is None:
            return await call_next(ctx)
        call.hold()
        try:
            return await call_next(ctx)
        finally:
            call.drop()
