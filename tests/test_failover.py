"""The failover benchmark's faults, on real processes, held to the issue's targets.

Each scenario runs once (5 plain, 5 ResilientClient and 5 sessionless FastMCP
Client sessions under steady load through HAProxy) on a stack of this module's
own; the tests read its report. Where a target does not hold for a reason
outside the benchmark, the main test leaves that one target out (KNOWN_GAPS);
a strict xfail test asserts each (or, where it fails only now and then, its
cause), so the suite notices the day it starts to hold.

The kill run, and a run with no fault, also drive the stock clients nobody here
wrote, at their defaults and with no retries of ours (5 sessions each): the
TypeScript SDK's Client (mcp_ha/ops/check/ts_client.mjs), the Python
SDK's ClientSession, and FastMCP's Client in legacy mode beside its default
(sessionless). One test per stock client holds it to the issue's targets for
calls that stream nothing; the others leave those targets (STOCK_TARGET) to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from conftest import ROOT, running_stack, starts

from mcp_ha.ops.stack import Stack
from mcp_ha.resilient_client import ResilientClient
from tools import failover_bench as bench

# The load runs until the stack is whole again (plus a tail) whatever this is;
# a short minimum keeps the four scenarios near a minute and a half together.
DURATION = 4.0
SESSIONS = 5
# HAProxy's pause before it re-sends a request whose connection failed (haproxy.cfg: `timeout connect`).
RESEND_PAUSE_S = int(re.search(r"timeout connect (\d+)ms", (ROOT / "haproxy" / "haproxy.cfg").read_text())[1]) / 1000

# Targets missed for reasons outside the benchmark; a strict xfail test below asserts each,
# so the suite notices the day it starts to hold.
KNOWN_GAPS = {
    # Now and then (the README: about 1 kill run in 8) the fault catches a resilient call whose answer
    # had begun to stream; it then waits out its own timeout before its retry
    # (test_a_resilient_call_caught_mid_stream_by_a_hung_replica_ends_within_3_s).
    "kill": ("kill: resilient: a call took",),
    "pause": ("pause: resilient: a call took",),
    "restart-all": (
        # Every replica down at once: nothing answers for as long as the replicas take to start.
        "restart-all: plain: a session stalled",
        "restart-all: resilient: a call took",
        # Now and then (4 runs in 22 here) a connection is closed with no answer while every
        # replica stops; the sessionless FastMCP client that gets it never works again
        # (test_an_sdk_client_works_again_after_one_dropped_connection).
        "restart-all: sessionless: only",
    ),
    "haproxy-kill": (
        # The HAProxy killed takes the connections it held with it. A client on the MCP Python SDK whose
        # connection that was never works again (test_an_sdk_client_works_again_after_one_dropped_connection):
        # its ClientSession, and FastMCP's Client in both modes. The others lose at most the call in flight.
        "haproxy-kill: sessionless: only",
        "haproxy-kill: fastmcp_legacy: ",
        "haproxy-kill: python_sdk: ",
    ),
}

# The runs that drive the stock SDK clients too (all kinds in one run: a scenario costs ~20 s).
STOCK_RUNS = ("kill", bench.BASELINE, "haproxy-kill")

_reports: dict[str, bench.ScenarioReport] = {}


@pytest.fixture(scope="module")
@starts("redis", "haproxy", "slow")
def fault_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack for these tests alone: they kill, pause and restart its replicas."""
    with running_stack(tmp_path_factory.mktemp("failover")) as s:
        yield s


