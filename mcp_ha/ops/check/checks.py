"""The checks, in two suites named as in the reference kit's tests: `lb` (test_lb.py) and `resilience`
(test_resilience.py). Each returns one CheckResult per kind of client it drives.

lb
    health                 GET /health through the balancer answers 200
    sticky                 a session's calls all answered by one replica (session-era kinds), no call
                           failed, its count exactly the writes acknowledged
    spread                 new sessions land on more than one replica
    replica gone           with the busiest replica killed, its sessions and new ones are answered by
                           the others, none failing (then it is restarted)
resilience
    kill -9 between calls  the replica serving most sessions killed while they are idle: no call after
    pause between calls    it fails, each count exact (a pause: a hung replica, then resumed)
    kill -9 under load     the same while every session calls in a loop: calls the fault caught may
    pause under load       fail (for a client that does not retry) only within a short window after
                           it; none lost or doubled; every session answered again afterwards
    drain under load       SIGTERM then start under load: no call fails
    balancer killed        one of the balancers in front (the URL served by another too) killed
      under load           under load, then started again: every session-era session answered by its
                           replica as before, none lost or doubled; a client that retries fails no
                           call, one that does not fails at most its call in flight (a client whose
                           transport never works again after a dropped connection is noted, not failed)
    retry applies once     the `once` call sent twice with one idempotency key leaves the state one
                           application leaves (a session's control, with no fault)
    retry after kill       the same, its replica killed just after the first send
    streamed call          the `streamed` call, its replica killed mid-stream, completes for the kinds
                           that resume a stream themselves, its effects as with no fault
    sessionless handle     a sessionless client's handle keeps its state across replicas and a kill
    task killed mid-run    the `streamed` call run as a background task (its tool marked task=True),
                           the replica running it (as tasks/get names it) killed mid-run: the client's
                           call completes, its effects as with no fault (kinds that run tasks)

"Effects lost or doubled" compares each session's final `count` with the writes it was told
succeeded; a client that does not retry may have had a failed write applied (once at most).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx2

from mcp_ha.idempotency import IDEMPOTENCY_KEY

from .clients import (
    GUARD_SLACK_SECONDS,
    PLAIN_CALL_TIMEOUT,
    REPLICA_HEADER,
    RUNNER_META,
    CheckClient,
    ClientFactory,
    TasksClient,
    TaskSeen,
    ToolAnsweredError,
)
from .faults import FaultError, Faults
from .load import (
    OPEN_TIMEOUT_SECONDS,
    CallRecord,
    Figures,
    SessionRun,
    close_all,
    error_text,
    figures,
    load_with_fault,
    open_and_read,
    read_final,
    recorded_call,
    timed_call,
)
from .options import LB, RESILIENCE
from .report import FAIL, PASS, SKIP, CheckResult
from .shape import Call, Shape, ShapeError
from .wire import CallFailed, RawSession, SessionlessSession, final_message, tool_result

log = logging.getLogger(__name__)

SETTLE_SECONDS = 60.0
SETTLE_POLL_SECONDS = 0.5
FAULT_AT_SECONDS = 1.5
KILL_DOWN_SECONDS = 2.0
PAUSE_SECONDS = 4.0
# After a fault strikes (from the moment its command has sent the signal), a client that does not retry may
# see the calls caught in flight fail until the balancer knows: a dead replica refuses at once, a hung one is
# taken out by its health checks (about 2.6 s with the kit's haproxy.cfg). Nothing after that may fail: not
# when the hung one comes back (what it held waited through the pause, and takes no session over), nor a
# call that meets a fence (its replica takes the session back and runs it once). A call started later than
# this must not fail.
DETECT_WINDOW = {"kill": 3.0, "pause": 3.0, "drain": 0.0}
WRITES_BETWEEN_CALLS = 3
STREAMED_BOUND_SECONDS = 60.0
STREAM_KILL_AFTER_SECONDS = 1.0
# A task is taken over once the lease of the replica that died lapses (TASK_REDELIVERY_SECONDS), then run again.
TASK_BOUND_SECONDS = 90.0
RUNNER_NAMED_WITHIN_SECONDS = 15.0
RETRY_SECONDS = 15.0
# Opening sessions until one of each kind is on the replica to kill: at most this many tries per kind. Behind
# two HAProxys, each with its own round robin, a new session lands on a given replica of three about one time
# in three, at random: 8 tries missed it 4% of the time for each kind (a check of 5 kinds failed ~18% of runs),
# 32 miss it once in 400,000.
PLACEMENT_TRIES = 32
CHECK_TIMEOUT_SECONDS = 240.0
NO_STREAMED_CALL = "the shape has no streamed call"


class CheckSetupError(Exception):
    """The check cannot run against this URL at all (exit 2), with the reason."""


@dataclass
class Context:
    """What every check shares: where, what, which faults and clients, and the replicas seen at the start."""

    url: str
    shape: Shape
    faults: Faults | None
    kinds: list[str]
    sessions: int
    duration: float
    factory: ClientFactory
    replicas: list[str] = field(default_factory=list)
    say: Callable[[str], None] = lambda _text: None

    @property
    def load_kinds(self) -> list[str]:
        """The kinds the checks of calls under faults drive: all but those that only the task check drives."""
        return [k for k in self.kinds if not self.factory.kind_class(k).runs_tasks]

    def missing(self, *verbs: str) -> str | None:
        if self.faults is None:
            return "no faults given (--faults)"
        return self.faults.missing(*verbs)


# -- the deployment ---------------------------------------------------------------------


def health_url(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/health", "", ""))


async def replicas_answering(url: str, requests: int) -> list[str]:
    """The replicas named by `requests` stateless 2026-07-28 `tools/list` answers (no session: the balancer
    spreads them), in the order first seen; CheckSetupError when the URL does not answer as MCP."""
    seen: dict[str, None] = {}
    async with httpx2.AsyncClient(timeout=PLAIN_CALL_TIMEOUT) as http:
        probe = SessionlessSession(http, url, timeout=PLAIN_CALL_TIMEOUT, client_name="mcp-ha-check")
        for _ in range(requests):
            try:
                response = await probe.post("tools/list")
            except (httpx2.HTTPError, TimeoutError) as exc:
                raise CheckSetupError(f"{url} does not answer: {error_text(exc)}") from exc
            if response.status_code == 200 and (replica := response.headers.get(REPLICA_HEADER)):
                seen[replica] = None
            elif response.status_code != 200:
                raise CheckSetupError(
                    f"{url} answered tools/list with HTTP {response.status_code}: {response.text[:200]}"
                )
    return list(seen)


async def discover(url: str) -> list[str]:
    replicas = await replicas_answering(url, 12)
    if not replicas:
        raise CheckSetupError(
            f"{url} answers MCP, but without the {REPLICA_HEADER} header: is the server built on mcp_ha "
            "(HighAvailability.http_app), and does the proxy pass the header through?"
        )
    return replicas


async def settle(ctx: Context) -> str | None:
    """Wait until as many replicas answer as at the start (bounded); why not, or None once they do."""
    deadline = time.monotonic() + SETTLE_SECONDS
    seen: list[str] = []
    while time.monotonic() < deadline:
        with contextlib.suppress(CheckSetupError):
            seen = await replicas_answering(ctx.url, 3 * len(ctx.replicas))
            if len(seen) >= len(ctx.replicas):
                return None
        await asyncio.sleep(SETTLE_POLL_SECONDS)
    return f"only {', '.join(seen) or 'no replica'} answered {SETTLE_SECONDS:g} s after the fault"


# -- sessions ---------------------------------------------------------------------------


@dataclass
class Sessions:
    """Sessions of one kind of client, each with what it saw."""

    kind: str
    clients: list[CheckClient]
    runs: list[SessionRun]

    @property
    def retries(self) -> bool:
        return type(self.clients[0]).retries if self.clients else False


async def open_sessions(ctx: Context, kind: str, count: int) -> Sessions:
    """`count` open sessions of `kind`, each having read its state once (a replica's first call pays for
    lazy set-up: a cost of starting, kept out of the figures)."""
    clients = [ctx.factory.new(kind) for _ in range(count)]
    group = Sessions(kind, clients, [SessionRun(kind) for _ in clients])
    try:
        await open_and_read(clients, ctx.shape)
    except BaseException:
        await close_all([c.aclose for c in clients])
        raise
    return group


async def open_all(ctx: Context, kinds: list[str], count: int) -> tuple[list[Sessions], list[CheckResult]]:
    """Sessions of each kind; a kind whose sessions do not open is a failed result instead."""
    groups: list[Sessions] = []
    opened = await asyncio.gather(*(open_sessions(ctx, kind, count) for kind in kinds), return_exceptions=True)
    broken: list[tuple[str, str]] = []
    for kind, group in zip(kinds, opened, strict=True):
        if isinstance(group, Sessions):
            groups.append(group)
        elif isinstance(group, Exception):
            broken.append((kind, error_text(group)))
        else:
            raise group
    return groups, [
        CheckResult("", "", kind, FAIL, [f"could not open a session and read it: {why}"]) for kind, why in broken
    ]


async def ensure_on(ctx: Context, groups: list[Sessions], replica: str) -> None:
    """For each kind pinned to a replica whose sessions all missed `replica`, one more session of it
    there (opened until one lands, bounded), so the fault reaches every kind it can."""
    for g in groups:
        kind = ctx.factory.kind_class(g.kind)
        if not kind.session_era or g.kind == "resilient" or any(c.replica == replica for c in g.clients):
            continue
        with contextlib.suppress(Exception):  # a kind that could not be placed is judged on what it has
            extra = await place_on(ctx, g.kind, replica, [])
            g.clients += extra.clients
            g.runs += extra.runs


async def close_sessions(groups: list[Sessions]) -> None:
    await close_all([c.aclose for g in groups for c in g.clients])


def busiest(ctx: Context, groups: list[Sessions]) -> str:
    """The replica serving most session-era sessions now (the first replica seen when none shows one)."""
    counts = Counter(c.replica for g in groups for c in g.clients if type(c).session_era and c.replica)
    return counts.most_common(1)[0][0] if counts else ctx.replicas[0]


async def read_finals(ctx: Context, groups: list[Sessions]) -> None:
    async with asyncio.timeout(90):
        await asyncio.gather(
            *(read_final(c, r, ctx.url, ctx.shape) for g in groups for c, r in zip(g.clients, g.runs, strict=True))
        )


def effects_reasons(group: Sessions) -> list[str]:
    f = figures(group.kind, group.runs, retries=group.retries)
    reasons = []
    if f.lost:
        reasons.append(f"{f.lost} acknowledged effect(s) lost (count {f.final}, acknowledged {f.acknowledged})")
    if f.doubled:
        reasons.append(
            f"{f.doubled} effect(s) applied twice (count {f.final}, acknowledged {f.acknowledged}, failed {f.failed})"
        )
    if f.unreadable:
        errors = {r.final_error for r in group.runs if r.final is None}
        reasons.append(f"the final count of {f.unreadable} session(s) could not be read: {'; '.join(map(str, errors))}")
    if f.overran:
        reasons.append(f"{f.overran} call(s) neither returned nor raised within their bound")
    return reasons


def serving(groups: list[Sessions], replica: str) -> set[int]:
    """The clients whose session `replica` serves now (by id), noted just before it is faulted."""
    return {id(c) for g in groups for c in g.clients if c.replica == replica}


def on_it(group: Sessions, exposed: set[int]) -> str:
    """How many of the group's sessions the faulted replica served, for the note."""
    if group.kind == "resilient" or not group.clients or not type(group.clients[0]).session_era:
        return ""
    return f" ({sum(id(c) in exposed for c in group.clients)} of {len(group.clients)} sessions on it)"


