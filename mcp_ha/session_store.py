"""Pattern: externalize per-session state.

Tools never hold session state in process memory. They go through a
`Session` (a store bound to one session id), and the `SessionStore` behind it
lives outside the replica, so any replica can serve any session and a session
outlives the replica that served it.

The contract has three parts, each small enough to implement for another
backend; the shared suite in `tests/test_session_store.py` tells you whether
you got it right.

- **State**: `get`, `set`, `incr`, `append`, `delete`, `items`, `copy`,
  `touch`, `count_sessions`, and `apply`, several writes as one (below).
  Every operation is atomic on its own (no read-modify-write in Python),
  slides the session's TTL and marks it live in an index, so counting never
  walks the keyspace. Session ids are data, never patterns.
- **Session records**, for adoption: `open_session` records what a replica
  needs to take over a session it never saw (client info, protocol version),
  `adopt_session` hands it to a new replica and advances its ownership epoch,
  `end_session` removes it so nobody can adopt it again. The record lives and
  expires with the session's state. Its `owner` entry, when it has one (the
  principal that opened the session, `mcp_ha/principals.py`), is the one part that
  outlives `end_session`, because the state it guards does: `owner` reads it.
- **Safe writes**: every write takes `epoch=` and `op=`. With `epoch`, the
  write applies only while the session's epoch is still that one, so a replica
  that was paused while another adopted its session cannot apply a stale write
  (`Fenced`). With `op` (an `Op`: which write of which call), the write applies
  at most once: a repeat returns the recorded result, the record commits
  together with the change, and the same op id sent for a different call is
  refused (`OpReused`). A call's op records are kept for at least
  `op_ttl_seconds` after its latest write, and at most half as long again:
  they share one key per session and per half op TTL (`op_span`), so a
  record costs its fields, not a key of its own. `apply` commits several writes together, only if
  the entries the caller read are still what it read (else `Conflict`), and
  records a result of the caller's choosing under its op; `recall` reads that
  record back, so a retry can answer without running anything again.
- **Session events**, for SSE streams that resume on any replica
  (`mcp_ha/streams/`): `add_event` appends a stream's message to the
  session's event log and names it; `events_after` answers a `Last-Event-ID`
  with what that stream sent since, and `stream_since` gives a replay following
  a stream only what was added after the last event it read. The log is bounded by count
  (`max_events`) and kept `event_ttl_seconds` after its latest event (a cut
  stream is resumed within seconds; later, a client sends its call again),
  and an event id only ever names an event of its own session.
- **Quotas**: everything the store keeps is charged to a holder (a principal,
  or a client's address: `principals.client_of`), in bytes, and a write that
  would take a holder past `max_bytes_per_holder` is refused (`LimitExceeded`,
  naming MAX_CLIENT_BYTES), with nothing applied. A session's keys (its state
  and record, its calls' op records, its event log) are charged to the holder
  `open_session` was given, recorded with the session, whoever writes
  (a `copy` into it counts what it copies); a claim to the `holder` given to
  `claim`. What the store keeps without a holder is charged to nobody. A
  charge lasts as long as what it counts: it is freed when that expires or is
  released (`release`), and a session's record is charged only what is left
  of it once the session ended. Each key counts
  what it holds plus a fixed cost for the key and its bookkeeping
  (`KEY_BYTES` and three times its name; `ENTRY_BYTES` per entry of a hash,
  `EVENT_BYTES` per event), close to what Redis spends on it.

State keys are chosen by tool code; keys starting with "." are the store's own.
"""

from __future__ import annotations

import copy
import hashlib
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, TypedDict, TypeGuard, TypeVar, cast

T = TypeVar("T")