@pytest.fixture(scope="module")
@starts("redis", "haproxy", "slow")
def pair_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The same behind two HAProxys on one port, sharing their session table: one of them is killed."""
    with running_stack(tmp_path_factory.mktemp("failover-pair"), balancers=2) as s:
        # The first HAProxy reaches the second's peer port only on its second try, 5 s after it started
        # (HAProxy's peer reconnect, docs/deploy.md): until then a session is in one table only.
        time.sleep(6)
        yield s


async def report_of(stack: Stack, scenario: str) -> bench.ScenarioReport:
    # Several tests read one scenario's figures; the faults are too slow to inject twice.
    if scenario not in _reports:
        stock = scenario in STOCK_RUNS
        if stock:
            assert bench.node_client_missing() is None, bench.node_client_missing()
        _reports[scenario] = await bench.run_scenario(
            stack, scenario, sessions=SESSIONS, duration=DURATION, stock=stock
        )
    return _reports[scenario]


def missed_apart_from_known_gaps(report: bench.ScenarioReport) -> list[str]:
    """The targets missed, but for KNOWN_GAPS and the stock clients' own (test_a_stock_client_... asserts those)."""
    known = KNOWN_GAPS.get(report.scenario, ())
    return [m for m in bench.check_targets(report) if not m.startswith(known) and bench.STOCK_TARGET not in m]


def assert_counts_are_exact(report: bench.ScenarioReport) -> None:
    r = report.resilient
    assert r.failed == 0 and r.final == r.acknowledged, r
    # A client with no retries of its own cannot know whether a failed call was applied: at most once each.
    for c in (report.plain, report.sessionless):
        assert c.final is not None and c.acknowledged <= c.final <= c.acknowledged + c.failed, c
    assert all(c.calls > 50 for c in report.clients), "the load did not run"


def assert_stack_is_whole(stack: Stack) -> None:
    names = stack.config.replica_names()
    assert [stack.state(n) for n in names] == ["running"] * len(names)
    assert stack.backends_up() == set(names)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", ["kill", "pause"])
async def test_kill_9_or_sigstop_of_the_sessions_replica(fault_stack: Stack, scenario: str) -> None:
    report = await report_of(fault_stack, scenario)
    # For a pause this includes the plain sessions' stall under 3 s (HAProxy cuts the calls stuck
    # on the hung replica when it takes it out, and re-sends them to the adopter).
    assert missed_apart_from_known_gaps(report) == []
    # A resilient call the fault caught mid-stream ends after at most its own timeout and one retry.
    assert report.resilient.longest_call_s <= 2 * bench.RESILIENT_SETTINGS["call_timeout"] + 1
    assert_counts_are_exact(report)
    assert report.mark_down_s is not None and report.mark_down_s <= bench.TARGET_MARK_DOWN[scenario]
    # The plain sessions the faulted replica served were answered by another one afterwards,
    # under the same session id.
    assert report.plain.exposed >= 1 and report.plain.moved == report.plain.exposed
    # Sessionless calls, pinned nowhere, lean on HAProxy's re-sends and their idempotency key alone.
    s = report.sessionless
    assert (s.lost, s.duplicated, s.failed_after_detection, s.unreadable) == (0, 0, 0, 0), s
    assert_stack_is_whole(fault_stack)


@pytest.mark.timeout(120)
async def test_every_client_kind_without_a_fault_fails_no_call_and_keeps_exact_counts(fault_stack: Stack) -> None:
    """The plumbing: with no fault, each kind of client (the stock SDK clients too) is answered every time,
    and each session's counter is the increments it was told about."""
    report = await report_of(fault_stack, bench.BASELINE)
    assert [c.kind for c in report.clients] == list(bench.KINDS)
    assert bench.check_targets(report) == []
    for c in report.clients:
        assert c.failed == 0 and c.overran == 0, (c.kind, c.errors)
        assert len(c.counters) == SESSIONS and all(final == acked for final, acked in c.counters), (c.kind, c.counters)
        assert c.final_read_raw == 0 and c.calls > 50, c
    assert_stack_is_whole(fault_stack)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", bench.STOCK_KINDS)