def result_for(suite: str, check: str, group: Sessions, reasons: list[str], note: str, started: float) -> CheckResult:
    return CheckResult(
        suite,
        check,
        group.kind,
        FAIL if reasons else PASS,
        reasons,
        figures(group.kind, group.runs, retries=group.retries),
        note,
        round(time.monotonic() - started, 2),
    )


def named(results: list[CheckResult], suite: str, check: str, started: float) -> list[CheckResult]:
    for r in results:
        r.suite, r.check, r.seconds = suite, check, round(time.monotonic() - started, 2)
    return results


# -- faults -----------------------------------------------------------------------------


async def strike(ctx: Context, verb: str, replica: str) -> None:
    assert ctx.faults is not None
    ctx.say(f"{verb} {replica}")
    await ctx.faults.run(verb, replica)


async def undo(ctx: Context, verb: str, replica: str) -> str | None:
    """Bring `replica` back after `verb` (restart after a kill, resume after a pause; a drain brings
    itself back), then wait for every replica to answer; what went wrong, or None."""
    assert ctx.faults is not None
    back = {"kill": "restart", "kill-balancer": "restart-balancer"}.get(verb)
    try:
        if back is not None and back in ctx.faults.commands:
            await strike(ctx, back, replica)
        elif verb == "pause":
            await strike(ctx, "resume", replica)
    except FaultError as exc:
        return str(exc)
    return await settle(ctx)