DEFAULT_TTL_SECONDS = 30 * 60
# How long a write's op is remembered: a retry later than this counts as new.
DEFAULT_OP_TTL_SECONDS = 10 * 60
# How long a session's events are kept after its latest one: a stream cut by a
# failover is resumed within seconds, and a client that comes back later sends
# its call again (its idempotency key makes that safe).
DEFAULT_EVENT_TTL_SECONDS = 5 * 60
# How many events of a session are kept for replay: enough for a long call's
# progress, bounded so a chatty session cannot grow without limit.
DEFAULT_MAX_EVENTS = 1000
# A session's event log, in bytes: resuming needs the last few events, not a history.
DEFAULT_MAX_LOG_BYTES = 256 * 1024
# A session's state, in bytes of JSON text.
DEFAULT_MAX_STATE_BYTES = 256 * 1024
# Live sessions (and handles): in all, and per holder (a principal, or a client address).
DEFAULT_MAX_SESSIONS = 200_000
DEFAULT_MAX_SESSIONS_PER_HOLDER = 5_000
# Everything the store keeps for one holder, in bytes (what the quotas count: module docstring).
DEFAULT_MAX_BYTES_PER_HOLDER = 32 * 1024 * 1024
# What a key costs beyond what it holds: Redis's own (~190 bytes for a small hash with a TTL) and the
# quota's record of it (~300), plus three times its name (the key, and twice in that record); each
# entry of a hash ~64 (Redis's hash table), each event of a log ~16. Measured on Redis 7.0.
KEY_BYTES = 384
ENTRY_BYTES = 64
EVENT_BYTES = 16
# The session record's entry naming the principal that opened the session
# (`mcp_ha/principals.py`): the one entry that outlives `end_session`, read by `owner`.
OWNER = "owner"

# The only form of id this kit mints: 128 random bits as lowercase hex, the
# same form as the MCP SDK's `uuid4().hex` session ids. Anything else is not a
# session id and is refused before it reaches a store or a log line.
_SESSION_ID = re.compile(r"[0-9a-f]{32}")


def is_session_id(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and _SESSION_ID.fullmatch(value) is not None


# Event ids: "<n>-<m>.<tag>". "<n>-<m>" orders an event within its session's
# log (Redis: its clock in ms and a count within the ms; the in-memory store
# counts from its clock). The tag, hashed from the session id, tells sessions
# apart: two sessions' logs can hold the same "<n>-<m>", and an id
# from one session must never name an event of another. Clients send ids back
# (Last-Event-ID), so an id is checked against this form before any store
# sees it; both numbers must fit in 64 bits, as Redis requires.
_EVENT_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})\.[0-9a-f]{8}")


def is_event_id(value: object) -> TypeGuard[str]:
    """Whether `value` has the form of an event id this kit mints (for whichever session)."""
    found = _EVENT_ID.fullmatch(value) if isinstance(value, str) else None
    return found is not None and int(found[1]) < 2**64 and int(found[2]) < 2**64


def _event_tag(session_id: str) -> str:
    return hashlib.blake2b(session_id.encode(), digest_size=4).hexdigest()


def mint_event_id(session_id: str, position: str) -> str:
    """The id of the event at `position` ("<n>-<m>") of this session's log."""
    return f"{position}.{_event_tag(session_id)}"


def event_position(session_id: str, event_id: str) -> str | None:
    """The "<n>-<m>" of an id minted for this session; None for anything else."""
    if not is_event_id(event_id):
        return None
    position, _, tag = event_id.partition(".")
    return position if tag == _event_tag(session_id) else None


def key_bytes(name: str) -> int:
    """What a key named `name` (as Redis names it) is charged beyond what it holds."""
    return KEY_BYTES + 3 * len(name.encode())


def entry_bytes(name: str, text: str) -> int:
    """What one entry of a hash is charged: its name and text, and its place in the hash."""
    return len(name.encode()) + len(text.encode()) + ENTRY_BYTES