async def test_a_stock_client_through_a_kill_9_fails_no_call_and_keeps_exact_counts(
    fault_stack: Stack, kind: str
) -> None:
    """The issue's targets for calls that stream nothing, for a client nobody here wrote, at its defaults
    and with no retries of ours: kill -9 of the replica serving most sessions, through HAProxy. The call the
    kill caught is re-sent by HAProxy after RESEND_PAUSE_S, and adopted elsewhere: held to the benchmark's
    target (1 s, ~0.6 s measured at rest), or on a machine whose load already made the longest call before
    the kill slow, to that pause plus 3 times it, in this run (a busy machine stretched one to 1.01 s)."""
    report = await report_of(fault_stack, "kill")
    c = getattr(report, kind)
    assert c is not None and c.calls > 50 and len(c.counters) == SESSIONS, c
    bound = max(bench.STOCK_TARGET_LONGEST_CALL, RESEND_PAUSE_S + 3 * c.longest_before_fault_s)
    print(f"{kind}: longest call {c.longest_call_s:.3f} s, bound {bound:.3f} s ({c.longest_before_fault_s:.3f} before)")
    figures = {
        "failed calls": c.failed,
        "longest call within its bound": c.longest_call_s <= bound,
        "sessions whose counter is not the increments acknowledged": c.inexact,
    }
    assert figures == {
        "failed calls": 0,
        "longest call within its bound": True,
        "sessions whose counter is not the increments acknowledged": 0,
    }, (
        f"{kind}: errors {c.errors}; longest call {c.longest_call_s} s (bound {bound:.3f} s); "
        f"(final, acknowledged) {c.counters}"
    )


@pytest.mark.timeout(120)
async def test_kill_9_of_one_haproxy_keeps_every_session_on_its_replica(pair_stack: Stack) -> None:
    """Two HAProxys on one address share their session table: the one left knows every session's replica.
    The ResilientClient fails nothing; a client that retries nothing loses at most its call in flight."""
    report = await report_of(pair_stack, "haproxy-kill")
    assert missed_apart_from_known_gaps(report) == []
    assert_counts_are_exact(report)
    for c in (report.plain, report.ts_sdk):
        assert c is not None and c.exposed == SESSIONS and c.moved == 0, c
        assert c.failed <= c.sessions and c.working_after == SESSIONS, (c.kind, c.errors)
    assert report.resilient.failed == 0 and report.resilient.working_after == SESSIONS
    # The Python SDK's clients that lost their connection stop (KNOWN_GAPS); none of them changed replica.
    for c in (report.python_sdk, report.fastmcp_legacy):
        assert c is not None and c.moved == 0, c
    assert_stack_is_whole(pair_stack)


@pytest.mark.timeout(150)
async def test_rolling_restart_of_every_replica(fault_stack: Stack) -> None:
    report = await report_of(fault_stack, "rolling")
    assert bench.check_targets(report) == []
    assert_counts_are_exact(report)
    # SIGTERM drains: not one call failed, not even those of the clients that never retry.
    assert [c.failed for c in report.clients] == [0, 0, 0]
    assert_stack_is_whole(fault_stack)


@pytest.mark.timeout(120)
async def test_restart_of_every_replica_at_once(fault_stack: Stack) -> None:
    report = await report_of(fault_stack, "restart-all")
    assert missed_apart_from_known_gaps(report) == []
    # Even a sessionless session whose client broke keeps its count: its state is the handle's.
    assert_counts_are_exact(report)
    assert report.plain.working_after == SESSIONS and report.resilient.working_after == SESSIONS
    assert_stack_is_whole(fault_stack)


@pytest.mark.xfail(
    strict=True,
    reason=(
        "no replica exists between the last one exiting and the first new one passing two health checks: "
        "importing FastMCP alone costs a replica ~2 s of start-up, so the outage is longer than 3 s"
    ),
)
@pytest.mark.timeout(120)
async def test_restart_of_every_replica_at_once_costs_no_call_over_3_s(fault_stack: Stack) -> None:
    report = await report_of(fault_stack, "restart-all")
    assert report.resilient.longest_call_s <= bench.TARGET_LONGEST_CALL
    assert report.plain.longest_stall_s < bench.TARGET_STALL