async def with_fault(ctx: Context, verb: str, replica: str, hold: float, reasons: list[str]) -> float | None:
    """Strike, hold for `hold` seconds, undo; a fault command's failure goes into `reasons`. When it struck
    (its command had returned, so the signal was sent), or None when it failed."""
    struck = None
    try:
        await strike(ctx, verb, replica)
        struck = time.monotonic()
        await asyncio.sleep(hold)
    except FaultError as exc:
        reasons.append(f"the fault failed: {exc}")
    finally:
        if why := await undo(ctx, verb, replica):
            reasons.append(why)
    return struck


# -- lb ---------------------------------------------------------------------------------


async def check_health(ctx: Context) -> list[CheckResult]:
    started = time.monotonic()
    url = health_url(ctx.url)
    try:
        async with httpx2.AsyncClient(timeout=PLAIN_CALL_TIMEOUT) as http:
            response = await http.get(url)
        reasons = [] if response.status_code == 200 else [f"GET {url}: HTTP {response.status_code}"]
    except httpx2.HTTPError as exc:
        reasons = [f"GET {url}: {error_text(exc)}"]
    status = FAIL if reasons else PASS
    return [CheckResult(LB, "health", "-", status, reasons, None, f"GET {url}: 200", time.monotonic() - started)]


async def check_sticky(ctx: Context) -> list[CheckResult]:
    """Session-era sessions of each kind make a few writes; each must be answered by one replica."""
    started = time.monotonic()
    kinds = [k for k in ctx.kinds if k != "resilient" and ctx.factory.kind_class(k).session_era]
    groups, results = await open_all(ctx, kinds, ctx.sessions)
    try:
        for _ in range(WRITES_BETWEEN_CALLS + 2):
            await asyncio.gather(
                *(timed_call(r, c, ctx.shape) for g in groups for c, r in zip(g.clients, g.runs, strict=True))
            )
        await read_finals(ctx, groups)
        for g in groups:
            reasons = effects_reasons(g)
            spread = [sorted({c.replica for c in r.calls if c.replica}) for r in g.runs]
            moved = [s for s in spread if len(s) > 1]
            if moved:
                reasons.append(f"{len(moved)} session(s) answered by more than one replica: {moved}")
            if any(not s for s in spread):
                reasons.append("some answers named no replica")
            if failed := figures(g.kind, g.runs, retries=g.retries).failed:
                reasons.append(f"{failed} call(s) failed with no fault")
            note = f"{len(g.runs)} sessions on {', '.join(sorted({s[0] for s in spread if s}))}"
            results.append(result_for(LB, "sticky", g, reasons, note, started))
    finally:
        await close_sessions(groups)
    return named(results, LB, "sticky", started)


async def check_spread(ctx: Context) -> list[CheckResult]:
    started = time.monotonic()
    count = max(6, 2 * len(ctx.replicas))
    group, failures = await open_all(ctx, ["plain"], count)
    if failures:
        return named(failures, LB, "spread", started)
    [g] = group
    try:
        counts = Counter(c.replica for c in g.clients)
    finally:
        await close_sessions(group)
    reasons = []
    if len(ctx.replicas) < 2:
        reasons.append(f"only one replica answers ({ctx.replicas[0]}): nothing to fail over to")
    elif len(counts) < 2:
        reasons.append(f"all {count} new sessions landed on {next(iter(counts))}")
    note = ", ".join(f"{replica} {n}" for replica, n in sorted(counts.items(), key=lambda i: str(i[0])))
    return [
        CheckResult(LB, "spread", "plain", FAIL if reasons else PASS, reasons, None, note, time.monotonic() - started)
    ]


async def check_replica_gone(ctx: Context) -> list[CheckResult]:
    """The busiest replica killed: its sessions and new ones are all answered by the others."""
    started = time.monotonic()
    if why := ctx.missing("kill"):
        return [CheckResult(LB, "replica gone", "plain", SKIP, [why])]
    groups, failures = await open_all(ctx, ["plain"], max(6, 2 * len(ctx.replicas)))
    if failures:
        return named(failures, LB, "replica gone", started)
    [old] = groups
    reasons: list[str] = []
    try:
        for c, r in zip(old.clients, old.runs, strict=True):
            await timed_call(r, c, ctx.shape)
        replica = busiest(ctx, groups)
        on_it = sum(c.replica == replica for c in old.clients)
        struck = time.monotonic()
        try:
            await strike(ctx, "kill", replica)
            new_clients = [ctx.factory.new("plain") for _ in old.clients]
            new_runs = [SessionRun("plain") for _ in new_clients]
            try:
                async with asyncio.timeout(OPEN_TIMEOUT_SECONDS):
                    await asyncio.gather(*(c.open() for c in new_clients))
            except Exception as exc:
                reasons.append(f"new sessions could not open with {replica} gone: {error_text(exc)}")
            old.clients += new_clients
            old.runs += new_runs
            for _ in range(WRITES_BETWEEN_CALLS):
                await asyncio.gather(
                    *(timed_call(r, c, ctx.shape) for c, r in zip(old.clients, old.runs, strict=True) if c.session_id)
                )
        except FaultError as exc:
            reasons.append(f"the fault failed: {exc}")
        finally:
            if why := await undo(ctx, "kill", replica):
                reasons.append(why)
        await read_finals(ctx, groups)
        served_by_it = sum(c.replica == replica for r in old.runs for c in r.calls if c.ok and c.start > struck)
        if served_by_it:
            reasons.append(f"{served_by_it} call(s) answered by {replica} after it was killed")
        if failed := sum(not c.ok for r in old.runs for c in r.calls if c.start > struck):
            reasons.append(f"{failed} call(s) failed with {replica} gone")
        reasons += effects_reasons(old)
        note = f"{replica} killed, serving {on_it} of {len(old.clients) // 2} sessions; {len(old.clients) // 2} new"
        return [result_for(LB, "replica gone", old, reasons, note, started)]
    finally:
        await close_sessions(groups)