def op_fields(op: Op) -> tuple[str, str]:
    """The fields a call's records take in its session's op bucket: the call's digest's, then this
    write's result's. The call key goes first with its length in bytes, so no call's fields can be
    another's, and the digest's field is where the result's begins."""
    call = f"{len(op.call.encode())}:{op.call}"
    return call, f"{call}>{op.write}"


def op_span(op_ttl_seconds: int) -> int:
    """How many seconds of writes one op bucket holds. A bucket lives until the op TTL after its span
    ends, so a record lives between one op TTL and one and a half, and a write looks in the few
    buckets that can still hold its call's records."""
    return max(1, op_ttl_seconds // 2)


def payer_of(holder: str) -> str:
    """The holder as a session records whom it is charged to: short and fixed, for Redis's compact hashes.

    A principal is its owner digest (principals.py), which an authenticated session keeps anyway, so it
    needs no entry of its own; an address, 12 hex: a collision only merges two addresses' quotas."""
    if holder.startswith("principal:"):
        return holder.removeprefix("principal:")
    return hashlib.blake2b(holder.encode(), digest_size=6).hexdigest()


def over_quota(total: int, quota: int) -> str:
    """Why a write that would take a holder to `total` bytes is refused (the Redis store says the same)."""
    return (
        f"this client's stored data would take {total:,} bytes; "
        f"the store keeps at most {quota:,} per client (MAX_CLIENT_BYTES)"
    )


def check_key(key: str) -> str:
    """A state key as tool code may use it: keys starting with "." belong to the store."""
    if not isinstance(key, str) or not key or key.startswith("."):
        raise ValueError(f"state keys are non-empty strings not starting with '.': {key!r}")
    return key


@dataclass(frozen=True)
class Op:
    """One write of one call, so a retried call applies each of its writes once.

    `call` is the call's idempotency key; `digest` says what the call was
    (tool and arguments), so the same key sent with a different call is
    refused instead of replayed; `write` names the write within the call.
    """

    call: str
    digest: str
    write: str = "1"


class StoreUnavailable(Exception):
    """The store could not be reached; the operation may not have happened."""


class StoreFull(StoreUnavailable):
    """The store refused a write for want of memory (Redis `maxmemory`): nothing was applied.

    Answered like an unreachable store (a keyed call may be sent again), and
    never by evicting what is live.
    """


# What a client is told when the store is unavailable: a keyed call may be sent
# again (its op replays if it did happen), so clients retry on this message.
STORE_UNAVAILABLE = "Session store unavailable; try again shortly."


class Fenced(Exception):
    """Another replica adopted the session (or it ended): this write was not applied."""


class OpReused(Exception):
    """The op id was already used by a different call: this write was not applied."""


class Conflict(Exception):
    """An entry `apply` was told to expect changed meanwhile: nothing was applied."""


class LimitExceeded(ValueError):
    """A write or a new session would pass one of the store's bounds: nothing was applied.

    The message says which bound, in words a client can act on.
    """


# One write of an `apply`: (operation, key, argument). Operations: "set" (the
# value), "incr" (by how much), "append" (the item) and "delete" (None).
Write = tuple[str, str, Any]
WRITE_OPERATIONS = ("set", "incr", "append", "delete")


class StoreLimits(TypedDict, total=False):
    """SessionStore's keyword arguments, for a store to take with `**limits` and pass on."""

    ttl_seconds: int
    op_ttl_seconds: int
    event_ttl_seconds: int
    max_events: int
    max_log_bytes: int
    max_state_bytes: int
    max_sessions: int
    max_sessions_per_holder: int
    max_bytes_per_holder: int
    on_replay: Callable[[Op], None] | None


# What a watch yields after it may have missed messages and hears again (SessionStore.watch): no
# message is empty.
RESYNC = ""


class SessionStore(ABC):
    """Where session state lives. Values are anything JSON can hold."""

    def __init__(
        self,
        *,
        ttl_seconds: int = DEFAULT_TTL_SECONDS,
        op_ttl_seconds: int = DEFAULT_OP_TTL_SECONDS,
        event_ttl_seconds: int = DEFAULT_EVENT_TTL_SECONDS,
        max_events: int = DEFAULT_MAX_EVENTS,
        max_log_bytes: int = DEFAULT_MAX_LOG_BYTES,
        max_state_bytes: int = DEFAULT_MAX_STATE_BYTES,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_sessions_per_holder: int = DEFAULT_MAX_SESSIONS_PER_HOLDER,
        max_bytes_per_holder: int = DEFAULT_MAX_BYTES_PER_HOLDER,
        on_replay: Callable[[Op], None] | None = None,
    ) -> None:
        """`on_replay` is told of each write answered from its op record instead of applied (metrics).

        The bounds: a session's event log keeps at most `max_events` events and
        `max_log_bytes` bytes (the oldest go first); its state at most
        `max_state_bytes` bytes of JSON text (a write past it is refused,
        `LimitExceeded`); and `open_session` refuses a session past
        `max_sessions` in all or `max_sessions_per_holder` for its holder; and
        a holder's keys together take at most `max_bytes_per_holder` (module docstring).
        """
        if min(ttl_seconds, op_ttl_seconds, event_ttl_seconds) <= 0:
            raise ValueError("TTLs must be positive")
        bounds = (max_events, max_log_bytes, max_state_bytes, max_sessions, max_sessions_per_holder)
        if min(*bounds, max_bytes_per_holder) <= 0:
            raise ValueError("store bounds must be positive")
        self.ttl_seconds = ttl_seconds
        self.op_ttl_seconds = op_ttl_seconds
        self.event_ttl_seconds = event_ttl_seconds
        self.max_events = max_events
        self.max_log_bytes = max_log_bytes
        self.max_state_bytes = max_state_bytes
        self.max_sessions = max_sessions
        self.max_sessions_per_holder = max_sessions_per_holder
        self.max_bytes_per_holder = max_bytes_per_holder
        self._on_replay = on_replay

    def replayed(self, op: Op) -> None:
        """For stores: `op` was already applied, and its recorded result is the answer."""
        if self._on_replay is not None:
            self._on_replay(op)

    # -- state ---------------------------------------------------------------------

    @abstractmethod
    async def get(self, session_id: str, key: str) -> Any | None:
        """The value stored under `key`, or None."""

    @abstractmethod
    async def set(
        self, session_id: str, key: str, value: Any, *, epoch: int | None = None, op: Op | None = None
    ) -> None:
        """Store `value` under `key`, replacing what was there."""

    @abstractmethod
    async def incr(
        self, session_id: str, key: str, by: int = 1, *, epoch: int | None = None, op: Op | None = None
    ) -> int:
        """Atomically add `by` to the integer under `key` (0 when unset); the new value."""

    @abstractmethod
    async def append(
        self,
        session_id: str,
        key: str,
        value: Any,
        *,
        max_items: int | None = None,
        epoch: int | None = None,
        op: Op | None = None,
    ) -> int:
        """Atomically append `value` to the list under `key`; the list's new length.

        O(1) in the list's length. With `max_items`, an append that would make
        the list longer is refused (`LimitExceeded`).
        """

    @abstractmethod
    async def delete(self, session_id: str, key: str, *, epoch: int | None = None, op: Op | None = None) -> bool:
        """Remove the entry under `key`; whether there was one."""

    @abstractmethod
    async def apply(
        self,
        session_id: str,
        writes: Sequence[Write],
        *,
        expect: Mapping[str, Any],
        result: Any,
        epoch: int | None = None,
        op: Op | None = None,
    ) -> Any:
        """Apply `writes` in order, all or none, and record `result` under `op`; the result.

        In this order: an op already applied is not applied again, and its
        recorded result is the answer (OpReused for another call's digest);
        a stale `epoch` is Fenced; an entry of `expect` whose value is no
        longer the one given (None: absent) is a Conflict. Nothing is applied
        unless everything passes.
        """

    @abstractmethod
    async def recall(self, session_id: str, op: Op) -> tuple[bool, Any]:
        """Whether `op` was applied (by `apply` or a single write), and its recorded result. Writes nothing.

        OpReused when the op's call was recorded with another digest.
        """

    @abstractmethod
    async def items(self, session_id: str) -> dict[str, Any]:
        """Every entry of the session, in one consistent read."""

    @abstractmethod
    async def copy(self, source_id: str, target_id: str, *, epoch: int | None = None, op: Op | None = None) -> int:
        """Atomically copy every entry of `source_id` over `target_id`; how many were copied.

        Costs time proportional to the source session's entries, never the store's.
        """

    @abstractmethod
    async def touch(self, session_id: str) -> None:
        """Mark the session live now (sliding its TTL) without changing its state."""

    @abstractmethod
    async def count_sessions(self, *, holder: str | None = None) -> int:
        """Sessions touched within the TTL, from an index: never a scan.

        With `holder`, only the sessions and handles opened for it (`open_session`)
        and not ended since, opened within the TTL.
        """

    # -- session records -------------------------------------------------------------

    @abstractmethod
    async def open_session(self, session_id: str, record: dict[str, Any], *, holder: str | None = None) -> int:
        """Record a new session (what adoption needs); its first epoch.

        Keep the record's values small: a store may keep each entry beside the
        session's state (Redis: one field each, in the session's hash).
        Refused (`LimitExceeded`, nothing recorded) when the store holds
        `max_sessions` live sessions, or `holder` (who opens it: a principal,
        or a client's address) `max_sessions_per_holder`, or when the record
        would take `holder` past its quota. `holder` is the one the session's
        keys are charged to from now on (the first one given, if opened again).
        """

    @abstractmethod
    async def session_record(self, session_id: str) -> dict[str, Any] | None:
        """The record `open_session` kept, while the session lives; None otherwise. Adopts nothing."""

    @abstractmethod
    async def update_record(self, session_id: str, entries: dict[str, Any]) -> bool:
        """Add or replace `entries` of the session's record (not its `owner`); False when it has none."""

    @abstractmethod
    async def adopt_session(self, session_id: str) -> tuple[dict[str, Any], int] | None:
        """Take over a recorded session: its record and its new, higher epoch; None if unknown."""

    @abstractmethod
    async def end_session(self, session_id: str, *, holder: str | None = None) -> bool:
        """Forget the session's record, so nobody adopts it again; whether there was one.

        With the `holder` it was opened for, it no longer counts against that holder's
        sessions. Its event log and call records go at once (a request naming an ended session gets
        404, so nothing resumes or replays them), and its payer is charged only what is left of the
        record (and its state, while it lives).

        The record's `owner` entry stays while the state lives.
        """

    @abstractmethod
    async def owner(self, session_id: str) -> str | None:
        """The `owner` entry `open_session` recorded, while the session's state lives, ended or not;
        None when unowned or unknown. Touches nothing."""

    # -- session events, for resumable streams --------------------------------------------

    @abstractmethod
    async def add_event(self, session_id: str, stream_id: str, message: str | None) -> str:
        """Append an event of `stream_id` to the session's log; its id.

        `message` is the JSON text of a JSON-RPC message, or None for a priming
        event (a place to resume from, with nothing to replay). The log keeps
        the session's last `max_events` events within `max_log_bytes`, for the event
        TTL from the latest add. Charged to the session's holder (`open_session`):
        refused (`LimitExceeded`, nothing added) past its quota.
        """

    @abstractmethod
    async def events_after(self, session_id: str, event_id: str) -> tuple[str, list[tuple[str, str | None]]] | None:
        """The stream of `event_id` and that stream's events since, oldest first, as (id, message).

        None when this session's log holds no such event: unknown, expired,
        trimmed, malformed or another session's. Reads this session's log only.
        """

    @abstractmethod
    async def stream_since(
        self, session_id: str, stream_id: str, event_id: str
    ) -> tuple[str, list[tuple[str, str | None]]] | None:
        """For a replay following `stream_id`: the id of the log's latest event (the `event_id` to pass
        next) and that stream's events after `event_id`, which may be an event of any stream of the
        session, oldest first, as (id, message).

        Costs what was added after `event_id`, not the log. None as for `events_after`: the log no
        longer holds `event_id`.
        """

    # -- claims ---------------------------------------------------------------------------

    @abstractmethod
    async def claim(
        self, name: str, claimant: str, ttl_seconds: int, *, holder: str | None = None, charge: int = 0
    ) -> bool:
        """Atomically take `name` for `claimant` for `ttl_seconds`, unless another claimant has it.

        True when `claimant` holds it now (it was free, or already theirs: a retry of the
        same claimant is not refused, and renews it for `ttl_seconds`); False when another
        claimant does. Names are data. The claim is charged to `holder` (the first one
        given), `claimant` being what it keeps, and `charge` more bytes (what the caller keeps
        elsewhere for as long as the claim lasts, such as a task's data): refused (`LimitExceeded`)
        past its quota. A renewal is charged its own `charge`, so it may lower it too.
        """

    @abstractmethod
    async def release(self, name: str) -> None:
        """Drop the claim of `name`, whoever holds it, and free what it was charged."""

    @abstractmethod
    async def claimed(self, name: str) -> str | None:
        """Who holds `name` now (`claim`); None when nobody does."""

    # -- changes, for subscriptions -------------------------------------------------------

    @abstractmethod
    async def publish(self, message: str) -> None:
        """Send `message` to every replica watching the store (`watch`), this one included."""

    @abstractmethod
    def watch(self, *, events: bool = False) -> AbstractAsyncContextManager[AsyncIterator[str]]:
        """Once entered, the messages from every replica, in order: each `publish`ed message, and the
        id of each session whose state a write (or copy) changed, as the write commits. With
        `events`, instead, "<session id> <stream id>" for each event added (`add_event`), as it is.

        Entering returns only once watching has begun, so nothing sent after it is missed. The
        iterator raises StoreUnavailable when the store's connection is lost: what was sent
        meanwhile is gone, and whoever relies on it should start again and read afresh. A store
        that may miss some messages while going on (Redis Cluster, while a slot moves) yields
        RESYNC once it hears them again: whoever follows particular sessions should read afresh.
        """

    async def ping(self) -> bool:
        """Whether the store answers now. Never raises."""
        return True

    async def memory(self) -> tuple[int, int] | None:
        """(bytes used, the most it may use, 0 for no bound), for memory pressure; None when not known."""
        return None

    async def aclose(self) -> None:  # noqa: B027  optional hook: a store holding no connections keeps this no-op
        """Release connections."""


@dataclass(frozen=True)
class Resume:
    """Where an earlier run of the call being served got to (`Session.resume`).

    `rerun`: another run of this call (same idempotency key) began before this one: its replica died,
    HAProxy or the client sent the call again, or a task was redelivered. `checkpoint`: the value of its
    latest `Session.checkpoint`, None when it recorded none.
    """

    rerun: bool
    checkpoint: Any = None


class Session:
    """One session's view of the store: what a tool author works with.

    Made by the layer (`HighAvailability.session`), never by hand: `epoch` is
    this replica's ownership epoch of the session (None where there is no
    owner to fence, as for sessionless handles); `call` is the call being
    served, as (idempotency key, digest), so each write of a retried call is
    applied only once; `owner` is the caller's principal (None when
    unauthenticated), which `copy_from` checks. All three are required, so a
    Session made without them fails at once instead of silently losing a guarantee.

    A retry runs the tool again, so its writes are matched to the first run's
    by what they do: the n-th write of an operation to a key. A tool whose
    writes depend on what it read puts them in `apply_once`, which needs no
    such reasoning.
    """

    def __init__(
        self,
        store: SessionStore,
        session_id: str,
        *,
        epoch: int | None,
        call: tuple[str, str] | None,
        owner: str | None,
    ) -> None:
        self.store = store
        self.id = session_id
        self.epoch = epoch
        self.owner = owner
        self._call = call
        self._writes: dict[tuple[str, str], int] = {}
        self._checkpoints = 0
        self._resumed: Resume | None = None

    def _op(self, operation: str, key: str) -> Op | None:
        if self._call is None:
            return None
        # Named by what the write does, not only its place in the call: a
        # retry that skips a write (say, after a read that now differs)
        # still finds the records of the writes it does make.
        n = self._writes[operation, key] = self._writes.get((operation, key), 0) + 1
        call_key, digest = self._call
        return Op(call_key, digest, f"{operation}:{key}:{n}")

    def _safe(self, operation: str, key: str) -> dict[str, Any]:
        return {"epoch": self.epoch, "op": self._op(operation, key)}

    async def get(self, key: str, default: Any = None) -> Any:
        value = await self.store.get(self.id, key)
        return default if value is None else value

    async def set(self, key: str, value: Any) -> None:
        await self.store.set(self.id, key, value, **self._safe("set", key))

    async def incr(self, key: str, by: int = 1) -> int:
        return await self.store.incr(self.id, key, by, **self._safe("incr", key))

    async def append(self, key: str, value: Any, *, max_items: int | None = None) -> int:
        return await self.store.append(self.id, key, value, max_items=max_items, **self._safe("append", key))

    async def delete(self, key: str) -> bool:
        return await self.store.delete(self.id, key, **self._safe("delete", key))

    async def items(self) -> dict[str, Any]:
        return await self.store.items(self.id)

    async def copy_from(self, other_id: str) -> int:
        """Copy another session's state over this one's; how many entries.

        Only from a session of the same principal: an id this kit could not
        have minted, or another principal's session, copies nothing (0), as
        one with no state does.
        """
        if other_id == self.id or not is_session_id(other_id) or await self.store.owner(other_id) != self.owner:
            return 0
        return await self.store.copy(other_id, self.id, **self._safe("copy", other_id))

    async def touch(self) -> None:
        await self.store.touch(self.id)

    async def resume(self) -> Resume:
        """Whether this call ran before, and where it got to: call it once, before the work.

        A re-run repeats the tool from its start, and its writes replay the first run's in order
        (each write is matched by what it does: the n-th write of an operation to a key). A tool that
        skips to its latest checkpoint skips writes too, so this restores, with the checkpoint, the
        count of every write made up to it: the writes after it are matched to the first run's, and
        apply once. Without an idempotency key (no HAProxy in front, none in `_meta`) nothing ties two
        runs together: `Resume(rerun=False)`.
        """
        if self._resumed is not None:
            return self._resumed
        if self._call is None:
            self._resumed = Resume(rerun=False)
            return self._resumed
        # The first run's mark is recorded once; any later run gets the first one's back.
        mark = secrets.token_hex(8)
        first = await self.store.apply(self.id, [], expect={}, result=mark, epoch=self.epoch, op=self._mark("run"))
        if first == mark:
            self._resumed = Resume(rerun=False)
            return self._resumed
        latest, recorded = await self._latest_checkpoint()
        if latest:
            self._checkpoints = latest
            for operation, key, count in recorded["writes"]:
                if count > self._writes.get((operation, key), 0):
                    self._writes[operation, key] = count
        self._resumed = Resume(rerun=True, checkpoint=recorded["value"] if latest else None)
        return self._resumed

    async def checkpoint(self, value: Any) -> None:
        """Record how far this call got (`value`: JSON, small): a re-run's `resume` returns it.

        Each checkpoint is kept with the call's write records, as long as they are (OP_TTL_SECONDS
        after the call's latest write), and charged to the session's client. No-op without an
        idempotency key (see `resume`).
        """
        if self._call is None:
            return
        self._checkpoints += 1
        writes = [[operation, key, count] for (operation, key), count in self._writes.items()]
        record = {"value": value, "writes": writes}
        op = self._mark(f"checkpoint:{self._checkpoints}")
        await self.store.apply(self.id, [], expect={}, result=record, epoch=self.epoch, op=op)

    def _mark(self, name: str) -> Op:
        call_key, digest = self._call  # type: ignore[misc]  # only called with a call
        return Op(call_key, digest, f".{name}")

    async def _latest_checkpoint(self) -> tuple[int, Any]:
        """The number and record of the latest checkpoint an earlier run made ((0, None): none).

        Checkpoints are numbered 1, 2, 3... with no gap, so the latest is found in a few reads:
        doubling until one is missing, then halving the gap.
        """

        async def made(n: int) -> tuple[bool, Any]:
            return await self.store.recall(self.id, self._mark(f"checkpoint:{n}"))

        found, record = await made(1)
        if not found:
            return 0, None
        low, high = 1, 2
        while True:
            found, later = await made(high)
            if not found:
                break
            low, record, high = high, later, high * 2
        while high - low > 1:  # `low` was made, `high` was not
            middle = (low + high) // 2
            found, later = await made(middle)
            if found:
                low, record = middle, later
            else:
                high = middle
        return low, record

    async def apply_once(self, block: Callable[[Transaction], Awaitable[T]], *, attempts: int = 5, name: str = "") -> T:
        """Run `block`, then commit the writes it staged and its return value as one; once per call.

        `block` reads through `tx.get` and stages writes with `tx.set`,
        `tx.incr`, `tx.append` and `tx.delete`; it returns what the tool
        answers (JSON: a retry gets it back through JSON). The writes commit
        all together, only if nothing `block` read has changed meanwhile
        (else `block` runs again, up to `attempts` times, then `Conflict`).
        A retry of a call whose block already committed does not run the
        block at all: it answers with the recorded return value. `name`
        tells apart blocks one call commits to one session through
        different `Session` objects (the layer's own, beside the tool's).
        """
        op = self._op("apply", name)
        if op is not None:
            applied, recorded = await self.store.recall(self.id, op)
            if applied:
                self.store.replayed(op)
                return cast(T, recorded)  # what `block` returned when it committed
        for _ in range(attempts):
            tx = Transaction(self)
            value = await block(tx)
            try:
                # The store answers `value` itself, or the value a committed block recorded.
                return cast(
                    T,
                    await self.store.apply(self.id, tx.writes, expect=tx.reads, result=value, epoch=self.epoch, op=op),
                )
            except Conflict:
                continue
        raise Conflict(f"the session kept changing under an apply_once block ({attempts} attempts)")


class Transaction:
    """The reads and staged writes of one `Session.apply_once` block."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self.reads: dict[str, Any] = {}
        self.writes: list[Write] = []

    async def get(self, key: str, default: Any = None) -> Any:
        """The entry's value now; the commit checks it is still that."""
        value = await self._session.store.get(self._session.id, check_key(key))
        # A copy: the block may change what it was given, and the commit checks what was read.
        self.reads.setdefault(key, copy.deepcopy(value))
        return default if value is None else value

    def set(self, key: str, value: Any) -> None:
        self.writes.append(("set", check_key(key), value))

    def incr(self, key: str, by: int = 1) -> None:
        self.writes.append(("incr", check_key(key), by))

    def append(self, key: str, value: Any) -> None:
        self.writes.append(("append", check_key(key), value))

    def delete(self, key: str) -> None:
        self.writes.append(("delete", check_key(key), None))