class DroppingProxy:
    """A TCP forwarder to HAProxy that, when told to, closes a connection on its next request, unanswered."""

    def __init__(self, target_url: str) -> None:
        self.target = httpx2.URL(target_url)
        self.drop_next = False
        self.dropped = 0

    async def __aenter__(self) -> DroppingProxy:
        self.server = await asyncio.start_server(self._forward, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = str(self.target.copy_with(host="127.0.0.1", port=port))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.server.close()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.target.host, self.target.port)

        async def answers() -> None:
            while data := await up_reader.read(65536):
                writer.write(data)
                await writer.drain()

        down = asyncio.create_task(answers())
        try:
            while data := await reader.read(65536):
                if self.drop_next:
                    self.drop_next, self.dropped = False, self.dropped + 1
                    break
                up_writer.write(data)
                await up_writer.drain()
        finally:
            down.cancel()
            writer.close()
            up_writer.close()


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason=(
        "a call whose SSE answer had begun when its replica hung is not failed by HAProxy cutting the stream: "
        "the MCP SDK's client resumes it (GET with Last-Event-ID) and waits there, so the call takes the "
        "client's own timeout (4 s) before its retry; the 3 s target misses whenever a fault catches one"
    ),
)
@pytest.mark.timeout(90)
async def test_a_resilient_call_caught_mid_stream_by_a_hung_replica_ends_within_3_s(fault_stack: Stack) -> None:
    async with ResilientClient(fault_stack.config.mcp_url, **bench.RESILIENT_SETTINGS) as client:
        replica = (await client.call_tool("get_counter", {})).data["instance"]
        call = asyncio.create_task(client.call_tool("analyze_data", {"num_items": 40}))
        await asyncio.sleep(0.5)  # its progress is streaming by now
        fault_stack.signal(replica, signal.SIGSTOP)
        started = time.monotonic()
        try:
            result = await asyncio.wait_for(call, 60)
            took = time.monotonic() - started
        finally:
            fault_stack.signal(replica, signal.SIGCONT)
            await asyncio.to_thread(fault_stack.wait_healthy, "haproxy")
    assert result.data["items_processed"] == 40
    assert took <= bench.TARGET_LONGEST_CALL, f"the call took {took:.2f} s after its replica hung"


@pytest.mark.xfail(
    strict=True,
    raises=(RuntimeError, httpx2.RemoteProtocolError),
    reason=(
        "mcp 2.3.0 (and FastMCP 4.0.11 on it): a transport error on one POST ends the client's session task, "
        "and every later call raises again; a client with no retries of its own never works again"
    ),
)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["sessionless", "fastmcp_legacy", "python_sdk"])
async def test_an_sdk_client_works_again_after_one_dropped_connection(fault_stack: Stack, kind: str) -> None:
    async with DroppingProxy(fault_stack.config.mcp_url) as proxy:
        client = bench.ClientFactory(proxy.url).new(kind)
        try:
            await client.open()
            assert (await client.call("increment_counter"))["counter"] == 1
            proxy.drop_next = True
            with pytest.raises(Exception):  # noqa: B017 - this one call's failure is not the point
                await client.call("increment_counter")
            assert proxy.dropped == 1
            # HAProxy never got the dropped request: the next increment is the second.
            assert (await client.call("increment_counter"))["counter"] == 2
        finally:
            with contextlib.suppress(Exception):
                await client.aclose()


