"""Load through clients, bounded in count and time, and what each session saw: shared by the HA check's
checks and the failover benchmark.

Sessions open and read once (`open_and_read`). A session's load is `drive`: the shape's write in a loop,
each call recorded (start, end, outcome, replica), until told to stop or MAX_CALLS_PER_SESSION;
`load_with_fault` drives every session through one fault. `read_final` reads the session's count at the
end (not a measured call: a few tries, then a raw client under the session id or handle).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx2

from .clients import GUARD_SLACK_SECONDS, PLAIN_CALL_TIMEOUT, Answer, CheckClient
from .shape import Call, Shape
from .wire import RawSession, SessionlessSession

log = logging.getLogger(__name__)

THINK_SECONDS = (0.02, 0.05)
MAX_CALLS_PER_SESSION = 5000
FINAL_READ_PAUSE_SECONDS = 0.3
OPEN_TIMEOUT_SECONDS = 30.0
# However soon a fault is over, the load goes on this long after it: every session is seen answered again.
TAIL_SECONDS = 1.5


@dataclass
class CallRecord:
    start: float
    end: float
    ok: bool
    replica: str | None = None
    error: str | None = None
    overran: bool = False  # neither returned nor raised within its bound


@dataclass
class SessionRun:
    """One session's calls, and its count read at the end."""

    kind: str
    calls: list[CallRecord] = field(default_factory=list)
    in_flight: bool = False
    final: int | None = None
    final_error: str | None = None
    # The client could not read its own session's final count; a raw client read it under its id or handle.
    final_read_raw: bool = False
    new_sessions: int = 0
    # The structured result of the session's last write, for a Call whose arguments depend on it.
    previous: dict[str, Any] | None = None

    @property
    def acknowledged(self) -> int:
        return sum(c.ok for c in self.calls)

    @property
    def failed(self) -> int:
        return sum(not c.ok for c in self.calls)

    def replica_at(self, t: float) -> str | None:
        """The replica that answered this session's last successful call that ended before `t`."""
        answered = [c for c in self.calls if c.ok and c.end <= t]
        return answered[-1].replica if answered else None


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:200]


async def timed_call(
    run: SessionRun, client: CheckClient, shape: Shape, *, bound: float | None = None
) -> Answer | None:
    """One write of `shape` on `client`, recorded in `run`; its answer, or None when it failed."""
    limit = (client.bound if bound is None else bound) + GUARD_SLACK_SECONDS
    record = CallRecord(start=time.monotonic(), end=0.0, ok=False)
    run.in_flight = True
    guard = asyncio.timeout(limit)
    answer: Answer | None = None
    try:
        async with guard:
            answer = await client.call(shape.write, shape.write.arguments_after(run.previous))
        record.ok, record.replica = True, answer.replica
        run.previous = dict(answer)
    except Exception as exc:
        record.overran = guard.expired()
        record.error = f"TimeoutError: no outcome within {limit:g} s" if record.overran else error_text(exc)
    record.end = time.monotonic()
    run.in_flight = False
    run.calls.append(record)
    return answer


async def recorded_call(
    run: SessionRun, client: CheckClient, call: Call, *, bound: float, progress: bool = False
) -> CallRecord:
    """One `call` on `client`, bounded by `bound` (cut off GUARD_SLACK_SECONDS later), its record in `run`
    from its start: a long call (streamed, a task) that a fault is meant to catch."""
    record = CallRecord(start=time.monotonic(), end=0.0, ok=False)
    run.calls.append(record)
    try:
        async with asyncio.timeout(bound + GUARD_SLACK_SECONDS):
            answer = await client.call(call, bound=bound, progress=progress)
        record.ok, record.replica = True, answer.replica
    except Exception as exc:
        record.error = error_text(exc)
    record.end = time.monotonic()
    return record


async def open_and_read(clients: Sequence[CheckClient], shape: Shape) -> None:
    """Open every client's session and read its state once, within OPEN_TIMEOUT_SECONDS: a replica's first
    call pays for lazy set-up, a cost of starting that stays out of the figures."""
    async with asyncio.timeout(OPEN_TIMEOUT_SECONDS):
        await asyncio.gather(*(c.open() for c in clients))
        await asyncio.gather(*(c.call(shape.read) for c in clients))


async def drive(run: SessionRun, client: CheckClient, shape: Shape, stop: asyncio.Event) -> None:
    """The shape's write in a loop, a short think time between calls, until `stop` or MAX_CALLS_PER_SESSION."""
    while not stop.is_set() and len(run.calls) < MAX_CALLS_PER_SESSION:
        await timed_call(run, client, shape)
        try:
            await asyncio.wait_for(stop.wait(), random.uniform(*THINK_SECONDS))
        except TimeoutError:
            pass


@dataclass(frozen=True)
class LoadSpan:
    """When a load through a fault began, the fault struck and was over, and the load ended (monotonic)."""

    start: float
    struck: float
    over: float
    end: float


