"""An in-process SessionStore: for a quick single-process start and the contract tests.

State dies with the process, so it gives none of the kit's availability; the
server uses it only when REDIS_URL is unset. Every method finishes without
awaiting, which is what makes each one atomic under asyncio.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import heapq
import itertools
import json
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, Unpack, cast

from ..session_store import (
    EVENT_BYTES,
    OWNER,
    Conflict,
    Fenced,
    LimitExceeded,
    Op,
    OpReused,
    SessionStore,
    StoreLimits,
    StoreUnavailable,
    Write,
    check_key,
    entry_bytes,
    event_position,
    key_bytes,
    mint_event_id,
    op_fields,
    op_span,
    over_quota,
    payer_of,
)

# A watcher this far behind has lost messages, and is told so like one whose connection broke.
MAX_UNREAD = 1024

# What a write's `apply` returns, and so what the write answers.
R = TypeVar("R")


class _Watcher:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[str] = asyncio.Queue(MAX_UNREAD)
        self.behind = False

    def put(self, message: str) -> None:
        try:
            self.queue.put_nowait(message)
        except asyncio.QueueFull:
            self.behind = True

    async def messages(self) -> AsyncIterator[str]:
        while not self.behind:
            yield await self.queue.get()
        raise StoreUnavailable(f"a watcher fell {MAX_UNREAD} messages behind")


@dataclass
class _EventLog:
    """One session's events as (number, stream, message), numbered without gaps."""

    entries: deque[tuple[int, str, str | None]]
    numbers: itertools.count[int]
    added_at: float = 0.0
    size: int = 0


def _entry_bytes(stream_id: str, message: str | None) -> int:
    return len(stream_id.encode()) + len((message or "").encode())


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _state_bytes(data: Mapping[str, Any]) -> int:
    """What the Redis store counts: the bytes of each entry's compact JSON text."""
    return sum(len(_json(value).encode()) for value in data.values())


# What the quotas charge (session_store's module docstring), each key named as the Redis store names
# it (prefix `mcp`), so that both stores charge alike.
def _session_key(session_id: str) -> str:
    return f"mcp:session:{session_id}"


def _ops_key(session_id: str, n: int) -> str:
    return f"mcp:ops:{session_id}:{n}"


def _events_key(session_id: str) -> str:
    return f"mcp:events:{session_id}"


def _claim_key(name: str) -> str:
    return f"mcp:claim:{hashlib.sha256(name.encode()).hexdigest()}"


def _state_charge(session_id: str, data: Mapping[str, Any]) -> int:
    return key_bytes(_session_key(session_id)) + sum(entry_bytes(name, _json(v)) for name, v in data.items())


def _payer_entry(payer: str, owner: Any) -> dict[str, str]:
    """The '..h' entry the Redis store keeps: none when the payer is the session's owner (session_store.payer_of)."""
    return {} if payer_of(payer) == owner else {"..h": payer_of(payer)}


def _record_charge(session_id: str, payer: str, record: Mapping[str, Any]) -> int:
    entries = {".epoch": "1", **_payer_entry(payer, record.get(OWNER))} | {
        f".{name}": _json(v) for name, v in record.items()
    }
    return key_bytes(_session_key(session_id)) + sum(entry_bytes(name, text) for name, text in entries.items())