# -- resilience: faults under sessions --------------------------------------------------


async def check_between_calls(ctx: Context, verb: str) -> list[CheckResult]:
    """Sessions write, go idle; the busiest replica is faulted; each writes again and must not fail."""
    check = f"{'kill -9' if verb == 'kill' else verb} between calls"
    started = time.monotonic()
    if not ctx.load_kinds:
        return []  # only kinds the task check drives
    if why := ctx.missing(verb, *(("resume",) if verb == "pause" else ())):
        return [CheckResult(RESILIENCE, check, kind, SKIP, [why]) for kind in ctx.load_kinds]
    groups, results = await open_all(ctx, ctx.load_kinds, ctx.sessions)
    reasons: list[str] = []
    try:
        replica = busiest(ctx, groups)
        await ensure_on(ctx, groups, replica)
        pairs = [(c, r) for g in groups for c, r in zip(g.clients, g.runs, strict=True)]
        for _ in range(2):
            await asyncio.gather(*(timed_call(r, c, ctx.shape) for c, r in pairs))
        exposed = serving(groups, replica)
        after = time.monotonic()
        try:
            await strike(ctx, verb, replica)
            for _ in range(WRITES_BETWEEN_CALLS):
                await asyncio.gather(*(timed_call(r, c, ctx.shape) for c, r in pairs))
        except FaultError as exc:
            reasons.append(f"the fault failed: {exc}")
        finally:
            if why := await undo(ctx, verb, replica):
                reasons.append(why)
        await read_finals(ctx, groups)
        for g in groups:
            mine = list(reasons)
            failed = [c for r in g.runs for c in r.calls if not c.ok]
            if failed:
                mine.append(f"{len(failed)} call(s) failed: {'; '.join(sorted({str(c.error) for c in failed}))[:300]}")
            stuck = [
                r
                for c, r in zip(g.clients, g.runs, strict=True)
                if id(c) in exposed and any(x.ok and x.start >= after and x.replica == replica for x in r.calls)
            ]
            if verb == "kill" and stuck:
                mine.append(f"{len(stuck)} session(s) answered by {replica} after it was killed")
            mine += effects_reasons(g)
            results.append(result_for(RESILIENCE, check, g, mine, f"{verb} {replica}{on_it(g, exposed)}", started))
    finally:
        await close_sessions(groups)
    return named(results, RESILIENCE, check, started)


async def faulted_load(
    ctx: Context, groups: list[Sessions], fault: Callable[[], Awaitable[float | None]]
) -> tuple[float, float]:
    """Every session of `groups` writes in a loop through `fault`, FAULT_AT_SECONDS in (load_with_fault);
    each session's final count is read. (struck, over): when the fault began and when it was over."""
    pairs = [(c, r) for g in groups for c, r in zip(g.clients, g.runs, strict=True)]
    span = await load_with_fault(pairs, ctx.shape, fault, fault_at=FAULT_AT_SECONDS, duration=ctx.duration)
    await read_finals(ctx, groups)
    return span.struck, span.over


async def check_under_load(ctx: Context, verb: str) -> list[CheckResult]:
    """Every session writes in a loop; the busiest replica is faulted mid-load, then brought back."""
    check = {"kill": "kill -9 under load", "pause": "pause under load", "drain": "drain under load"}[verb]
    started = time.monotonic()
    if not ctx.load_kinds:
        return []  # only kinds the task check drives
    if why := ctx.missing(verb, *(("resume",) if verb == "pause" else ())):
        return [CheckResult(RESILIENCE, check, kind, SKIP, [why]) for kind in ctx.load_kinds]
    groups, results = await open_all(ctx, ctx.load_kinds, ctx.sessions)
    reasons: list[str] = []
    exposed: set[int] = set()
    try:
        replica = busiest(ctx, groups)
        await ensure_on(ctx, groups, replica)

        async def fault() -> float | None:
            exposed.update(serving(groups, replica))
            hold = {"kill": KILL_DOWN_SECONDS, "pause": PAUSE_SECONDS, "drain": 0.0}[verb]
            return await with_fault(ctx, verb, replica, hold, reasons)

        struck, over = await faulted_load(ctx, groups, fault)
        for g in groups:
            mine, stopped = under_load_reasons(g, struck, over, DETECT_WINDOW[verb])
            note = (
                f"; {stopped} of {len(g.runs)} sessions stopped: this client never works again after a "
                "dropped connection"
                if stopped
                else ""
            )
            results.append(
                result_for(RESILIENCE, check, g, reasons + mine, f"{verb} {replica}{on_it(g, exposed)}{note}", started)
            )
    finally:
        await close_sessions(groups)
    return named(results, RESILIENCE, check, started)