@pytest.mark.timeout(180)
async def test_kill_9_of_the_redis_primary_under_load_loses_no_acknowledged_increment(sentinel_stack: Stack) -> None:
    """Sentinel promotes the replica; every write waited for a replica (REDIS_WAIT_REPLICAS=1)."""
    report = await bench.run_scenario(sentinel_stack, "redis-kill", sessions=SESSIONS, duration=DURATION)
    assert bench.check_targets(report) == []
    assert report.wait_replicas == 1 and report.replica in ("redis-1", "redis-2")
    assert [c.lost for c in report.clients] == [0, 0, 0]
    assert_counts_are_exact(report)
    # One primary, the other server its replica. Usually the primary is the other server; on these
    # 2-core machines a sentinel whose first ping to the new primary takes longer than
    # down-after-milliseconds (1 s) sometimes fails back to the killed one, restarted as a replica
    # by then (about 1 run in 8, before and after issue 18). Sentinel then demotes the other one
    # within its failover timeout (10 s). Either way no acknowledged write was lost (above).
    primary = sentinel_stack.redis_primary()
    assert primary in ("redis-1", "redis-2")
    other = "redis-2" if primary == "redis-1" else "redis-1"
    deadline = time.monotonic() + 15
    while sentinel_stack.redis_info(other, "replication").get("role") != "slave":
        assert time.monotonic() < deadline, f"{other} is not a replica of {primary}"
        await asyncio.sleep(0.2)
    assert sentinel_stack.healthy(report.replica)
    assert_stack_is_whole(sentinel_stack)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("scenario", ["redis-restart", "redis-outage"])
async def test_redis_restart_and_a_10_s_outage_lose_nothing_and_heal_by_themselves(
    fault_stack: Stack, scenario: str
) -> None:
    report = await report_of(fault_stack, scenario)
    assert missed_apart_from_known_gaps(report) == []
    assert [c.lost for c in report.clients] == [0, 0, 0]
    assert_counts_are_exact(report)
    # A call the outage caught is told so plainly: the store is unavailable, or HAProxy has no replica
    # to offer (each failed its health check); never a 500, and never a connection closed without an
    # answer (HAProxy takes a replica that answers 503 out of rotation without cutting what it holds).
    for error in report.plain.errors:
        message = error.partition("× ")[2]
        assert "Session store unavailable" in message or "HTTP 503" in message or "TimeoutError" in message, error
    if scenario == "redis-outage":
        assert report.plain.failed > 0, "the outage did not reach the clients"
    assert report.plain.working_after == SESSIONS and report.resilient.working_after == SESSIONS
    assert_stack_is_whole(fault_stack)


def test_check_targets_names_what_is_missed() -> None:
    """The checker itself can fail: a lost increment, a duplicate and a slow mark-down are all named."""
    clean = bench.ClientReport(
        kind="resilient",
        sessions=5,
        calls=100,
        failed=0,
        failed_after_detection=0,
        overran=0,
        longest_call_s=0.5,
        longest_before_fault_s=0.05,
        longest_stall_s=0.6,
        acknowledged=100,
        final=100,
        lost=0,
        duplicated=0,
        unreadable=0,
        working_after=5,
        exposed=2,
        moved=2,
        new_sessions=0,
        errors=[],
    )
    report = bench.ScenarioReport(
        scenario="kill",
        replica="mcp-server-1",
        sessions=5,
        load_seconds=10,
        fault_at_s=2,
        fault_seconds=5,
        mark_down_s=0.1,
        back_up_s=6,
        in_flight_at_fault=1,
        in_flight_on_replica=1,
        plain=bench.ClientReport(**{**clean.__dict__, "kind": "plain"}),
        resilient=clean,
        sessionless=bench.ClientReport(**{**clean.__dict__, "kind": "sessionless"}),
        healthy_after=True,
        backends_after={},
    )
    assert bench.check_targets(report) == []
    report.resilient.final, report.resilient.lost = 99, 1
    report.plain.final, report.plain.duplicated = 103, 3
    report.mark_down_s = 2.5
    report.plain.failed, report.plain.failed_after_detection = 2, 1
    report.sessionless.failed, report.sessionless.failed_after_detection = 1, 1
    report.sessionless.working_after = 4
    report.ts_sdk = bench.ClientReport(
        **{
            **clean.__dict__,
            "kind": "ts_sdk",
            "failed": 2,
            "longest_call_s": 1.5,
            "final": 101,
            "counters": [(21, 20), (20, 20), (20, 20), (20, 20), (20, 20)],
            "inexact": 1,
        }
    )
    missed = bench.check_targets(report)
    assert any("resilient: 1 acknowledged increment(s) lost" in m for m in missed), missed
    assert any("plain: 3 increment(s) applied twice" in m for m in missed), missed
    assert any("HAProxy took 2.5 s" in m for m in missed), missed
    assert any("plain: 1 call(s) sent after HAProxy took mcp-server-1 out failed" in m for m in missed), missed
    assert any("sessionless: 1 call(s) sent after HAProxy took mcp-server-1 out failed" in m for m in missed), missed
    assert any("sessionless: only 4 of 5 sessions worked after the fault" in m for m in missed), missed
    # The stock clients' own targets, through a kill: no failed call, none over 1 s, exact counters.
    stock = [m for m in missed if bench.STOCK_TARGET in m]
    assert any(m.startswith("kill: sessionless: 1 failed call(s)") for m in stock), stock
    assert any(m.startswith("kill: ts_sdk: 2 failed call(s)") for m in stock), stock
    assert any(m.startswith("kill: ts_sdk: a call took 1.50 s") for m in stock), stock
    assert any(m.startswith("kill: ts_sdk: 1 of 5 session(s) whose counter") for m in stock), stock
    assert len(stock) == 4, stock