async def load_with_fault(
    pairs: Sequence[tuple[CheckClient, SessionRun]],
    shape: Shape,
    fault: Callable[[], Awaitable[float | None]],
    *,
    fault_at: float,
    duration: float,
    say: Callable[[str], None] = lambda _phase: None,
) -> LoadSpan:
    """Every session of `pairs` writes in a loop; `fault` runs `fault_at` seconds in, and the load goes on
    until `duration` (TAIL_SECONDS past the fault at least), then its last calls get their bound to end.
    `fault` returns when it struck (monotonic: its command had sent the signal), or None for when it was called.
    A fault that raises stops the load at once. `say` hears each phase, for a display."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(drive(r, c, shape, stop)) for c, r in pairs]
    try:
        start = time.monotonic()
        say("steady load")
        await asyncio.sleep(fault_at)
        called = time.monotonic()
        struck = await fault() or called
        over = time.monotonic()
        say("load after recovery")
        await asyncio.sleep(max(start + duration - over, TAIL_SECONDS))
        stop.set()
        say("waiting for the last calls")
        longest = max((c.bound for c, _ in pairs), default=PLAIN_CALL_TIMEOUT)
        if tasks:  # none when no client could open a session: each kind's failure says so
            await asyncio.wait(tasks, timeout=longest + GUARD_SLACK_SECONDS + 1)
        end = time.monotonic()
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return LoadSpan(start, struck, over, end)


async def read_raw(url: str, shape: Shape, *, session_id: str | None = None, handle: str | None = None) -> int:
    """The count of a session read by the kit's raw client, under its session id or its handle."""
    async with httpx2.AsyncClient(timeout=PLAIN_CALL_TIMEOUT) as http:
        if session_id is not None:
            session = RawSession(http, url, timeout=PLAIN_CALL_TIMEOUT, client_name="mcp-ha-check-final-read")
            session.session_id = session_id
            arguments = shape.read.arguments_after(None)
        else:
            session = SessionlessSession(http, url, timeout=PLAIN_CALL_TIMEOUT, client_name="mcp-ha-check-final-read")
            arguments = {**shape.read.arguments_after(None), "session_id": handle}
        return shape.count_of(await session.call_tool(shape.read.tool, arguments))


async def read_final(client: CheckClient, run: SessionRun, url: str, shape: Shape) -> None:
    """`run.final`: the session's count as its own client reads it, or else as a raw client does."""
    for attempt in range(client.final_read_attempts):
        try:
            if attempt:
                await asyncio.sleep(FINAL_READ_PAUSE_SECONDS)
                await client.reconnect()
            async with asyncio.timeout(client.bound + GUARD_SLACK_SECONDS):
                run.final = shape.count_of(await client.call(shape.read, shape.read.arguments_after(run.previous)))
            break
        except Exception as exc:
            run.final_error = error_text(exc)
    else:
        handle = getattr(client, "handle", None)
        if client.session_id is not None or handle is not None:
            log.warning(
                "a %s session could not read its own final count (%s); reading it raw", client.kind, run.final_error
            )
            for attempt in range(3):
                try:
                    if attempt:
                        await asyncio.sleep(FINAL_READ_PAUSE_SECONDS)
                    run.final = await read_raw(url, shape, session_id=client.session_id, handle=handle)
                    run.final_read_raw = True
                    break
                except Exception as exc:
                    run.final_error = error_text(exc)
    run.new_sessions = client.new_sessions


async def close_all(closers: list[Callable[[], Awaitable[Any]]]) -> None:
    """Run every closer, each bounded; a failure to close is housekeeping, not a figure."""

    async def close(closer: Callable[[], Awaitable[Any]]) -> None:
        try:
            async with asyncio.timeout(5):
                await closer()
        except Exception as exc:
            log.debug("closing a session failed: %r", exc)

    await asyncio.gather(*(close(c) for c in closers))


@dataclass
class Figures:
    """What one kind of client saw in one check: calls, the longest one, and effects lost or doubled."""

    kind: str
    sessions: int
    calls: int
    failed: int
    overran: int
    longest_call_s: float
    acknowledged: int
    final: int | None  # summed over sessions; None when a session's count could not be read
    lost: int
    doubled: int
    unreadable: int
    errors: list[str]


def figures(kind: str, runs: list[SessionRun], *, retries: bool) -> Figures:
    """Per session: fewer effects than acknowledged writes is a loss; more than acknowledged writes plus
    (for a client that does not retry, so cannot know) one per failed write is a double."""
    calls = [c for r in runs for c in r.calls]
    lost = doubled = unreadable = final = 0
    for r in runs:
        if r.final is None:
            unreadable += 1
            continue
        final += r.final
        lost += max(r.acknowledged - r.final, 0)
        doubled += max(r.final - (r.acknowledged + (0 if retries else r.failed)), 0)
    errors: dict[str, int] = {}
    for c in calls:
        if c.error:
            errors[c.error] = errors.get(c.error, 0) + 1
    return Figures(
        kind=kind,
        sessions=len(runs),
        calls=len(calls),
        failed=sum(not c.ok for c in calls),
        overran=sum(c.overran for c in calls),
        longest_call_s=round(max((c.end - c.start for c in calls), default=0.0), 3),
        acknowledged=sum(r.acknowledged for r in runs),
        final=None if unreadable else final,
        lost=lost,
        doubled=doubled,
        unreadable=unreadable,
        errors=[f"{n}× {e}" for e, n in sorted(errors.items(), key=lambda item: -item[1])[:5]],
    )