def under_load_reasons(g: Sessions, struck: float, over: float, window: float) -> tuple[list[str], int]:
    """What one kind's sessions saw go wrong through a replica's fault under load, calls the fault caught
    within `window` of it excused for a client that does not retry; and how many sessions stopped."""
    mine = []
    calls = [c for r in g.runs for c in r.calls]
    # A client that never works again once its connection dropped (check_balancer_killed): its
    # sessions whose call the fault caught stop there, the client's defect, said but not failed.
    stopped = (
        set()
        if type(g.clients[0]).survives_dropped_connection
        else {
            i
            for i, r in enumerate(g.runs)
            if any(not c.ok and c.end >= struck and c.start <= struck + window for c in r.calls)
        }
    )
    runs = [r for i, r in enumerate(g.runs) if i not in stopped]
    late = [c for r in runs for c in r.calls if not c.ok and (g.retries or c.start > struck + window)]
    if late:
        when = "" if g.retries or not window else f" more than {window:g} s after the fault"
        mine.append(
            f"{len(late)} call(s) started{when} failed: {'; '.join(sorted({str(c.error) for c in late}))[:300]}"
        )
    silent = sum(not any(c.ok and c.end >= over for c in r.calls) for r in runs)
    if silent:
        mine.append(f"{silent} of {len(g.runs)} session(s) answered no call after the fault")
    if not any(c.ok for c in calls):
        mine.append("no call was answered at all")
    return mine + effects_reasons(g), len(stopped)


async def check_balancer_killed(ctx: Context) -> list[CheckResult]:
    """Every session writes in a loop; a balancer in front is killed mid-load, then brought back."""
    check = "balancer killed under load"
    started = time.monotonic()
    if not ctx.load_kinds:
        return []
    if why := ctx.missing("kill-balancer"):
        return [CheckResult(RESILIENCE, check, kind, SKIP, [why]) for kind in ctx.load_kinds]
    groups, results = await open_all(ctx, ctx.load_kinds, ctx.sessions)
    reasons: list[str] = []
    try:
        struck, over = await faulted_load(
            ctx, groups, lambda: with_fault(ctx, "kill-balancer", "", KILL_DOWN_SECONDS, reasons)
        )
        for g in groups:
            mine, note = reasons + balancer_reasons(ctx, g, struck, over), ""
            stopped = sum(not any(c.ok and c.end >= over for c in r.calls) for r in g.runs)
            if stopped and not type(g.clients[0]).survives_dropped_connection:
                note = f"; {stopped} of {len(g.runs)} sessions stopped: this client never works again after a "
                note += "dropped connection"
            results.append(result_for(RESILIENCE, check, g, mine, f"a balancer killed{note}", started))
    finally:
        await close_sessions(groups)
    return named(results, RESILIENCE, check, started)


def balancer_reasons(ctx: Context, g: Sessions, struck: float, over: float) -> list[str]:
    """What one kind's sessions saw go wrong through a balancer's death, by what its clients can do."""
    kind = type(g.clients[0])
    calls = [c for r in g.runs for c in r.calls]
    failed = [c for c in calls if not c.ok]
    errors = "; ".join(sorted({str(c.error) for c in failed}))[:300]
    mine = []
    if failed and (g.retries or (kind.survives_dropped_connection and len(failed) > len(g.runs))):
        caught = "" if g.retries else f", more than the {len(g.runs)} in flight the kill could catch"
        mine.append(f"{len(failed)} call(s) failed{caught}: {errors}")
    if kind.session_era and g.kind != "resilient":
        moved = sum(
            any(c.ok and c.start >= struck and c.replica not in (None, r.replica_at(struck)) for c in r.calls)
            for r in g.runs
        )
        if moved:
            mine.append(
                f"{moved} of {len(g.runs)} sessions answered by another replica: the balancers left "
                "do not know where the sessions are (do they share their session table?)"
            )
    # Only a client that works again after its connection dropped can show that the URL still answers.
    silent = sum(not any(c.ok and c.end >= over for c in r.calls) for r in g.runs)
    if silent and kind.survives_dropped_connection:
        mine.append(
            f"{silent} of {len(g.runs)} session(s) answered no call after the fault: does {ctx.url} "
            "reach another balancer?"
        )
    if not any(c.ok for c in calls):
        mine.append("no call was answered at all")
    return mine + effects_reasons(g)


# -- resilience: a retried call ---------------------------------------------------------