class InMemorySessionStore(SessionStore):
    def __init__(self, *, clock: Callable[[], float] = time.monotonic, **limits: Unpack[StoreLimits]) -> None:
        """`limits`: SessionStore's TTLs, max_events and on_replay."""
        super().__init__(**limits)
        self._clock = clock
        # Ordered by last touch, oldest first, so expiry pops from the front
        # and counting costs the number of sessions that expired, not all of them.
        self._sessions: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._seen: dict[str, float] = {}
        self._records: dict[str, tuple[dict[str, Any], int]] = {}
        # Outlives the record (end_session), not the state.
        self._owners: dict[str, str] = {}
        # Who opened each recorded session, and what each holder has open (max_sessions_per_holder).
        self._holders: dict[str, str] = {}
        self._held: dict[str, set[str]] = {}
        # Per (session, call): (digest, {write: result}, expiry), kept in expiry
        # order (one TTL for all), so expiry pops from the front too.
        self._ops: OrderedDict[tuple[str, str], tuple[str, dict[str, Any], float]] = OrderedDict()
        # What the Redis store's op buckets would hold, for their charges: per (session, span), the calls
        # whose digest it holds, and its expiry; in expiry order.
        self._op_buckets: OrderedDict[tuple[str, int], tuple[set[str], float]] = OrderedDict()
        # Ordered by latest add, oldest first: expiry pops from the front.
        self._events: OrderedDict[str, _EventLog] = OrderedDict()
        self._watchers: set[_Watcher] = set()
        self._event_watchers: set[_Watcher] = set()
        # name: (claimant, expiry, the holder it is charged to), and their expiries as (when, name), in a
        # heap that `_expire` pops (an entry a renewal outdated is skipped then).
        self._claims: dict[str, tuple[str, float, str | None]] = {}
        self._claim_expiries: list[tuple[float, str]] = []
        # Quotas: whom each session is charged to (its first holder, kept while its state lives),
        # each charged key's holder and bytes (named like the Redis store's usage members), and
        # each holder's total. A charge goes when what it counts does.
        self._payers: dict[str, str] = {}
        self._charges: dict[str, tuple[str, int]] = {}
        self._usage: dict[str, int] = {}

    def _expire(self) -> None:
        horizon = self._clock() - self.ttl_seconds
        while self._sessions:
            oldest = next(iter(self._sessions))
            if self._seen[oldest] > horizon:
                break
            del self._sessions[oldest]
            del self._seen[oldest]
            self._records.pop(oldest, None)
            self._owners.pop(oldest, None)
            self._release(oldest)
            self._payers.pop(oldest, None)
            self._uncharge(f"s{_session_key(oldest)}")
            self._uncharge(f"r{_session_key(oldest)}")
        events_horizon = self._clock() - self.event_ttl_seconds
        while self._events and next(iter(self._events.values())).added_at <= events_horizon:
            session_id, _ = self._events.popitem(last=False)
            self._uncharge(f"e{_events_key(session_id)}")
        now = self._clock()
        while self._ops and next(iter(self._ops.values()))[2] <= now:
            self._ops.popitem(last=False)
        while self._op_buckets and next(iter(self._op_buckets.values()))[1] <= now:
            (session_id, n), _ = self._op_buckets.popitem(last=False)
            self._uncharge(f"o{_ops_key(session_id, n)}")
        while self._claim_expiries and self._claim_expiries[0][0] <= now:
            _, name = heapq.heappop(self._claim_expiries)
            held = self._claims.get(name)
            if held is not None and held[1] <= now:
                del self._claims[name]
                self._uncharge(f"c{_claim_key(name)}")

    def _check(self, holder: str, charges: Mapping[str, int]) -> None:
        """Refused (LimitExceeded) when charging `holder` these keys' new bytes takes it past its quota."""
        delta = sum(bytes_ - self._charges.get(member, ("", 0))[1] for member, bytes_ in charges.items())
        total = self._usage.get(holder, 0) + delta
        if delta > 0 and total > self.max_bytes_per_holder:
            raise LimitExceeded(over_quota(total, self.max_bytes_per_holder))

    def _charge(self, holder: str, charges: Mapping[str, int]) -> None:
        for member, bytes_ in charges.items():
            self._uncharge(member)
            self._charges[member] = (holder, bytes_)
            self._usage[holder] = self._usage.get(holder, 0) + bytes_

    def _uncharge(self, member: str) -> None:
        found = self._charges.pop(member, None)
        if found is not None:
            holder, bytes_ = found
            self._usage[holder] -= bytes_
            if not self._usage[holder]:
                del self._usage[holder]

    def _live(self, session_id: str) -> dict[str, Any]:
        self._expire()
        data = self._sessions.setdefault(session_id, {})
        self._sessions.move_to_end(session_id)
        self._seen[session_id] = self._clock()
        return data

    def _recorded(self, session_id: str, op: Op) -> tuple[bool, Any]:
        done = self._ops.get((session_id, op.call))
        if done is None:
            return False, None
        if done[0] != op.digest:
            raise OpReused(op.call)
        if op.write not in done[1]:
            return False, None
        return True, copy.deepcopy(done[1][op.write])

    def _write(self, session_id: str, epoch: int | None, op: Op | None, apply: Callable[[dict[str, Any]], R]) -> R:
        """The one path every write takes: replay, fence, apply, record."""
        self._expire()
        if op is not None:
            applied, recorded = self._recorded(session_id, op)
            if applied:
                self.replayed(op)
                return cast(R, recorded)  # what `apply` returned when this op was first written
        if epoch is not None:
            record = self._records.get(session_id)
            if record is None or record[1] != epoch:
                raise Fenced(session_id)
        data = self._live(session_id)
        work = copy.deepcopy(data)  # all or none: applied to a copy, swapped in once within the bounds
        result = apply(work)
        after = _state_bytes(work)
        # Past the bound, a write may still shrink the state (or leave it as large as it was).
        if after > self.max_state_bytes and after > _state_bytes(data):
            raise LimitExceeded(
                f"this session's state would take {after} bytes; the store keeps at most {self.max_state_bytes}"
            )
        holder, charges = self._payers.get(session_id), {}
        if op is not None:
            span = op_span(self.op_ttl_seconds)
            n = int(self._clock() // span)  # the op bucket this write's record goes to
            bucket = self._op_buckets.get((session_id, n)) or (set(), (n + 1) * span + self.op_ttl_seconds)
        if holder is not None:
            charges[f"s{_session_key(session_id)}"] = _state_charge(session_id, work)
            if op is not None:
                # The Redis store charges its op bucket by the fields each write adds.
                member, (digest_field, result_field) = f"o{_ops_key(session_id, n)}", op_fields(op)
                grown = self._charges.get(member, ("", key_bytes(_ops_key(session_id, n))))[1]
                grown += entry_bytes(result_field, _json(result))
                if op.call not in bucket[0]:
                    grown += entry_bytes(digest_field, op.digest)
                charges[member] = grown
            self._check(holder, charges)
        data.clear()
        data.update(work)
        self._send(session_id)
        if op is not None:
            # Re-inserted last: a call's records live as long as the bucket of its latest write.
            results = self._ops.pop((session_id, op.call), ("", {}, 0.0))[1]
            results[op.write] = copy.deepcopy(result)
            self._ops[(session_id, op.call)] = (op.digest, results, bucket[1])
            bucket[0].add(op.call)
            self._op_buckets[(session_id, n)] = bucket
        if holder is not None:
            self._charge(holder, charges)
        return result

    async def get(self, session_id: str, key: str) -> Any | None:
        return copy.deepcopy(self._live(session_id).get(check_key(key)))

    async def set(
        self, session_id: str, key: str, value: Any, *, epoch: int | None = None, op: Op | None = None
    ) -> None:
        value, key = copy.deepcopy(value), check_key(key)
        self._write(session_id, epoch, op, lambda data: data.__setitem__(key, value))

    async def incr(
        self, session_id: str, key: str, by: int = 1, *, epoch: int | None = None, op: Op | None = None
    ) -> int:
        check_key(key)

        def apply(data: dict[str, Any]) -> int:
            current = data.get(key, 0)
            if not isinstance(current, int):
                raise TypeError(f"{key!r} does not hold an integer")
            total = current + by
            data[key] = total
            return total

        return self._write(session_id, epoch, op, apply)

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
        value, key = copy.deepcopy(value), check_key(key)

        def apply(data: dict[str, Any]) -> int:
            current = data.setdefault(key, [])
            if not isinstance(current, list):
                raise TypeError(f"{key!r} does not hold a list")
            if max_items is not None and len(current) >= max_items:
                raise LimitExceeded(f"{key!r} holds {len(current)} items, the most it may")
            current.append(value)
            return len(current)

        return self._write(session_id, epoch, op, apply)

    async def delete(self, session_id: str, key: str, *, epoch: int | None = None, op: Op | None = None) -> bool:
        key = check_key(key)
        return self._write(session_id, epoch, op, lambda data: data.pop(key, None) is not None)

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
        staged = [(operation, check_key(key), copy.deepcopy(value)) for operation, key, value in writes]
        result = copy.deepcopy(result)

        def apply(data: dict[str, Any]) -> Any:
            if any(data.get(check_key(key)) != value for key, value in expect.items()):
                raise Conflict(session_id)
            # Straight onto `data`: it is _write's copy, dropped whole if a write here fails.
            for operation, key, value in staged:
                current = data.get(key)
                if operation == "set":
                    data[key] = value
                elif operation == "delete":
                    data.pop(key, None)
                elif operation == "incr":
                    if not (current is None or isinstance(current, int)):
                        raise TypeError(f"{key!r} does not hold an integer")
                    data[key] = (current or 0) + value
                elif operation == "append":
                    if not (current is None or isinstance(current, list)):
                        raise TypeError(f"{key!r} does not hold a list")
                    data[key] = [*(current or []), value]
                else:
                    raise ValueError(f"unknown write operation {operation!r}")
            return result

        return self._write(session_id, epoch, op, apply)

    async def recall(self, session_id: str, op: Op) -> tuple[bool, Any]:
        self._expire()
        return self._recorded(session_id, op)

    async def items(self, session_id: str) -> dict[str, Any]:
        return copy.deepcopy(self._live(session_id))

    async def copy(self, source_id: str, target_id: str, *, epoch: int | None = None, op: Op | None = None) -> int:
        self._expire()
        source = copy.deepcopy(self._sessions.get(source_id, {}))

        def apply(data: dict[str, Any]) -> int:
            data.update(source)
            return len(source)

        return self._write(target_id, epoch, op, apply)

    async def touch(self, session_id: str) -> None:
        self._live(session_id)

    async def count_sessions(self, *, holder: str | None = None) -> int:
        self._expire()
        return len(self._sessions) if holder is None else len(self._held.get(holder, ()))

    def _release(self, session_id: str) -> None:
        holder = self._holders.pop(session_id, None)
        if holder is not None:
            self._held[holder].discard(session_id)
            if not self._held[holder]:
                del self._held[holder]

    async def open_session(self, session_id: str, record: dict[str, Any], *, holder: str | None = None) -> int:
        self._expire()
        if session_id not in self._sessions and len(self._sessions) >= self.max_sessions:
            raise LimitExceeded(f"this server holds {self.max_sessions} sessions, the most it may")
        if holder is not None and len(self._held.get(holder, ())) >= self.max_sessions_per_holder:
            raise LimitExceeded(
                f"you hold {self.max_sessions_per_holder} open sessions, the most you may; end some first"
            )
        payer = self._payers.get(session_id, holder)
        charges = {}
        if payer is not None:
            charges[f"r{_session_key(session_id)}"] = _record_charge(session_id, payer, record)
            self._check(payer, charges)
        self._live(session_id)
        if payer is not None:
            self._payers[session_id] = payer
            self._charge(payer, charges)
        self._records[session_id] = (copy.deepcopy(record), 1)
        if holder is not None:
            self._release(session_id)
            self._holders[session_id] = holder
            self._held.setdefault(holder, set()).add(session_id)
        if record.get(OWNER) is not None:
            self._owners[session_id] = record[OWNER]
        return 1

    async def session_record(self, session_id: str) -> dict[str, Any] | None:
        self._expire()
        found = self._records.get(session_id)
        return None if found is None else copy.deepcopy(found[0])

    async def update_record(self, session_id: str, entries: dict[str, Any]) -> bool:
        self._expire()
        if session_id not in self._records:
            return False
        record, epoch = self._records[session_id]
        changed = {name: value for name, value in copy.deepcopy(entries).items() if name != OWNER}
        self._records[session_id] = ({**record, **changed}, epoch)
        return True

    async def adopt_session(self, session_id: str) -> tuple[dict[str, Any], int] | None:
        self._expire()
        if session_id not in self._records:
            return None
        record, epoch = self._records[session_id]
        self._live(session_id)
        self._records[session_id] = (record, epoch + 1)
        return copy.deepcopy(record), epoch + 1

    async def end_session(self, session_id: str, *, holder: str | None = None) -> bool:
        self._expire()
        if holder is not None and self._holders.get(session_id) == holder:
            self._release(session_id)
        if self._records.pop(session_id, None) is None:
            return False
        # Its event log and op records serve nobody now (as the Redis store drops them).
        if self._events.pop(session_id, None) is not None:
            self._uncharge(f"e{_events_key(session_id)}")
        for call in [call for owner_id, call in self._ops if owner_id == session_id]:
            del self._ops[(session_id, call)]
        for n in [n for owner_id, n in self._op_buckets if owner_id == session_id]:
            del self._op_buckets[(session_id, n)]
            self._uncharge(f"o{_ops_key(session_id, n)}")
        payer = self._payers.get(session_id)
        if payer is not None:
            # What is left of the record stays charged while the state lives (as the Redis store does).
            owner = self._owners.get(session_id)
            left = _payer_entry(payer, owner) | ({} if owner is None else {".owner": _json(owner)})
            key = _session_key(session_id)
            self._charge(payer, {f"r{key}": key_bytes(key) + sum(entry_bytes(n, t) for n, t in left.items())})
        return True

    async def owner(self, session_id: str) -> str | None:
        self._expire()
        return self._owners.get(session_id)

    async def claim(
        self, name: str, claimant: str, ttl_seconds: int, *, holder: str | None = None, charge: int = 0
    ) -> bool:
        self._expire()
        held = self._claims.get(name)
        if held is not None and held[0] != claimant:
            return False
        payer = holder if held is None else held[2]  # its claimant renews it, charged as it was
        charges = {f"c{_claim_key(name)}": key_bytes(_claim_key(name)) + len(claimant.encode()) + charge}
        if payer is not None:
            self._check(payer, charges)
        until = self._clock() + ttl_seconds
        self._claims[name] = (claimant, until, payer)
        heapq.heappush(self._claim_expiries, (until, name))
        if payer is not None:
            self._charge(payer, charges)
        return True

    async def release(self, name: str) -> None:
        self._claims.pop(name, None)
        self._uncharge(f"c{_claim_key(name)}")

    async def claimed(self, name: str) -> str | None:
        held = self._claims.get(name)
        return held[0] if held is not None and held[1] > self._clock() else None

    def _send(self, message: str, *, events: bool = False) -> None:
        for watcher in self._event_watchers if events else self._watchers:
            watcher.put(message)

    async def publish(self, message: str) -> None:
        self._send(message)

    @asynccontextmanager
    async def watch(self, *, events: bool = False) -> AsyncIterator[AsyncIterator[str]]:
        watcher = _Watcher()
        watchers = self._event_watchers if events else self._watchers
        watchers.add(watcher)
        try:
            yield watcher.messages()
        finally:
            watchers.discard(watcher)

    async def add_event(self, session_id: str, stream_id: str, message: str | None) -> str:
        self._expire()
        # What the log keeps once the event is in and the oldest are out, worked out first: the
        # session's payer is charged that, and a refused event changes nothing.
        found = self._events.get(session_id)
        kept = found.entries if found is not None else deque()
        size, length, dropped = (found.size if found else 0) + _entry_bytes(stream_id, message), len(kept) + 1, 0
        while length > 1 and (length > self.max_events or size > self.max_log_bytes):
            size -= _entry_bytes(*kept[dropped][1:])
            dropped, length = dropped + 1, length - 1
        holder, key = self._payers.get(session_id), _events_key(session_id)
        charges = {f"e{key}": key_bytes(key) + key_bytes(f"{key}:bytes") + size + length * EVENT_BYTES}
        if holder is not None:
            self._check(holder, charges)
        # A new log numbers on from the clock, so an id from an expired log
        # never names one of its events (the Redis store does the same).
        log = self._events.pop(session_id, None) or _EventLog(
            deque(), numbers=itertools.count(int(self._clock() * 1_000_000))
        )
        self._events[session_id] = log  # re-inserted last: the latest add
        log.added_at = self._clock()
        number = next(log.numbers)
        for _ in range(dropped):
            log.entries.popleft()
        log.entries.append((number, stream_id, message))
        log.size = size
        if holder is not None:
            self._charge(holder, charges)
        self._send(f"{session_id} {stream_id}", events=True)
        return mint_event_id(session_id, f"{number}-0")

    def _logged(self, session_id: str, event_id: str) -> tuple[_EventLog, int] | None:
        """The session's log and the number of the event `event_id` names in it; None for no such log or id."""
        self._expire()
        position = event_position(session_id, event_id)
        log = self._events.get(session_id)
        if position is None or log is None:
            return None
        number, _, sequence = position.partition("-")
        return None if int(sequence) != 0 else (log, int(number))

    async def events_after(self, session_id: str, event_id: str) -> tuple[str, list[tuple[str, str | None]]] | None:
        found = self._logged(session_id, event_id)
        if found is None:
            return None
        log, number = found
        index = number - log.entries[0][0]
        if not 0 <= index < len(log.entries):
            return None
        stream_id = log.entries[index][1]
        later = itertools.islice(log.entries, index + 1, None)
        return stream_id, [(mint_event_id(session_id, f"{n}-0"), m) for n, s, m in later if s == stream_id]

    async def stream_since(
        self, session_id: str, stream_id: str, event_id: str
    ) -> tuple[str, list[tuple[str, str | None]]] | None:
        found = self._logged(session_id, event_id)
        if found is None:
            return None
        log, number = found
        # From the end back to the event: what was added since, not the log.
        later = list(itertools.takewhile(lambda entry: entry[0] > number, reversed(log.entries)))
        if len(later) == len(log.entries) or log.entries[-1 - len(later)][0] != int(number):
            return None  # trimmed, or never there
        latest = later[0][0] if later else int(number)
        events = [(mint_event_id(session_id, f"{n}-0"), m) for n, s, m in reversed(later) if s == stream_id]
        return mint_event_id(session_id, f"{latest}-0"), events