@pytest.mark.process
def test_the_command_refuses_a_stack_that_is_not_up(tmp_path: Path) -> None:
    env = {**os.environ, "STACK_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "tools.failover_bench", "--scenario", "kill"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "not up and healthy" in result.stderr and "--own-stack" in result.stderr


@pytest.mark.timeout(180)
@pytest.mark.redis
@pytest.mark.haproxy
@pytest.mark.slow
def test_the_command_runs_a_scenario_on_a_stack_of_its_own(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.failover_bench",
            "--scenario",
            "kill",
            "--own-stack",
            "--duration",
            "6",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert "Failover benchmark" in result.stdout, result.stdout + result.stderr
    data = json.loads(out.read_text())
    [scenario] = data["scenarios"]
    assert scenario["scenario"] == "kill"
    # A miss is the exit status's business; only a known gap may cause one (1 kill run in 8 or so), or a
    # stock client's target (test_a_stock_client_... holds each to those).
    missed = scenario["targets_missed"]
    assert not [m for m in missed if not m.startswith(KNOWN_GAPS["kill"]) and bench.STOCK_TARGET not in m], (
        result.stdout
    )
    assert result.returncode == (1 if missed else 0), result.stdout + result.stderr
    assert ("every target met" in result.stdout) == (not missed) and data["ok"] is (not missed)
    assert set(data["targets"]) >= {
        "resilient_longest_call_s",
        "plain_longest_stall_s",
        "mark_down_s",
        "sessionless_call_timeout_s",
    }
    assert scenario["replica"].startswith("mcp-server-")
    # Its bound is the benchmark's own target (TARGET_MARK_DOWN), held through targets_missed above.
    assert scenario["mark_down_s"] >= 0
    assert scenario["load_seconds"] >= 6
    fields = {"calls", "failed", "longest_call_s", "longest_stall_s", "acknowledged", "final", "lost", "duplicated"}
    # The stock SDK clients ran too, by default.
    for kind in bench.KINDS:
        figures = scenario[kind]
        assert fields <= set(figures) and figures["kind"] == kind
        assert figures["calls"] > 0 and figures["lost"] == 0 and figures["duplicated"] == 0
    assert scenario["sessionless"]["failed_after_detection"] == 0
    assert scenario["resilient"]["final"] == scenario["resilient"]["acknowledged"]
    assert scenario["resilient"]["failed"] == 0