async def keyed_once(session: RawSession, ctx: Context, key: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """The shape's `once` call with idempotency key `key`; CallFailed for anything but its result."""
    call = ctx.shape.once_call
    response = await session.post(
        "tools/call", {"name": call.tool, "arguments": arguments, "_meta": {IDEMPOTENCY_KEY: key}}
    )
    return tool_result(final_message(response))


@dataclass
class RawProbe:
    """A raw session (session-era, or sessionless with a handle) as the retry checks drive it."""

    session: RawSession
    extra: dict[str, Any] = field(default_factory=dict)
    previous: dict[str, Any] | None = None
    replica: str | None = None

    async def write(self, ctx: Context, times: int) -> None:
        for _ in range(times):
            response = await self.session.post(
                "tools/call",
                {
                    "name": ctx.shape.write.tool,
                    "arguments": {**ctx.shape.write.arguments_after(self.previous), **self.extra},
                },
            )
            self.previous = tool_result(final_message(response))
            self.replica = response.headers.get(REPLICA_HEADER) or self.replica

    def once_arguments(self, ctx: Context) -> dict[str, Any]:
        return {**ctx.shape.once_call.arguments_after(self.previous), **self.extra}

    async def state(self, ctx: Context) -> Any:
        read = ctx.shape.read
        return ctx.shape.state_of(
            await self.session.call_tool(read.tool, {**read.arguments_after(self.previous), **self.extra})
        )


async def raw_probe(http: httpx2.AsyncClient, ctx: Context, sessionless: bool) -> RawProbe:
    if sessionless:
        session: RawSession = SessionlessSession(http, ctx.url, timeout=PLAIN_CALL_TIMEOUT, client_name="mcp-ha-check")
        handle = await session.open()
        return RawProbe(session, {"session_id": handle})
    session = RawSession(http, ctx.url, timeout=PLAIN_CALL_TIMEOUT, client_name="mcp-ha-check")
    await session.open()
    return RawProbe(session)


async def control_state(http: httpx2.AsyncClient, ctx: Context, sessionless: bool) -> Any:
    """The state two writes and one `once` leave, with no fault and no retry."""
    probe = await raw_probe(http, ctx, sessionless)
    try:
        await probe.write(ctx, 2)
        await keyed_once(probe.session, ctx, uuid.uuid4().hex, probe.once_arguments(ctx))
        return await probe.state(ctx)
    finally:
        await probe.session.close()


async def check_retry_once(ctx: Context) -> list[CheckResult]:
    started = time.monotonic()
    results = []
    async with httpx2.AsyncClient(timeout=PLAIN_CALL_TIMEOUT) as http:
        for client, sessionless in (("plain", False), ("plain sessionless", True)):
            reasons: list[str] = []
            try:
                expected = await control_state(http, ctx, sessionless)
                probe = await raw_probe(http, ctx, sessionless)
                try:
                    await probe.write(ctx, 2)
                    key = uuid.uuid4().hex
                    await keyed_once(probe.session, ctx, key, probe.once_arguments(ctx))
                    await keyed_once(probe.session, ctx, key, probe.once_arguments(ctx))
                    state = await probe.state(ctx)
                    if state != expected:
                        reasons.append(f"state after the retry {state!r}, after one application {expected!r}")
                finally:
                    await probe.session.close()
            except (CallFailed, httpx2.HTTPError, TimeoutError, ShapeError) as exc:
                reasons.append(error_text(exc))
            note = f"`{ctx.shape.once_call.tool}` sent twice with one key"
            results.append(
                CheckResult(RESILIENCE, "retry applies once", client, FAIL if reasons else PASS, reasons, None, note)
            )
    return named(results, RESILIENCE, "retry applies once", started)


async def check_retry_after_kill(ctx: Context) -> list[CheckResult]:
    """The `once` call sent, its replica killed a few milliseconds later (before or after it applied);
    the retry with the same key, until answered, must leave the state of one application."""
    started = time.monotonic()
    check = "retry after kill"
    if why := ctx.missing("kill"):
        return [CheckResult(RESILIENCE, check, "plain", SKIP, [why])]
    reasons: list[str] = []
    note = ""
    async with httpx2.AsyncClient(timeout=PLAIN_CALL_TIMEOUT) as http:
        try:
            expected = await control_state(http, ctx, False)
            probe = await raw_probe(http, ctx, False)
            await probe.write(ctx, 2)
            replica = probe.replica or ctx.replicas[0]
            key = uuid.uuid4().hex
            arguments = probe.once_arguments(ctx)
            doomed = asyncio.create_task(keyed_once(probe.session, ctx, key, arguments))
            try:
                await asyncio.sleep(random.uniform(0.0, 0.02))
                await strike(ctx, "kill", replica)
                with contextlib.suppress(CallFailed, httpx2.HTTPError, TimeoutError):
                    await doomed  # cut with its replica, or answered just before: the client cannot know
                deadline = time.monotonic() + RETRY_SECONDS
                tries = 0
                while True:
                    tries += 1
                    try:
                        await keyed_once(probe.session, ctx, key, arguments)
                        break
                    except (CallFailed, httpx2.HTTPError, TimeoutError) as exc:
                        if time.monotonic() > deadline:
                            reasons.append(f"the retry was not answered within {RETRY_SECONDS:g} s: {error_text(exc)}")
                            break
                        await asyncio.sleep(0.3)
                state = await probe.state(ctx)
                if state != expected:
                    reasons.append(f"state after the retry {state!r}, after one application {expected!r}")
                note = f"{replica} killed mid-call; answered after {tries} retr{'y' if tries == 1 else 'ies'}"
            finally:
                doomed.cancel()
                with contextlib.suppress(BaseException):
                    await doomed
                if why := await undo(ctx, "kill", replica):
                    reasons.append(why)
                await probe.session.close()
        except (CallFailed, httpx2.HTTPError, TimeoutError, FaultError, ShapeError) as exc:
            reasons.append(error_text(exc))
    return [
        CheckResult(
            RESILIENCE, check, "plain", FAIL if reasons else PASS, reasons, None, note, time.monotonic() - started
        )
    ]


# -- resilience: a streamed call, a handle ---------------------------------------------


async def place_on(ctx: Context, kind: str, replica: str | None, groups: list[Sessions]) -> Sessions:
    """A session of `kind` on `replica` (when given): sessions are opened until one lands there (bounded);
    the others are closed."""
    for _ in range(PLACEMENT_TRIES):
        group = await open_sessions(ctx, kind, 1)
        if replica is None or group.clients[0].replica == replica:
            groups.append(group)
            return group
        await close_sessions([group])
    raise RuntimeError(f"no {kind} session landed on {replica} in {PLACEMENT_TRIES} tries")


async def check_streamed(ctx: Context) -> list[CheckResult]:
    """One session per kind that resumes streams, all on one replica; the streamed call started on each;
    that replica killed mid-stream. Each call must complete, its effects as with no fault."""
    started = time.monotonic()
    check = "streamed call"
    streamed = ctx.shape.streamed
    kinds = [k for k in ctx.kinds if ctx.factory.kind_class(k).resumes_streams]
    if not kinds:
        return []  # no kind given resumes a stream
    if streamed is None:
        return [CheckResult(RESILIENCE, check, k, SKIP, [NO_STREAMED_CALL]) for k in kinds]
    if why := ctx.missing("kill"):
        return [CheckResult(RESILIENCE, check, k, SKIP, [why]) for k in kinds]
    groups: list[Sessions] = []
    results: list[CheckResult] = []
    try:
        effect = await streamed_effect(ctx, streamed, groups)
        placed, replica = await place_together(ctx, check, kinds, groups, results)
        counts = [ctx.shape.count_of(await g.clients[0].call(ctx.shape.read)) for g in placed]
        struck, reasons = await stream_through_kill(ctx, streamed, placed, replica)
        for group, count in zip(placed, counts, strict=True):
            mine = list(reasons)
            run = group.runs[0]
            record = run.calls[-1]
            if not record.ok:
                mine.append(f"the streamed call did not complete: {record.error}")
            elif record.end < struck:
                mine.append("the streamed call ended before its replica was killed: give the shape a longer one")
            delta = await effect_after(ctx, group, count, effect, mine)
            note = f"{replica} killed {STREAM_KILL_AFTER_SECONDS:g} s in; answered by {record.replica or '?'}"
            results.append(one_call_result(check, group.kind, mine, record, run.final, effect, delta, note))
    except (CallFailed, ShapeError, RuntimeError, TimeoutError) as exc:
        results.append(CheckResult(RESILIENCE, check, "-", FAIL, [error_text(exc)]))
    finally:
        await close_sessions(groups)
    return named(results, RESILIENCE, check, started)


async def streamed_effect(ctx: Context, streamed: Call, groups: list[Sessions]) -> int:
    """The effect of one streamed call with no fault, in a session of the kit's raw client (added to
    `groups`, which the caller closes)."""
    control = await open_sessions(ctx, "plain", 1)
    groups.append(control)
    [client] = control.clients
    before = ctx.shape.count_of(await client.call(ctx.shape.read))
    await client.call(streamed, bound=STREAMED_BOUND_SECONDS, progress=True)
    return ctx.shape.count_of(await client.call(ctx.shape.read)) - before


async def place_together(
    ctx: Context, check: str, kinds: list[str], groups: list[Sessions], results: list[CheckResult]
) -> tuple[list[Sessions], str | None]:
    """A session of each kind on the replica the first kind's landed on, and that replica; a kind that
    cannot be placed there is a failed result in `results`."""
    first = await place_on(ctx, kinds[0], None, groups)
    replica = first.clients[0].replica
    placed = [first]
    for kind in kinds[1:]:
        try:
            placed.append(await place_on(ctx, kind, replica, groups))
        except Exception as exc:
            results.append(CheckResult(RESILIENCE, check, kind, FAIL, [error_text(exc)]))
    return placed, replica


async def stream_through_kill(
    ctx: Context, streamed: Call, placed: list[Sessions], replica: str | None
) -> tuple[float, list[str]]:
    """The streamed call started in each placed session, `replica` killed STREAM_KILL_AFTER_SECONDS in and
    brought back once the calls are over (bounded): when it was struck, and what went wrong with the fault.
    Each call's record is its session's last."""
    calls = [
        asyncio.create_task(
            recorded_call(g.runs[0], g.clients[0], streamed, bound=STREAMED_BOUND_SECONDS, progress=True)
        )
        for g in placed
    ]
    reasons: list[str] = []
    await asyncio.sleep(STREAM_KILL_AFTER_SECONDS)
    struck = time.monotonic()
    assert replica is not None
    try:
        await strike(ctx, "kill", replica)
    except FaultError as exc:
        reasons.append(f"the fault failed: {exc}")
    await asyncio.wait(calls, timeout=STREAMED_BOUND_SECONDS + GUARD_SLACK_SECONDS + 1)
    if why := await undo(ctx, "kill", replica):
        reasons.append(why)
    return struck, reasons


async def effect_after(ctx: Context, group: Sessions, count: int, effect: int, reasons: list[str]) -> int | None:
    """The group's one session's count now, less `count`: what its call did, checked against `effect`
    (the call's effect with no fault) into `reasons`; None when the count cannot be read."""
    run = group.runs[0]
    await read_final(group.clients[0], run, ctx.url, ctx.shape)
    delta = None if run.final is None else run.final - count
    if delta is None:
        reasons.append(f"the count could not be read afterwards: {run.final_error}")
    elif delta != effect:
        reasons.append(f"its effect on the count was {delta}, with no fault {effect}")
    return delta


def one_call_result(
    check: str,
    kind: str,
    reasons: list[str],
    record: CallRecord,
    final: int | None,
    effect: int,
    delta: int | None,
    note: str,
) -> CheckResult:
    """The result of a check of one call: its figures, from the call and its effect on the count."""
    figures = Figures(
        kind=kind,
        sessions=1,
        calls=1,
        failed=int(not record.ok),
        overran=0,
        longest_call_s=round(record.end - record.start, 3),
        acknowledged=int(record.ok),
        final=final,
        lost=max(effect - delta, 0) if delta is not None else 0,
        doubled=max(delta - effect, 0) if delta is not None else 0,
        unreadable=int(delta is None),
        errors=[record.error] if record.error else [],
    )
    return CheckResult(RESILIENCE, check, kind, FAIL if reasons else PASS, reasons, figures, note)


async def check_task(ctx: Context) -> list[CheckResult]:
    """For each kind that runs tasks: the streamed call run as a task, the replica tasks/get names as
    running it killed mid-run; the call must complete, its effect as with no fault."""
    started = time.monotonic()
    check = "task killed mid-run"
    kinds = [k for k in ctx.kinds if ctx.factory.kind_class(k).runs_tasks]
    if not kinds:
        return []
    if ctx.shape.streamed is None:
        return [CheckResult(RESILIENCE, check, k, SKIP, [NO_STREAMED_CALL]) for k in kinds]
    if why := ctx.missing("kill"):
        return [CheckResult(RESILIENCE, check, k, SKIP, [why]) for k in kinds]
    results = []
    for kind in kinds:
        try:
            results.append(await task_killed(ctx, kind, check))
        except ImportError as exc:
            results.append(CheckResult(RESILIENCE, check, kind, SKIP, [f"{exc.name} is not installed"]))
        except (CallFailed, ShapeError, RuntimeError, TimeoutError, ToolAnsweredError) as exc:
            results.append(CheckResult(RESILIENCE, check, kind, FAIL, [error_text(exc)]))
    return named(results, RESILIENCE, check, started)


async def task_killed(ctx: Context, kind: str, check: str) -> CheckResult:
    assert ctx.shape.streamed is not None
    streamed = ctx.shape.streamed
    group = await open_sessions(ctx, kind, 1)
    try:
        [client] = group.clients
        assert isinstance(client, TasksClient)
        measured = await task_effect(ctx, client, streamed)
        if measured is None:
            not_a_task = f"{streamed.tool} did not run as a task: mark its tool task=True, with the tasks extra"
            return CheckResult(RESILIENCE, check, kind, SKIP, [not_a_task])
        count, effect = measured
        client.seen.forget()
        call = asyncio.create_task(recorded_call(group.runs[0], client, streamed, bound=TASK_BOUND_SECONDS))
        reasons: list[str] = []
        runner, struck = await kill_runner(ctx, client.seen, call, reasons)
        await asyncio.wait([call], timeout=TASK_BOUND_SECONDS + GUARD_SLACK_SECONDS + 1)
        if runner is not None and (why := await undo(ctx, "kill", runner)):
            reasons.append(why)
        record = group.runs[0].calls[-1]
        if not record.ok:
            reasons.append(f"the task's call did not complete: {record.error}")
        delta = await effect_after(ctx, group, count, effect, reasons)
        after = [p["runner"] for p in client.seen.polls if p["runner"] not in (None, runner)]
        note = (
            f"{runner} killed {STREAM_KILL_AFTER_SECONDS:g} s in, result {record.end - struck:.1f} s after; "
            f"taken over by {after[-1] if after else '?'}"
            if struck is not None and record.ok
            else ""
        )
        return one_call_result(check, kind, reasons, record, group.runs[0].final, effect, delta, note)
    finally:
        await close_sessions([group])


async def task_effect(ctx: Context, client: TasksClient, streamed: Call) -> tuple[int, int] | None:
    """The count after one run of `streamed` with no fault, and that run's effect on it; None when it did
    not run as a task at all (no tasks/get poll)."""
    before = ctx.shape.count_of(await client.call(ctx.shape.read))
    await client.call(streamed, bound=TASK_BOUND_SECONDS)
    if not client.seen.polls:
        return None
    count = ctx.shape.count_of(await client.call(ctx.shape.read))
    return count, count - before


async def kill_runner(
    ctx: Context, seen: TaskSeen, call: asyncio.Task[CallRecord], reasons: list[str]
) -> tuple[str | None, float | None]:
    """Once tasks/get names the replica running `call`'s task (bounded), that replica killed
    STREAM_KILL_AFTER_SECONDS later: the runner and when it was struck (None, None when none was named);
    what went wrong goes into `reasons`."""
    named_runner = asyncio.create_task(seen.named.wait())
    await asyncio.wait([call, named_runner], timeout=RUNNER_NAMED_WITHIN_SECONDS, return_when="FIRST_COMPLETED")
    named_runner.cancel()
    runner = seen.runner
    if runner is None:
        reasons.append(
            "the task ended before a replica was named as running it: give the shape a longer streamed call"
            if call.done()
            else f"tasks/get named no replica running the task within {RUNNER_NAMED_WITHIN_SECONDS:g} s "
            f"(_meta {RUNNER_META}): is the server on mcp_ha with the tasks extra?"
        )
        return None, None
    await asyncio.sleep(STREAM_KILL_AFTER_SECONDS)
    if call.done():
        reasons.append("the task ended before its replica was killed: give the shape a longer streamed call")
    struck = time.monotonic()
    try:
        await strike(ctx, "kill", runner)
    except FaultError as exc:
        reasons.append(f"the fault failed: {exc}")
    return runner, struck


async def check_handle(ctx: Context) -> list[CheckResult]:
    """A sessionless client's handle: writes answered by several replicas, then the last one killed,
    more writes; none fails, the count exact."""
    started = time.monotonic()
    check = "sessionless handle"
    if "sessionless" not in ctx.kinds:
        return []
    if why := ctx.missing("kill"):
        return [CheckResult(RESILIENCE, check, "sessionless", SKIP, [why])]
    groups, results = await open_all(ctx, ["sessionless"], ctx.sessions)
    if results:
        return named(results, RESILIENCE, check, started)
    [g] = groups
    reasons: list[str] = []
    try:
        pairs = list(zip(g.clients, g.runs, strict=True))
        for _ in range(2 * len(ctx.replicas)):
            await asyncio.gather(*(timed_call(r, c, ctx.shape) for c, r in pairs))
        seen = {c.replica for r in g.runs for c in r.calls if c.replica}
        replica = g.runs[0].calls[-1].replica or ctx.replicas[0]
        try:
            await strike(ctx, "kill", replica)
            for _ in range(WRITES_BETWEEN_CALLS):
                await asyncio.gather(*(timed_call(r, c, ctx.shape) for c, r in pairs))
        except FaultError as exc:
            reasons.append(f"the fault failed: {exc}")
        finally:
            if why := await undo(ctx, "kill", replica):
                reasons.append(why)
        await read_finals(ctx, groups)
        if len(ctx.replicas) > 1 and len(seen) < 2:
            reasons.append(f"every call of a handle landed on {', '.join(map(str, seen))}: nothing crossed replicas")
        if failed := [c for r in g.runs for c in r.calls if not c.ok]:
            reasons.append(f"{len(failed)} call(s) failed: {'; '.join(sorted({str(c.error) for c in failed}))[:300]}")
        reasons += effects_reasons(g)
        note = f"answered by {', '.join(sorted(map(str, seen)))}; then {replica} killed"
        return [result_for(RESILIENCE, check, g, reasons, note, started)]
    finally:
        await close_sessions(groups)


CheckFn = Callable[[Context], Awaitable[list[CheckResult]]]


def _verb(fn: Callable[[Context, str], Awaitable[list[CheckResult]]], verb: str) -> CheckFn:
    async def run(ctx: Context) -> list[CheckResult]:
        return await fn(ctx, verb)

    return run


SUITES: dict[str, list[tuple[str, CheckFn]]] = {
    LB: [
        ("health", check_health),
        ("sticky", check_sticky),
        ("spread", check_spread),
        ("replica gone", check_replica_gone),
    ],
    RESILIENCE: [
        ("kill -9 between calls", _verb(check_between_calls, "kill")),
        ("pause between calls", _verb(check_between_calls, "pause")),
        ("kill -9 under load", _verb(check_under_load, "kill")),
        ("pause under load", _verb(check_under_load, "pause")),
        ("drain under load", _verb(check_under_load, "drain")),
        ("balancer killed under load", check_balancer_killed),
        ("retry applies once", check_retry_once),
        ("retry after kill", check_retry_after_kill),
        ("streamed call", check_streamed),
        ("sessionless handle", check_handle),
        ("task killed mid-run", check_task),
    ],
}
