"""The failover benchmark: real faults under steady load, and what six kinds of client see.

    python -m tools.failover_bench --own-stack                      every scenario, on a stack of its own
    python -m tools.failover_bench --scenario kill --json out.json  one scenario, on the running stack
    python -m tools.failover_bench --own-stack --markdown docs/benchmarks.md
                                       the figures into the document, between <!-- failover:start -->
                                       and <!-- failover:end --> (nothing else in it changes)

Scenarios (one replica is "the faulted one": the one serving most plain sessions):

    kill         SIGKILL it, start it again ~3 s later
    pause        SIGSTOP it (a hung replica), SIGCONT ~4 s later
    rolling      restart every replica, one after another (SIGTERM: each drains)
    restart-all  stop every replica at once, then start them all again
    none         no fault at all: the baseline (not part of --scenario all)

and Redis faults (the faulted one is Redis's primary):

    redis-kill     SIGKILL the primary; with Sentinel (--redis sentinel) or a cluster
                   (--redis cluster: the primary serving slot 0) a replica is promoted;
                   the old primary is started again once that happened (or after ~3 s
                   with one Redis)
    redis-restart  restart the primary (SIGTERM: it writes its AOF out, then starts
                   and reloads it)
    redis-outage   stop every Redis server for 10 s, then start them again
    redis-move     with --redis cluster: move 2,000 slots, keys and all, from the primary
                   serving slot 0 to another (redis-cli --cluster reshard), under load

and a front-door fault (the stack runs two HAProxy processes on one address,
sharing their session table: `--own-stack` starts it so for it, `MCP_BALANCERS=2
python stack.py up` too):

    haproxy-kill   SIGKILL the HAProxy holding most client connections, start it
                   again ~3 s later (it takes the session table back from the other)

Each scenario runs, through HAProxy, `--sessions` sessions of each kind of
client, each calling `increment_counter` in a loop. The clients, and the load's
plumbing (each call recorded, the final counters read), are the HA check's
(mcp_ha/ops/check/clients.py and load.py), driving the demo's shape (DEMO):

    plain        session-era MCP over raw HTTP (mcp_ha/ops/check/wire.py): initialize
                 once, keep the session id, never retry, 5 s per call
    resilient    ResilientClient (resilient_client.py)
    sessionless  FastMCP's Client in its default, sessionless (2026-07-28) mode:
                 one create_session handle passed to every call, no retries of
                 its own, 5 s per call; nothing pins its requests to a replica

and, unless `--no-stock`, the stock SDK clients nobody here wrote, each at its
defaults (no timeout, no retries of ours; the benchmark gives up on a call of
theirs after 6 s and counts it failed):

    ts_sdk          the official TypeScript SDK (@modelcontextprotocol/sdk, pinned
                    in tests/clients/ts): Client over StreamableHTTPClientTransport,
                    driven by the HA check's mcp_ha/ops/check/ts_client.mjs (Node; make node-deps)
    python_sdk      the MCP Python SDK's ClientSession over streamable_http_client
    fastmcp_legacy  FastMCP's Client in mode="legacy" (session-era, 2025-11-25)

Through a kill, these and sessionless are held to the issue's targets for calls
that stream nothing: no failed call, none over 1 s, every session's counter
exactly the increments it was told about.

It prints, per client kind: failed calls, the longest call and stall, how
long HAProxy took to take the faulted replica out, and each session's final
counter against the increments it was told about. With `--markdown FILE`, the
same figures go into FILE as a markdown table, with a line saying when, on
what and with which command line they were measured (only once every scenario
ran; a FILE without both markers is refused before anything starts). The exit
status is 0 when every target of `check_targets` holds, 1 when one does not
(each is listed), 2 when there is no healthy stack to run against or it broke
during the run, or FILE lacks its markers.

Tests call `run_scenario(stack, scenario)` (`stock=True` for the stock SDK clients)
and `check_targets(report)` directly.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import click
from rich.console import Console
from rich.live import Live
from rich.table import Table

from mcp_ha.ops.check.clients import (
    GUARD_SLACK_SECONDS,
    PLAIN_CALL_TIMEOUT,
    RESILIENT_SETTINGS,
    STOCK_CALL_BOUND,
    STOCK_KINDS,
    CheckClient,
    ClientFactory,
    SessionlessClient,
)
from mcp_ha.ops.check.load import (
    TAIL_SECONDS,
    LoadSpan,
    SessionRun,
    close_all,
    figures,
    load_with_fault,
    open_and_read,
    read_final,
)
from mcp_ha.ops.check.node import node_clients_missing
from mcp_ha.ops.check.shape import Call, Shape
from mcp_ha.ops.stack import Stack, StackConfig, StackError, running_stack
from tools.bench import (
    MarkdownError,
    Section,
    check_markers,
    markdown_option,
    markers,
    md_escape,
    md_table,
    provenance,
    rich_table,
    write_between_markers,
)

REPLICA_SCENARIOS = ("kill", "pause", "rolling", "restart-all")
REDIS_SCENARIOS = ("redis-kill", "redis-restart", "redis-outage")
CLUSTER_SLOTS = 16384
# What redis-move moves: about a third of a primary's slots, under load.
MOVED_SLOTS = 2000
BALANCER_SCENARIOS = ("haproxy-kill",)
SCENARIOS = REPLICA_SCENARIOS + REDIS_SCENARIOS + BALANCER_SCENARIOS
# Only on a Redis Cluster (--redis cluster), where `all` runs it too; a Redis fault like the others.
CLUSTER_SCENARIOS = ("redis-move",)
REDIS_FAULTS = REDIS_SCENARIOS + CLUSTER_SCENARIOS
# The load alone, no fault: the baseline every client must pass clean (not part of "all").
BASELINE = "none"

# The clients' timeouts and bounds (PLAIN_CALL_TIMEOUT, STOCK_CALL_BOUND, RESILIENT_SETTINGS,
# GUARD_SLACK_SECONDS) and the load's think time and tail (TAIL_SECONDS) are the HA check's:
# mcp_ha/ops/check/clients.py and load.py.

KILL_DOWN_SECONDS = 3.0
PAUSE_SECONDS = 4.0
REDIS_OUTAGE_SECONDS = 10.0
PROMOTION_TIMEOUT_SECONDS = 30.0
# However a scenario goes, its load stops this long after it was due to.
OVERRUN_CAP_SECONDS = 60.0
STATUS_POLL_SECONDS = 0.05

TARGET_LONGEST_CALL = 3.0
TARGET_STALL = 3.0
TARGET_MARK_DOWN = {"kill": 2.0, "pause": 3.0}
# The targets for a stock client (STOCK_KINDS) whose calls stream nothing, through a kill -9 of
# the replica serving most sessions: no call fails, none takes longer than this, and each session's
# counter is exactly the increments it was told about. Each miss says STOCK_TARGET.
STOCK_TARGET_SCENARIOS = (BASELINE, "kill")
STOCK_TARGET_LONGEST_CALL = 1.0
STOCK_TARGET = "stock-client target"

# `--markdown FILE` writes between <!-- failover:start --> and <!-- failover:end -->; a run on Sentinel or a
# cluster (--redis) between failover-sentinel's or failover-cluster's markers.
MARKDOWN_MARKERS = "failover"
# `--scenario redis`: every Redis fault the stack's Redis has.
REDIS_GROUP = "redis"


def markdown_markers(redis_mode: str) -> str:
    return MARKDOWN_MARKERS if redis_mode == "single" else f"{MARKDOWN_MARKERS}-{redis_mode}"


def scenarios_of(scenario: str, redis_mode: str) -> list[str]:
    """What `--scenario` runs: `all` every fault (a cluster's own too), `redis` the Redis faults."""
    cluster = list(CLUSTER_SCENARIOS) if redis_mode == "cluster" else []
    if scenario == "all":
        return [*SCENARIOS, *cluster]
    if scenario == REDIS_GROUP:
        return [*REDIS_SCENARIOS, *cluster]
    return [scenario]


log = logging.getLogger("failover_bench")


# -- the clients under test: the HA check's (mcp_ha/ops/check/clients.py) ---------------------

# The kinds that always run; the stock SDK clients (the TypeScript SDK's, the Python SDK's, FastMCP's
# in legacy mode) run too when asked for (run_scenario's `stock`, the command's default).
BASE_KINDS = ("plain", "resilient", "sessionless")
EXTRA_KINDS = ("ts_sdk", "python_sdk", "fastmcp_legacy")
KINDS = BASE_KINDS + EXTRA_KINDS
# The demo's counter, as the HA check's clients drive a server: increment_counter adds one.
DEMO = Shape(write=Call("increment_counter"), read=Call("get_counter"), count=lambda result: result["counter"])
# The TypeScript SDK (pinned in tests/clients/ts/package.json) as `make node-deps` installs it.
NODE_CLIENT_DIR = Path(__file__).resolve().parent.parent / "tests" / "clients" / "ts"


def node_client_missing() -> str | None:
    """Why the TypeScript SDK client cannot run here, or None when it can."""
    return node_clients_missing(NODE_CLIENT_DIR)


# -- what one run records ---------------------------------------------------------------


@dataclass
class ClientReport:
    kind: str
    sessions: int
    calls: int
    failed: int
    # Failed calls sent after HAProxy had taken the faulted replica out: none may fail.
    failed_after_detection: int
    overran: int  # calls that neither returned nor raised within their own timeout
    longest_call_s: float
    # The longest call that ended before the fault: what the machine's load alone made of a call, this run.
    longest_before_fault_s: float
    longest_stall_s: float
    acknowledged: int
    final: int | None  # summed over sessions; None when a session's counter could not be read
    lost: int
    duplicated: int
    unreadable: int
    working_after: int  # sessions answered after the stack was whole again
    exposed: int  # sessions on the faulted replica when the fault struck (any replica: a front-door fault)
    moved: int  # ... of which another replica answered afterwards
    new_sessions: int  # sessions a ResilientClient had to open anew (resumed state)
    errors: list[str]
    # Per session: (final counter, increments acknowledged); `inexact` counts those that differ (or unread).
    counters: list[tuple[int | None, int]] = field(default_factory=list)
    inexact: int = 0
    # Sessions whose final counter the client itself could no longer read (a raw client read it).
    final_read_raw: int = 0


@dataclass
class ScenarioReport:
    scenario: str
    replica: str
    sessions: int
    load_seconds: float
    fault_at_s: float
    fault_seconds: float  # from the fault until the stack was whole again
    mark_down_s: float | None  # from the fault until HAProxy no longer showed the replica UP
    back_up_s: float | None
    in_flight_at_fault: int  # plain calls under way at the fault moment, on any replica
    in_flight_on_replica: int  # ... of sessions the faulted replica was serving
    plain: ClientReport
    resilient: ClientReport
    sessionless: ClientReport
    healthy_after: bool
    backends_after: dict[str, str]
    redis_mode: str = "single"
    wait_replicas: int = 0  # the replicas' REDIS_WAIT_REPLICAS
    # The stock SDK clients (EXTRA_KINDS), when they ran.
    ts_sdk: ClientReport | None = None
    python_sdk: ClientReport | None = None
    fastmcp_legacy: ClientReport | None = None

    @property
    def clients(self) -> list[ClientReport]:
        """One report per client kind that ran, in KINDS order."""
        return [c for c in (getattr(self, kind) for kind in KINDS) if c is not None]


@dataclass
class RunStatus:
    """What the live display shows; run_scenario keeps it current."""

    scenario: str = ""
    phase: str = ""
    started: float = 0.0
    runs: list[SessionRun] = field(default_factory=list)
    backends: dict[str, str] = field(default_factory=dict)

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        log.info("%s: %s", self.scenario, phase)


async def _watch_backends(
    stack: Stack, timeline: list[tuple[float, dict[str, str]]], status: RunStatus, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        backends = await asyncio.to_thread(stack.backend_status)
        now = time.monotonic()
        status.backends = backends
        if not timeline or timeline[-1][1] != backends:
            timeline.append((now, backends))
        try:
            await asyncio.wait_for(stop.wait(), STATUS_POLL_SECONDS)
        except TimeoutError:
            pass


# -- faults -----------------------------------------------------------------------------


def _start_all(stack: Stack, names: list[str]) -> None:
    for name in names:
        stack.start(name, wait=False)
    for name in names:
        stack.wait_healthy(name)


def heal(stack: Stack) -> None:
    """Every replica running and UP in every HAProxy again, whatever a scenario left behind."""
    for name in stack.config.redis_names():
        stack.start(name)
    replicas = stack.config.replica_names()
    for name in replicas:
        if stack.state(name) == "paused":
            stack.signal(name, signal.SIGCONT)
    _start_all(stack, [name for name in replicas if stack.pid(name) is None])
    _start_all(stack, stack.config.balancer_names())


def busiest_balancer(stack: Stack) -> str:
    """The HAProxy holding the most client connections now (its MCP frontend's current sessions)."""

    def current(name: str) -> int:
        rows = stack.stats_rows(name)
        return next((int(r["scur"]) for r in rows if (r["pxname"], r["svname"]) == ("mcp", "FRONTEND")), -1)

    return max(stack.config.balancer_names(), key=current)


def _promoted(stack: Stack, old: str) -> bool:
    """Whether the sentinels name a primary other than `old`; False until they do (bounded)."""
    deadline = time.monotonic() + PROMOTION_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if stack.config.redis_mode == "cluster":
            # Every slot served again, by primaries that do not include the one killed.
            primaries = stack.cluster_primaries()
            if old not in primaries and sum(primaries.values()) == CLUSTER_SLOTS:
                return True
        elif stack.redis_primary() not in (old, None):
            return True
        time.sleep(0.05)
    return False


async def _inject(stack: Stack, scenario: str, replica: str, status: RunStatus) -> float:
    """Apply the fault and undo it; the monotonic time the fault struck."""
    struck = time.monotonic()
    if scenario in REDIS_FAULTS:
        await _inject_redis(stack, scenario, replica, status)
    else:
        await _inject_service(stack, scenario, replica, status)
    status.set_phase("waiting for HAProxy to see every replica UP")
    await asyncio.to_thread(stack.wait_healthy, "haproxy")
    return struck


async def _inject_redis(stack: Stack, scenario: str, primary: str, status: RunStatus) -> None:
    """A Redis fault (REDIS_FAULTS) of `primary`, and its undoing."""
    if scenario == "redis-kill":
        status.set_phase(f"SIGKILL {primary}")
        stack.signal(primary, signal.SIGKILL)
        if stack.config.redis_mode in ("sentinel", "cluster"):
            status.set_phase("waiting for a replica to be promoted")
            if not await asyncio.to_thread(_promoted, stack, primary):
                raise StackError(
                    f"no replica was promoted within {PROMOTION_TIMEOUT_SECONDS:.0f} s of killing {primary}"
                )
        else:
            await asyncio.sleep(KILL_DOWN_SECONDS)
        status.set_phase(f"starting {primary}")
        await asyncio.to_thread(stack.start, primary)
    elif scenario == "redis-move":
        if stack.config.redis_mode != "cluster":
            raise StackError("redis-move moves slots between a cluster's primaries: --redis cluster")
        target = next(n for n in stack.cluster_primaries() if n != primary)
        status.set_phase(f"moving {MOVED_SLOTS} slots from {primary} to {target}")
        await asyncio.to_thread(stack.move_slots, primary, target, MOVED_SLOTS)
    elif scenario == "redis-restart":
        status.set_phase(f"restarting {primary}")
        await asyncio.to_thread(stack.restart, primary)
    else:  # redis-outage
        servers = [n for n in stack.config.redis_names() if not n.startswith("sentinel-")]
        status.set_phase(f"stopping {', '.join(servers)} for {REDIS_OUTAGE_SECONDS:.0f} s")
        await asyncio.to_thread(stack.stop, *servers)
        await asyncio.sleep(REDIS_OUTAGE_SECONDS)
        status.set_phase(f"starting {', '.join(servers)}")
        # The primary first (the one the sentinels still name), so the other finds it.
        for name in sorted(servers, key=lambda n: n != primary):
            await asyncio.to_thread(stack.start, name)


async def _inject_service(stack: Stack, scenario: str, replica: str, status: RunStatus) -> None:
    """A fault of the replicas or of an HAProxy, and its undoing; none for the baseline."""
    replicas = stack.config.replica_names()
    if scenario in ("kill", "haproxy-kill"):  # a replica, or an HAProxy (run_scenario picked which)
        status.set_phase(f"SIGKILL {replica}")
        stack.signal(replica, signal.SIGKILL)
        await asyncio.sleep(KILL_DOWN_SECONDS)
        status.set_phase(f"starting {replica}")
        await asyncio.to_thread(stack.start, replica)
    elif scenario == "pause":
        status.set_phase(f"SIGSTOP {replica}")
        stack.signal(replica, signal.SIGSTOP)
        try:
            await asyncio.sleep(PAUSE_SECONDS)
        finally:
            status.set_phase(f"SIGCONT {replica}")
            stack.signal(replica, signal.SIGCONT)
    elif scenario == "rolling":
        for name in [replica, *(n for n in replicas if n != replica)]:
            status.set_phase(f"rolling restart: {name}")
            await asyncio.to_thread(stack.restart, name)
    elif scenario == "restart-all":
        status.set_phase("stopping every replica")
        await asyncio.to_thread(stack.stop, *replicas)
        status.set_phase("starting every replica")
        await asyncio.to_thread(_start_all, stack, replicas)
    elif scenario == BASELINE:
        status.set_phase("no fault")
    else:
        raise ValueError(f"unknown scenario {scenario!r}; one of {', '.join(SCENARIOS)}")


# -- reading the results ----------------------------------------------------------------


def _longest_stall(run: SessionRun, load_start: float, load_end: float) -> float:
    """The longest wait between two answered calls (a session that stopped being answered stalls till the end)."""
    ends = [load_start, *(c.end for c in run.calls if c.ok), load_end]
    return max(b - a for a, b in itertools.pairwise(ends))


def _client_report(
    kind: str,
    runs: list[SessionRun],
    *,
    replica: str,
    struck: float,
    over: float,
    load_start: float,
    load_end: float,
    detected: float | None,
) -> ClientReport:
    # The check's own figures (calls, longest, lost, doubled), and what only this benchmark reports.
    seen = figures(kind, runs, retries=ClientFactory.kind_class(kind).retries)
    calls = [c for r in runs for c in r.calls]
    counters = [(r.final, r.acknowledged) for r in runs]
    # A front-door fault strikes every session: did any lose its replica?
    front = replica.startswith("haproxy")
    exposed = [r for r in runs if (r.replica_at(struck) is not None if front else r.replica_at(struck) == replica)]
    moved = [
        r for r in exposed if any(c.ok and c.start >= struck and c.replica != r.replica_at(struck) for c in r.calls)
    ]
    return ClientReport(
        kind=kind,
        sessions=seen.sessions,
        calls=seen.calls,
        failed=seen.failed,
        failed_after_detection=sum(not c.ok and c.start > detected for c in calls) if detected else 0,
        overran=seen.overran,
        longest_call_s=seen.longest_call_s,
        longest_before_fault_s=round(max((c.end - c.start for c in calls if c.end < struck), default=0.0), 3),
        longest_stall_s=round(max((_longest_stall(r, load_start, load_end) for r in runs), default=0.0), 3),
        acknowledged=seen.acknowledged,
        final=seen.final,
        lost=seen.lost,
        duplicated=seen.doubled,
        unreadable=seen.unreadable,
        working_after=sum(any(c.ok and c.end >= over for c in r.calls) for r in runs),
        exposed=len(exposed),
        moved=len(moved),
        new_sessions=sum(r.new_sessions for r in runs),
        errors=seen.errors,
        counters=counters,
        inexact=sum(final != acknowledged for final, acknowledged in counters),
        final_read_raw=sum(r.final_read_raw for r in runs),
    )


def _first(
    timeline: list[tuple[float, dict[str, str]]], after: float, test: Callable[[str], bool], replica: str
) -> float | None:
    for t, backends in timeline:
        if t >= after and test(backends.get(replica, "")):
            return t
    return None


@dataclass
class Strike:
    """The fault as it struck: what it faulted, when, and the plain calls it caught in flight."""

    replica: str = ""
    struck: float = 0.0
    in_flight: int = 0  # on any replica
    in_flight_on_replica: int = 0  # ... of sessions `replica` was serving


async def run_scenario(
    stack: Stack,
    scenario: str,
    *,
    sessions: int = 5,
    duration: float = 8.0,
    fault_at: float = 2.0,
    status: RunStatus | None = None,
    stock: bool = False,
) -> ScenarioReport:
    """Run `sessions` sessions of each kind of client through one fault; what they saw.

    The kinds are BASE_KINDS, and with `stock` the stock SDK clients (EXTRA_KINDS) too, all at once.
    The load lasts `duration` seconds, or until the stack has been whole again
    for TAIL_SECONDS if that is later; never more than OVERRUN_CAP_SECONDS past that.
    """
    _check_scenario(stack, scenario)
    status = status or RunStatus()
    status.scenario = scenario
    url = stack.config.mcp_url
    kinds = KINDS if stock else BASE_KINDS
    factory = ClientFactory(url, node_clients=NODE_CLIENT_DIR)
    clients = [factory.new(kind) for kind in kinds for _ in range(sessions)]
    pairs = [(c, SessionRun(c.kind)) for c in clients]
    status.runs = [r for _, r in pairs]
    timeline: list[tuple[float, dict[str, str]]] = []
    try:
        status.set_phase("opening sessions and warming up")
        await open_and_read(clients, DEMO)
        fault, span = await _load(stack, scenario, pairs, timeline, status, duration=duration, fault_at=fault_at)
        status.set_phase("reading final counters")
        await asyncio.to_thread(stack.wait_healthy, "haproxy")
        async with asyncio.timeout(60):
            await asyncio.gather(*(read_final(c, r, url, DEMO) for c, r in pairs))
    finally:
        status.set_phase("making sure every replica is running and UP")
        await asyncio.to_thread(heal, stack)
        status.set_phase("closing sessions")
        await close_all([c.aclose for c in clients])
        await factory.__aexit__(None, None, None)
    report = await _scenario_report(stack, scenario, sessions, kinds, status.runs, fault, span, timeline)
    status.set_phase("done")
    return report


def _check_scenario(stack: Stack, scenario: str) -> None:
    if scenario not in (*SCENARIOS, *CLUSTER_SCENARIOS, BASELINE):
        raise ValueError(f"unknown scenario {scenario!r}; one of {', '.join(SCENARIOS)}, {BASELINE}")
    if scenario in BALANCER_SCENARIOS and len(stack.config.balancer_names()) < 2:
        raise StackError(f"{scenario} needs two HAProxy processes: start the stack with MCP_BALANCERS=2")


async def _load(
    stack: Stack,
    scenario: str,
    pairs: list[tuple[CheckClient, SessionRun]],
    timeline: list[tuple[float, dict[str, str]]],
    status: RunStatus,
    *,
    duration: float,
    fault_at: float,
) -> tuple[Strike, LoadSpan]:
    """The HA check's load through the fault (load_with_fault), with HAProxy's view of the replicas
    watched throughout, into `timeline`."""
    fault = Strike()
    plain_runs = [r for _, r in pairs if r.kind == "plain"]
    watch_stop = asyncio.Event()
    status.started = time.monotonic()
    watcher = asyncio.create_task(_watch_backends(stack, timeline, status, watch_stop))
    try:
        span = await load_with_fault(
            pairs,
            DEMO,
            partial(_strike, stack, scenario, plain_runs, status, fault),
            fault_at=fault_at,
            duration=duration,
            say=status.set_phase,
        )
    finally:
        watch_stop.set()
        await watcher
    return fault, span


async def _faulted(stack: Stack, scenario: str, plain_runs: list[SessionRun], at: float) -> str:
    """What `scenario` faults: Redis's primary, the HAProxy holding most connections, or the replica
    serving most plain sessions at `at` (of a tie, the first)."""
    if scenario in REDIS_FAULTS:
        return stack.redis_primary() or stack.config.redis_names()[0]
    if scenario in BALANCER_SCENARIOS:
        return await asyncio.to_thread(busiest_balancer, stack)
    if scenario == BASELINE:
        return "(none)"
    serving = Counter(r.replica_at(at) for r in plain_runs)
    serving.pop(None, None)
    replicas = stack.config.replica_names()
    return max(replicas, key=lambda n: (serving.get(n, 0), -replicas.index(n)))


async def _strike(stack: Stack, scenario: str, plain_runs: list[SessionRun], status: RunStatus, fault: Strike) -> None:
    """Pick what to fault, note the plain calls in flight, then inject the fault and undo it, into `fault`."""
    at = time.monotonic()
    fault.replica = await _faulted(stack, scenario, plain_runs, at)
    in_flight = [r for r in plain_runs if r.in_flight]
    fault.in_flight = len(in_flight)
    fault.in_flight_on_replica = sum(r.replica_at(at) == fault.replica for r in in_flight)
    async with asyncio.timeout(OVERRUN_CAP_SECONDS):
        fault.struck = await _inject(stack, scenario, fault.replica, status)


async def _scenario_report(
    stack: Stack,
    scenario: str,
    sessions: int,
    kinds: tuple[str, ...],
    runs: list[SessionRun],
    fault: Strike,
    span: LoadSpan,
    timeline: list[tuple[float, dict[str, str]]],
) -> ScenarioReport:
    """What the clients saw, when HAProxy took the faulted replica out and back, and the stack after."""
    # Redis faults take no replica out on purpose: a replica rides out a failover (see server.StoreHealth).
    mark_down = (
        None
        if scenario in REDIS_FAULTS + BALANCER_SCENARIOS
        else _first(timeline, fault.struck, lambda s: not s.startswith("UP"), fault.replica)
    )
    back_up = _first(timeline, mark_down, lambda s: s.startswith("UP"), fault.replica) if mark_down else None
    backends_after = await asyncio.to_thread(stack.backend_status)
    healthy = all(stack.state(svc.name) == "running" for svc in stack.services()) and backends_after == dict.fromkeys(
        stack.config.replica_names(), "UP"
    )
    client_report = partial(
        _client_report,
        replica=fault.replica,
        struck=fault.struck,
        over=span.over,
        load_start=span.start,
        load_end=span.end,
        detected=mark_down,
    )
    return ScenarioReport(
        scenario=scenario,
        replica=fault.replica,
        sessions=sessions,
        load_seconds=round(span.end - span.start, 2),
        fault_at_s=round(fault.struck - span.start, 2),
        fault_seconds=round(span.over - fault.struck, 2),
        mark_down_s=None if mark_down is None else round(mark_down - fault.struck, 3),
        back_up_s=None if back_up is None else round(back_up - fault.struck, 3),
        in_flight_at_fault=fault.in_flight,
        in_flight_on_replica=fault.in_flight_on_replica,
        **{kind: client_report(kind, [r for r in runs if r.kind == kind]) for kind in kinds},
        healthy_after=healthy,
        backends_after=backends_after,
        redis_mode=stack.config.redis_mode,
        wait_replicas=stack.config.redis_wait_replicas,
    )


# -- targets ----------------------------------------------------------------------------


# Each target as (holds, what it says when it does not); check_targets keeps the sentences of those missed.
Targets = Iterator[tuple[bool, str]]


def check_targets(report: ScenarioReport) -> list[str]:
    """The targets `report` misses, each as a sentence; empty when all hold."""
    s = report.scenario
    targets = itertools.chain(
        _session_targets(report),
        _baseline_targets(report) if s == BASELINE else (),
        _stock_targets(report) if s in STOCK_TARGET_SCENARIOS else (),
        _balancer_targets(report) if s in BALANCER_SCENARIOS else (),
        _recovery_targets(report),
    )
    return [f"{s}: {what}" for holds, what in targets if not holds]


def _session_targets(report: ScenarioReport) -> Targets:
    """Every kind, whatever the fault: each session's counter read, none lost or doubled, every call over
    within its bound, every session working afterwards."""
    # Killing Sentinel's primary can lose what it had not yet passed on to the replica it promotes, unless
    # every write waited for one (REDIS_WAIT_REPLICAS): then nothing acknowledged may be lost. A lone
    # Redis killed keeps everything (it writes each change to its AOF before answering), and the other
    # faults stop Redis with SIGTERM, after which it has written its AOF out.
    loss_allowed = report.scenario == "redis-kill" and report.redis_mode != "single" and report.wait_replicas == 0
    for c in report.clients:
        k = c.kind
        yield c.unreadable == 0, f"{k}: the final counter of {c.unreadable} session(s) could not be read"
        yield (
            c.lost == 0 or loss_allowed,
            f"{k}: {c.lost} acknowledged increment(s) lost (final {c.final}, acknowledged {c.acknowledged})",
        )
        yield (
            c.duplicated == 0,
            f"{k}: {c.duplicated} increment(s) applied twice (final {c.final}, "
            f"acknowledged {c.acknowledged}, failed {c.failed})",
        )
        within = (
            f"the benchmark's bound ({ClientFactory.kind_class(k).bound + GUARD_SLACK_SECONDS:g} s)"
            if k in EXTRA_KINDS
            else "their timeout"
        )
        yield c.overran == 0, f"{k}: {c.overran} call(s) neither returned nor raised within {within}"
        yield (
            c.working_after == c.sessions,
            f"{k}: only {c.working_after} of {c.sessions} sessions worked after the fault",
        )
        yield c.calls > 0 and c.acknowledged > 0, f"{k}: no call was answered at all"


def _baseline_targets(report: ScenarioReport) -> Targets:
    """With no fault, the kinds not held to STOCK_TARGET: no failed call, exact counters."""
    for c in report.clients:
        if c.kind in STOCK_KINDS:
            continue  # held to STOCK_TARGET
        yield c.failed == 0, f"{c.kind}: {c.failed} failed call(s) with no fault (target 0): {'; '.join(c.errors)}"
        yield c.inexact == 0, f"{c.kind}: counters not exact with no fault: (final, acknowledged) {c.counters}"


def _stock_targets(report: ScenarioReport) -> Targets:
    """STOCK_TARGET for each stock client: no failed call, none over STOCK_TARGET_LONGEST_CALL, exact counters."""
    for c in report.clients:
        if c.kind not in STOCK_KINDS:
            continue
        k = c.kind
        yield c.failed == 0, f"{k}: {c.failed} failed call(s) ({STOCK_TARGET} 0): {'; '.join(c.errors)}"
        yield (
            c.longest_call_s <= STOCK_TARGET_LONGEST_CALL,
            f"{k}: a call took {c.longest_call_s:.2f} s ({STOCK_TARGET} ≤ {STOCK_TARGET_LONGEST_CALL:g} s)",
        )
        yield (
            c.inexact == 0,
            f"{k}: {c.inexact} of {c.sessions} session(s) whose counter is not the increments acknowledged "
            f"({STOCK_TARGET} exact): (final, acknowledged) {c.counters}",
        )


def _balancer_targets(report: ScenarioReport) -> Targets:
    """An HAProxy killed: every session stays on its replica, and loses its call in flight at most."""
    for c in report.clients:
        if c.kind == "sessionless":
            continue  # no session to keep: each request goes to the next replica anyway
        yield (
            c.moved == 0,
            f"{c.kind}: {c.moved} of {c.exposed} sessions were answered by another replica after "
            f"{report.replica} died (target 0: the other HAProxy knows every session's replica)",
        )
        # One call at a time per session: a stock client may lose the one in flight on the dead HAProxy.
        yield (
            c.failed <= c.sessions,
            f"{c.kind}: {c.failed} failed call(s), more than its {c.sessions} session(s) had in flight",
        )


def _recovery_targets(report: ScenarioReport) -> Targets:
    """ResilientClient fails no call and the stack is whole afterwards; but for Redis faults, calls and
    stalls are short, and a replica's fault is over quickly for the clients with no retries of their own."""
    s = report.scenario
    r = report.resilient
    yield r.failed == 0, f"resilient: {r.failed} failed call(s) (target 0): {'; '.join(r.errors)}"
    yield report.healthy_after, f"the stack was not whole afterwards: {report.backends_after}"
    if s in REDIS_FAULTS:
        # Reported, not targets: how long calls wait depends on how long Redis is gone.
        return
    yield (
        r.longest_call_s <= TARGET_LONGEST_CALL,
        f"resilient: a call took {r.longest_call_s:.2f} s (target ≤ {TARGET_LONGEST_CALL:.0f} s)",
    )
    p = report.plain
    yield (
        p.longest_stall_s < TARGET_STALL,
        f"plain: a session stalled {p.longest_stall_s:.2f} s (target < {TARGET_STALL:.0f} s)",
    )
    # The clients with no retries of their own (plain, sessionless) see what HAProxy cannot rescue for them.
    unretried = [c for c in report.clients if not ClientFactory.kind_class(c.kind).retries]
    if s in ("kill", "pause"):
        yield from _detection_targets(report, unretried)
    elif s == "rolling":
        for c in unretried:
            yield (
                c.failed == 0,
                f"{c.kind}: {c.failed} failed call(s) in a rolling restart (target 0): {'; '.join(c.errors)}",
            )


def _detection_targets(report: ScenarioReport, unretried: list[ClientReport]) -> Targets:
    """A replica killed or hung: HAProxy takes it out in time, and nothing sent after that fails."""
    # The calls a fault can catch in flight are those under way between the fault and the moment
    # HAProxy knows of it (a dead replica: tens of ms; a hung one: about 2.6 s). Such a client has
    # one call under way at a time, and one the fault catches may be followed, within that window,
    # by the session's next call; a call sent once HAProxy has taken the replica out must not fail.
    for c in unretried:
        yield (
            c.failed_after_detection == 0,
            f"{c.kind}: {c.failed_after_detection} call(s) sent after HAProxy "
            f"took {report.replica} out failed: {'; '.join(c.errors)}",
        )
    p = report.plain
    yield (
        p.moved == p.exposed,
        f"plain: {p.exposed - p.moved} of {p.exposed} sessions on {report.replica} "
        "were not answered by another replica",
    )
    limit = TARGET_MARK_DOWN[report.scenario]
    yield (
        report.mark_down_s is not None and report.mark_down_s <= limit,
        f"HAProxy took {report.mark_down_s} s to take {report.replica} out (target ≤ {limit:.0f} s)",
    )


# -- command line -----------------------------------------------------------------------


# Piped output would otherwise wrap the results table at 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)


class LiveView:
    def __init__(self, status: RunStatus, index: int, total: int) -> None:
        self.status = status
        self.index = index
        self.total = total

    def __rich__(self) -> Table:
        s = self.status
        elapsed = time.monotonic() - s.started if s.started else 0.0
        table = Table(
            title=f"[{self.index}/{self.total}] {s.scenario}: {s.phase}  ({elapsed:.1f} s)", title_justify="left"
        )
        for column in ("client", "sessions", "calls", "ok", "failed", "in flight"):
            table.add_column(column, justify="right" if column != "client" else "left")
        for kind in KINDS:
            runs = [r for r in s.runs if r.kind == kind]
            if not runs:
                continue
            calls = sum(len(r.calls) for r in runs)
            failed = sum(r.failed for r in runs)
            table.add_row(
                kind,
                str(len(runs)),
                str(calls),
                str(calls - failed),
                f"[red]{failed}[/red]" if failed else "0",
                str(sum(r.in_flight for r in runs)),
            )
        backends = "  ".join(
            f"{n}: {'[green]' if v.startswith('UP') else '[red]'}{v}[/]" for n, v in sorted(s.backends.items())
        )
        table.caption = backends or "HAProxy: (no answer)"
        table.caption_justify = "left"
        return table


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def results_section(reports: list[ScenarioReport]) -> Section:
    """The figures of every scenario, one row per kind of client (and one for the stack's own misses)."""
    columns = [
        "scenario",
        "faulted",
        "client",
        "calls",
        "failed",
        "in flight\nat fault",
        "sessions\non faulted",
        "longest\ncall s",
        "longest\nstall s",
        "marked\ndown s",
        "final / acked",
        "lost",
        "dup",
        "sessions\nexact",
        "targets",
    ]
    rows = []
    for report in reports:
        missed = check_targets(report)
        for c in report.clients:
            mine = [m for m in missed if f": {c.kind}:" in m]
            first = c.kind == KINDS[0]
            rows.append(
                [
                    report.scenario if first else "",
                    report.replica if first else "",
                    c.kind,
                    str(c.calls),
                    str(c.failed),
                    str(report.in_flight_at_fault) if first else "",
                    str(c.exposed),
                    f"{c.longest_call_s:.2f}",
                    f"{c.longest_stall_s:.2f}",
                    _seconds(report.mark_down_s) if first else "",
                    f"{'?' if c.final is None else c.final} / {c.acknowledged}",
                    str(c.lost),
                    str(c.duplicated),
                    f"{c.sessions - c.inexact}/{c.sessions}",
                    "met" if not mine else f"{len(mine)} missed",
                ]
            )
        stack_missed = [m for m in missed if not any(f": {kind}:" in m for kind in KINDS)]
        if stack_missed:
            rows.append(["", "", "stack", *[""] * (len(columns) - 4), f"{len(stack_missed)} missed"])
    caption = (
        "in flight at fault: plain calls under way at the fault instant, on any replica. "
        "marked down: seconds until HAProxy took the (first) faulted replica out. "
        "sessions exact: sessions whose final counter is exactly the increments acknowledged."
    )
    return Section("Failover benchmark", columns, rows, caption, left=("scenario", "faulted", "client", "targets"))


def results_table(reports: list[ScenarioReport]) -> Table:
    return rich_table(results_section(reports), show_lines=True)


def markdown_report(reports: list[ScenarioReport]) -> str:
    first = reports[0]
    redis = first.redis_mode + (f", REDIS_WAIT_REPLICAS={first.wait_replicas}" if first.redis_mode != "single" else "")
    setup = (
        f"{first.sessions} sessions of each kind of client ({', '.join(c.kind for c in first.clients)}) through "
        f"HAProxy, each calling increment_counter in a loop; Redis: {redis}. Plain and sessionless calls time "
        f"out after {PLAIN_CALL_TIMEOUT:g} s; ResilientClient: "
        + ", ".join(f"{k} {v:g}" for k, v in RESILIENT_SETTINGS.items())
        + (
            f"; the other stock clients keep their defaults, a call of theirs with no outcome after "
            f"{STOCK_CALL_BOUND + GUARD_SLACK_SECONDS:g} s is counted failed."
            if any(c.kind in EXTRA_KINDS for c in first.clients)
            else "."
        )
    )
    bounds = (
        f"Targets: a resilient call takes at most {TARGET_LONGEST_CALL:g} s, no plain session stalls "
        f"{TARGET_STALL:g} s, HAProxy takes the faulted replica out within "
        + ", ".join(f"{v:g} s ({k})" for k, v in TARGET_MARK_DOWN.items())
        + "; no acknowledged increment is lost and none applied twice; through a kill, a stock client "
        f"({', '.join(STOCK_KINDS)}) sees no failed call, none over {STOCK_TARGET_LONGEST_CALL:g} s, and "
        "exact counters (see check_targets)."
    )
    missed = [m for r in reports for m in check_targets(r)]
    verdict = ["Every target met."] if not missed else ["Targets not met:", "", *(f"- {md_escape(m)}" for m in missed)]
    return "\n\n".join(
        [
            provenance("tools.failover_bench"),
            md_escape(setup),
            md_table(results_section(reports)),
            md_escape(bounds),
            "\n".join(verdict),
        ]
    )


async def run_all(
    stack: Stack,
    scenarios: list[str],
    reports: list[ScenarioReport],
    *,
    sessions: int,
    duration: float,
    fault_at: float,
    live: bool = True,
    stock: bool = False,
) -> None:
    """Run each scenario in turn, adding its report to `reports` as soon as it is in."""
    for index, scenario in enumerate(scenarios, start=1):
        status = RunStatus(scenario=scenario)
        view = LiveView(status, index, len(scenarios))
        with Live(view, console=console, refresh_per_second=4, transient=True) if live else nullcontext():
            report = await run_scenario(
                stack, scenario, sessions=sessions, duration=duration, fault_at=fault_at, status=status, stock=stock
            )
        missed = check_targets(report)
        mark = "[green]✔[/green]" if not missed else "[red]✘[/red]"
        failed = ", ".join(f"{c.kind} {c.failed}/{c.calls} failed" for c in report.clients)
        console.print(f"{mark} {scenario}: {report.replica} faulted, load {report.load_seconds:.1f} s, {failed}")
        reports.append(report)


def report_json(reports: list[ScenarioReport]) -> dict:
    scenarios = [{**asdict(r), "targets_missed": check_targets(r)} for r in reports]
    return {
        "targets": {
            "resilient_longest_call_s": TARGET_LONGEST_CALL,
            "plain_longest_stall_s": TARGET_STALL,
            "mark_down_s": TARGET_MARK_DOWN,
            "resilient_client": RESILIENT_SETTINGS,
            "plain_call_timeout_s": ClientFactory.kind_class("plain").bound,
            "sessionless_call_timeout_s": SessionlessClient.bound,
            "stock_call_bound_s": STOCK_CALL_BOUND + GUARD_SLACK_SECONDS,
            "stock_kinds": list(STOCK_KINDS),
            "stock_longest_call_s": STOCK_TARGET_LONGEST_CALL,
            "stock_target_scenarios": list(STOCK_TARGET_SCENARIOS),
        },
        "scenarios": scenarios,
        "ok": all(not s["targets_missed"] for s in scenarios),
    }


@click.command()
@click.option(
    "--scenario",
    type=click.Choice([*SCENARIOS, *CLUSTER_SCENARIOS, BASELINE, REDIS_GROUP, "all"]),
    default="all",
    show_default=True,
    help=f"Which fault to inject ({BASELINE}: the load alone; not part of all; {REDIS_GROUP}: every Redis fault).",
)
@click.option(
    "--sessions",
    type=click.IntRange(1, 50),
    default=5,
    show_default=True,
    help="Sessions of each kind of client.",
)
@click.option(
    "--stock/--no-stock",
    default=True,
    show_default=True,
    help="Also drive the stock SDK clients: the TypeScript SDK's (Node; make node-deps), the Python SDK's "
    "ClientSession and FastMCP's Client in legacy mode.",
)
@click.option(
    "--duration",
    type=click.FloatRange(3, 300),
    default=8.0,
    show_default=True,
    help=f"Seconds of load per scenario, at least; it goes on until the stack is whole again, plus {TAIL_SECONDS} s.",
)
@click.option(
    "--fault-at",
    type=click.FloatRange(0.5, 60),
    default=2.0,
    show_default=True,
    help="Seconds into the load when the fault strikes.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the reports to this file as JSON.",
)
@click.option(
    "--own-stack", is_flag=True, help="Start a stack of its own on free loopback ports, and stop it at the end."
)
@click.option(
    "--redis",
    "redis_mode",
    type=click.Choice(["single", "sentinel", "cluster"]),
    default="single",
    show_default=True,
    help="With --own-stack: one Redis; a primary, a replica and three sentinels; or a Redis Cluster of six nodes.",
)
@click.option(
    "--wait-replicas",
    type=click.IntRange(0, 1),
    default=0,
    show_default=True,
    help="With --own-stack: the replicas' REDIS_WAIT_REPLICAS (1 needs --redis sentinel or cluster).",
)
@markdown_option(MARKDOWN_MARKERS)
@click.option("-v", "--verbose", is_flag=True, help="Log each phase and every client retry.")
def main(
    scenario: str,
    sessions: int,
    stock: bool,
    duration: float,
    fault_at: float,
    json_path: Path | None,
    own_stack: bool,
    redis_mode: str,
    wait_replicas: int,
    markdown_path: Path | None,
    verbose: bool,
) -> None:
    """Inject replica faults under steady load and measure what clients see."""
    # Retries and broken connections are the point of the run, not news: the table counts them.
    logging.basicConfig(
        level=logging.INFO if verbose else logging.CRITICAL, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if wait_replicas and redis_mode == "single":
        raise click.UsageError("--wait-replicas 1 needs --redis sentinel or cluster: a lone Redis has no replica")
    if stock and (why := node_client_missing()):
        click.echo(
            f"error: the TypeScript SDK client cannot run: {why}; or leave the stock clients out: --no-stock", err=True
        )
        sys.exit(2)
    # Two HAProxys only for the front-door fault: see StackConfig.stats_ports.
    balancers = 2 if scenario in ("haproxy-kill", "all") else 1
    stack, state_dir = bench_stack(own_stack, redis_mode, wait_replicas, balancers, markdown_path)
    # A running stack's Redis is whatever it was started with.
    redis_mode = stack.config.redis_mode
    scenarios = scenarios_of(scenario, redis_mode)
    reports: list[ScenarioReport] = []
    broken: StackError | None = None
    try:
        asyncio.run(
            run_all(
                stack,
                scenarios,
                reports,
                sessions=sessions,
                duration=duration,
                fault_at=fault_at,
                live=console.is_terminal,
                stock=stock,
            )
        )
    except StackError as exc:
        broken = exc
    finally:
        if state_dir is not None:
            kept = broken or len(reports) < len(scenarios) or any(check_targets(r) for r in reports)
            stop_own_stack(stack, state_dir, keep_logs=bool(kept))
    complete = broken is None and len(reports) == len(scenarios)
    show(reports, json_path, markdown_path if complete else None, markdown_markers(redis_mode))
    if markdown_path is not None and not complete:
        click.echo(f"not every scenario ran, so {markdown_path} is left as it was", err=True)
    verdict(reports, broken)


def bench_stack(
    own_stack: bool, redis_mode: str, wait_replicas: int, balancers: int, markdown_path: Path | None
) -> tuple[Stack, Path | None]:
    """The stack to run against and, when it is the benchmark's own (started here, once `markdown_path`
    has the markers its Redis writes between), its state dir; exit 2 when there is none."""
    state_dir: Path | None = None
    stack: Stack | None = None
    try:
        if own_stack:
            state_dir = Path(tempfile.mkdtemp(prefix="failover-bench-"))
            stack = Stack(
                StackConfig.on_free_ports(
                    state_dir, redis_mode=redis_mode, redis_wait_replicas=wait_replicas, balancers=balancers
                )
            )
        else:
            stack = running_stack()
        if markdown_path is not None:
            try:
                check_markers(markdown_path, markdown_markers(stack.config.redis_mode))
            except MarkdownError as exc:
                if state_dir is not None:
                    shutil.rmtree(state_dir, ignore_errors=True)
                raise click.BadParameter(str(exc), param_hint="--markdown") from None
        if own_stack:
            with console.status(f"starting a stack of its own in {state_dir}"):
                stack.up()
    except StackError as exc:
        click.echo(f"error: {exc}", err=True)
        if own_stack and stack is not None:
            stack.down()  # whatever of it did start
        sys.exit(2)
    return stack, state_dir


def stop_own_stack(stack: Stack, state_dir: Path, *, keep_logs: bool) -> None:
    """Stop the benchmark's own stack; its logs are kept when anything went wrong, else its state dir goes."""
    with console.status("stopping the benchmark's stack"):
        stack.down()
    if keep_logs:
        console.print(f"the stack's logs are kept in {stack.log_dir}")
    else:
        shutil.rmtree(state_dir, ignore_errors=True)


def show(reports: list[ScenarioReport], json_path: Path | None, markdown_path: Path | None, block: str) -> None:
    """The results table, and the reports as JSON and, between `block`'s markers, markdown where asked for;
    exit 2 when the markdown file cannot be written."""
    console.print(results_table(reports))
    if json_path is not None:
        json_path.write_text(json.dumps(report_json(reports), indent=2))
        console.print(f"reports written to {json_path}")
    if markdown_path is not None:
        try:
            write_between_markers(markdown_path, block, markdown_report(reports))
        except MarkdownError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        console.print(f"figures written into {markdown_path}, between {' and '.join(markers(block))}")


def verdict(reports: list[ScenarioReport], broken: StackError | None) -> None:
    """Exit 2 for a stack that broke during the run, 1 for a target missed (each listed)."""
    if broken is not None:
        click.echo(f"error: the stack failed during the run: {broken}", err=True)
        sys.exit(2)
    missed = [m for r in reports for m in check_targets(r)]
    if missed:
        console.print("[red]targets not met:[/red]")
        for m in missed:
            console.print(f"  - {m}", markup=False)
        sys.exit(1)
    console.print("[green]every target met[/green]")


if __name__ == "__main__":
    main()
