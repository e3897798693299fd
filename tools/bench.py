"""The performance benchmark: calls per second, latency, the proxy hop, a session's cost in Redis, capacity.

    python -m tools.bench --own-stack                         the whole run, on a stack of its own
    python -m tools.bench --quick --own-stack --json out.json under a minute, for CI
    python -m tools.bench --mix increment_counter=3,get_counter=1 --sessions 16 --duration 30
    python -m tools.bench --compare http://127.0.0.1:9000/mcp  another MCP endpoint, side by side
    python -m tools.bench --own-stack --reference ~/src/mcp-high-availability
                                                              the reference kit, run as local processes
                                                              (tools/reference.py), side by side
    python -m tools.bench --own-stack --markdown docs/benchmarks.md
                                                              the figures into the document, between
                                                              <!-- bench:start --> and <!-- bench:end -->
    python -m tools.bench --own-stack --sections capacity --markdown docs/benchmarks.md
                                                              the capacity section (and the memory
                                                              section it needs) only, into its markers

Sections, each in one run:

    throughput   `--sessions` sessions in a closed loop (each sends its next call
                 as soon as the last returns) calling the `--mix` of tools,
                 through HAProxy, directly against one replica, against the
                 floor (tools/bench_floor.py behind its own HAProxy) and, with
                 `--compare`, against another endpoint, and with `--reference
                 PATH`, against the reference kit (a checkout of
                 vikrantjain/mcp-high-availability at PATH, run by
                 tools/reference.py: its pinned venv outside this repository,
                 its redis-server, three `fastmcp run` replicas, its
                 haproxy.cfg on loopback ports). The setups take turns in short
                 rounds, so drift in the machine's load hits each alike.
                 Redis round trips (FCALLs), commands and main-thread CPU per
                 MCP call through HAProxy: Redis's INFO cpu and commandstats
                 sampled right before and after each of those rounds only,
                 less what Redis runs with no calls (leases, health checks),
                 measured over one round's length before the rounds.
    proxy hop    one session, through HAProxy and directly, interleaved: the
                 difference of the medians is what the hop costs.
    scale        one session's latency with 0, 10,000 and 100,000 sessions in
                 the store (filled inside Redis like tests/test_scale.py), as
                 ratios to 0.
    memory       Redis bytes a session holding a counter and three notes
                 costs: MEMORY USAGE of each key it made, and the used_memory
                 delta over many such sessions, right after the calls and at
                 rest (once the records kept for retries and stream
                 resumption have expired; the bench deletes them instead of
                 waiting).
    durability   what waiting for a Redis replica's acknowledgement of every
                 write (REDIS_WAIT_REPLICAS=1) costs: keyed increments straight
                 through the store, with and without it, interleaved, on a
                 primary and replica of the bench's own; and that cost as a
                 share of a tool call's p50 through HAProxy.
    capacity     Redis's main-thread CPU seconds, commands and round trips per
                 call of each call shape through HAProxy: plain (session-era
                 increment_counter), streamed (analyze_data asking for progress:
                 an SSE stream), task (the same as a 2026-07-28 durable task,
                 FastMCP's Client with fastmcp-tasks polling tasks/get; left out
                 without the tasks extra), initialize (a new session-era
                 session) and the `--mix`. Each a bounded batch of calls,
                 `--sessions` at a time (tasks: MAX_TASKS_PER_CLIENT at most),
                 between two readings of INFO cpu and commandstats, less Redis
                 at rest (measured before and after the batches). Computed from
                 those, not measured: the calls/s one primary serves (1 / CPU
                 seconds per call); a session's bytes at its bounds (the memory
                 section's at-rest figure plus the replicas' state, record and
                 event log bounds); and what 1, 3 and 9 primaries of
                 `--primary-memory` GiB each hold and serve.

They run in the order throughput, proxy hop, memory, capacity, scale (whose
100,000 sessions would leave Redis rehashing), durability; `--sections` runs
some of them (capacity brings memory).

Clients are raw HTTP (mcp_ha/ops/check/wire.py over httpx2, keep-alive), not FastMCP's
Client, so the client's own overhead stays small. `--generation session` speaks
session-era MCP (initialize, mcp-session-id); `sessionless` speaks 2026-07-28
(no initialize, `create_session` once, its handle passed as `session_id`). The
floor and `--compare` are driven the same way whatever the generation (the
floor always does increment_counter's store operation; `--compare` and
`--reference` are session-era, so `--reference` takes `--generation session`).

`--markdown FILE` rewrites only what lies between the markers, with markdown
tables of the figures and a line saying when, on what and with which command
line they were measured: <!-- bench:start --> and <!-- bench:end -->, and with
`--reference`, also <!-- reference:start --> and <!-- reference:end --> (this
kit against the reference: calls/s and p50/p99 of each, their ratio, and this
kit's calls/s as a fraction of the floor's), and, when FILE has them, the
capacity section between <!-- capacity:start --> and <!-- capacity:end -->.
The bench markers' block is written only by a run of every section but
capacity, though FILE needs them whatever runs. A FILE without the markers it
needs, or into which the run would write nothing, is refused before anything
starts, and a run in which calls failed leaves FILE as it was.

Exit status: 0 when every call succeeded (targets are printed, and only
checked with `--check-targets`: 1 when one is missed), 1 when any measured call
failed (no figure is then reported as a success), 2 when there is nothing to
measure: no stack up, an unreachable target, a tool that errors at once, a
`--markdown` FILE without its markers, `--chart` without matplotlib.
"""

from __future__ import annotations

import asyncio
import importlib.util
import ipaddress
import itertools
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn, Protocol
from urllib.parse import urlsplit

import click
import httpx2
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mcp_ha.ops.check.wire import CallFailed, RawSession, SessionlessSession, final_message, tool_result
from mcp_ha.ops.stack import (
    HAPROXY_ARGV,
    Stack,
    StackConfig,
    StackError,
    free_ports,
    http_status,
    read_stats_csv,
    running_stack,
)
from mcp_ha.session_store import DEFAULT_MAX_EVENTS, EVENT_BYTES, Op, StoreUnavailable, key_bytes
from mcp_ha.settings import Settings, SettingsError
from mcp_ha.stores.redis_store import RedisSessionStore
from tools import ROOT
from tools.reference import Checkout, ReferenceKit, ReferenceKitError, ensure_venv

# Tools that keep state per session: a sessionless client passes its handle to these.
STATEFUL = {
    "increment_counter",
    "get_counter",
    "add_note",
    "list_notes",
    "analyze_data",
    "watch_counter",
    "resume_session",
}
DEFAULT_ARGS: dict[str, dict] = {
    "add_note": {"note": "bench"},
    "analyze_data": {"num_items": 1},
    "watch_counter": {"duration_seconds": 0},
}
# The arguments of every other tool: one dict for every call, never changed.
NO_ARGUMENTS: dict = {}

CALL_TIMEOUT = 10.0
# However fast the stack, no round makes more calls than this (per session).
MAX_CALLS_PER_ROUND = 100_000
# `--markdown FILE` writes between <!-- bench:start --> and <!-- bench:end -->.
MARKDOWN_MARKERS = "bench"
# ... and with --reference, also between <!-- reference:start --> and <!-- reference:end -->.
REFERENCE_MARKERS = "reference"
# ... and, when FILE has them, the capacity section between <!-- capacity:start --> and <!-- capacity:end -->.
CAPACITY_MARKERS = "capacity"
# The capacity section on a Redis Cluster (--redis cluster) goes into a block of its own.
CLUSTER_CAPACITY_MARKERS = "capacity-cluster"
# The sections, in the order they run (`--sections`); the bench markers' block needs all but capacity.
SECTIONS = ("throughput", "proxy_hop", "memory", "capacity", "scale", "durability")
BENCH_SECTIONS = frozenset(SECTIONS) - {"capacity"}
# The capacity section's table of what 1, 3 and 9 primaries hold and serve.
PRIMARIES = (1, 3, 9)
# Under the kit's key pattern (the ACL lets its user reach no other keys), apart from its sessions.
FLOOR_PREFIX = "mcp:benchfloor"

TARGET_FLOOR_FRACTION = 0.5
TARGET_SCALE_RATIO = 1.5
TARGET_BYTES_PER_SESSION = 288
TARGET_HOP_MS = 1.0
# Against the reference kit, through each one's HAProxy: at least this many times its calls/s, and at most
# this fraction of its p99 (issue 37).
TARGET_REFERENCE_THROUGHPUT = 1.5
TARGET_REFERENCE_P99 = 0.7

# Sessions shaped like real ones (a counter and three notes), made inside Redis
# in one call (tests/test_scale.py uses them too).
FILL = """
local now = redis.call('TIME')[1]
for i = 1, tonumber(ARGV[1]) do
  local sid = ARGV[2] .. string.format('%024x', i)
  redis.call('HSET', KEYS[1] .. sid, 'counter', '1', 'notes', '["one","two","three"]')
  redis.call('EXPIRE', KEYS[1] .. sid, 1800)
  redis.call('ZADD', KEYS[2], now, sid)
end
return tonumber(ARGV[1])
"""

EMPTY = """
for i = 1, tonumber(ARGV[1]) do
  local sid = ARGV[2] .. string.format('%024x', i)
  redis.call('DEL', KEYS[1] .. sid)
  redis.call('ZREM', KEYS[2], sid)
end
"""


class BenchError(Exception):
    """Nothing sound to measure; the message says why."""


# -- clients ------------------------------------------------------------------------------


# What one call may raise when the target misbehaves: counted as a failed call, never a crash.
CALL_ERRORS = (CallFailed, httpx2.HTTPError, TimeoutError, ValueError, OSError)


class Client(Protocol):
    """One session against one target: `call_tool` returns the tool's structured result or raises one of
    CALL_ERRORS."""

    async def open(self) -> object: ...

    async def call_tool(self, tool: str, arguments: dict) -> dict: ...

    async def close(self) -> None: ...


class SessionClient(RawSession):
    """Session-era MCP (2025-11-25), mcp_ha/ops/check/wire's RawSession: initialize once, then every call
    carries mcp-session-id."""

    def __init__(self, http: httpx2.AsyncClient, url: str, **options: Any) -> None:
        super().__init__(http, url, **{"client_name": "bench", **options})


class SessionlessClient(SessionlessSession):
    """2026-07-28 MCP, mcp_ha/ops/check/wire's SessionlessSession: no initialize; `create_session` once, its
    handle passed to the tools that keep state."""

    def __init__(self, http: httpx2.AsyncClient, url: str, **options: Any) -> None:
        super().__init__(http, url, **{"client_name": "bench", **options})

    async def call_tool(
        self, tool: str, arguments: dict | None = None, *, headers: dict[str, str] | None = None
    ) -> dict:
        if tool in STATEFUL:
            arguments = {**arguments, "session_id": self.handle} if arguments else {"session_id": self.handle}
        return await super().call_tool(tool, arguments, headers=headers)


class FloorClient:
    """The floor (tools/bench_floor.py): one POST, one store operation; whatever the tool, it increments."""

    def __init__(self, http: httpx2.AsyncClient, url: str) -> None:
        self.http = http
        self.url = url
        self.session_id = ""
        self._body: dict[str, str] = {}

    async def open(self) -> None:
        self.session_id = uuid.uuid4().hex
        self._body = {"session_id": self.session_id}
        await self.call_tool("increment_counter", {})

    async def call_tool(self, tool: str, arguments: dict) -> dict:
        response = await self.http.post(self.url, json=self._body)
        if response.status_code != 200:
            raise CallFailed(f"HTTP {response.status_code}: {response.text[:160]}")
        answer = response.json()
        if not isinstance(answer, dict):
            raise CallFailed(f"not an object: {response.text[:160]}")
        return answer

    async def close(self) -> None: ...


class StoreClient:
    """No HTTP: keyed increments straight through a RedisSessionStore, as a call through HAProxy writes."""

    def __init__(self, store: RedisSessionStore) -> None:
        self.store = store
        self.session_id = uuid.uuid4().hex

    async def open(self) -> None: ...

    async def call_tool(self, tool: str, arguments: dict) -> dict:
        try:
            return {"counter": await self.store.incr(self.session_id, "counter", op=Op(uuid.uuid4().hex, "bench"))}
        except StoreUnavailable as exc:
            raise CallFailed(str(exc)) from exc

    async def close(self) -> None: ...


class StreamedClient(SessionClient):
    """Session-era, asking for progress (a progressToken, as a client showing progress does): a tool that
    reports progress answers as an SSE stream of its progress and log messages, then its result."""

    streamed = 0  # answers that came as an SSE stream, the evidence the calls were of their shape

    async def call_tool(
        self, tool: str, arguments: dict | None = None, *, headers: dict[str, str] | None = None
    ) -> dict:
        params = {"name": tool, "arguments": arguments or {}, "_meta": {"progressToken": uuid.uuid4().hex}}
        response = await self.post("tools/call", params, headers=headers)
        self.streamed += response.headers.get("content-type", "").startswith("text/event-stream")
        return tool_result(final_message(response))


class TaskClient:
    """mcp_ha.ops.check.clients.TasksClient (FastMCP's Client with fastmcp-tasks, 2026-07-28, a `create_session`
    handle) as the bench's Client: a task tool's call runs as a durable task, polled with tasks/get to its end."""

    def __init__(self, url: str) -> None:
        # Imported here: FastMCP takes seconds to import, which every other run of the bench is spared.
        from mcp_ha.ops.check.clients import TasksClient

        self.inner = TasksClient(url)

    @property
    def polls(self) -> int:
        return len(self.inner.seen.polls)

    async def open(self) -> None:
        await self.inner.open()

    async def call_tool(self, tool: str, arguments: dict) -> dict:
        try:
            return dict(await self.inner.call(tool, arguments, bound=CALL_TIMEOUT))
        except Exception as exc:  # FastMCP's, the SDK's and httpx's own errors: each is a failed call
            raise CallFailed(f"{type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        await self.inner.aclose()


class InitializeClient:
    """Each call opens a new session-era session (initialize, then notifications/initialized); `close` ends
    them all (DELETE), after the measured calls."""

    def __init__(self, http: httpx2.AsyncClient, url: str) -> None:
        self.http = http
        self.url = url
        self.opened: list[SessionClient] = []

    async def open(self) -> None: ...

    async def call_tool(self, tool: str, arguments: dict) -> dict:
        session = SessionClient(self.http, self.url)
        await session.open()
        self.opened.append(session)
        return {}

    async def close(self) -> None:
        await asyncio.gather(*(session.close() for session in self.opened), return_exceptions=True)


# -- measuring ----------------------------------------------------------------------------


@dataclass
class Samples:
    latencies: list[float] = field(default_factory=list)  # seconds, successful calls only
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    seconds: float = 0.0
    instances: Counter = field(default_factory=Counter)

    def add_error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what)

    def stats(self) -> dict:
        lat = sorted(self.latencies)
        ok = len(lat)

        def pct(q: float) -> float | None:
            return None if not lat else round(lat[min(ok - 1, int(q * ok))] * 1e3, 3)

        return {
            "calls": ok + self.errors,
            "ok": ok,
            "errors": self.errors,
            "error_samples": self.error_samples,
            "seconds": round(self.seconds, 3),
            "calls_per_s": round(ok / self.seconds, 1) if self.seconds else 0.0,
            "p50_ms": pct(0.50),
            "p95_ms": pct(0.95),
            "p99_ms": pct(0.99),
            "mean_ms": round(statistics.fmean(lat) * 1e3, 3) if lat else None,
            "max_ms": round(lat[-1] * 1e3, 3) if lat else None,
            "instances": dict(self.instances.most_common()),
        }


@dataclass
class Setup:
    """A target under load: its sessions and what they measured."""

    name: str
    url: str
    clients: list[Client]
    http: httpx2.AsyncClient | None  # None: clients that speak no HTTP
    samples: Samples = field(default_factory=Samples)
    redis: RedisWatch | None = None  # Redis's command counters, sampled right around each measured round


def parse_mix(text: str) -> list[tuple[str, int]]:
    mix = []
    for part in text.split(","):
        name, _, weight = part.strip().partition("=")
        try:
            w = int(weight) if weight else 1
        except ValueError:
            raise click.BadParameter(f"{part!r}: the weight after '=' must be a whole number") from None
        if not name or w < 1:
            raise click.BadParameter(f"{part!r}: want tool=weight with a weight of at least 1")
        mix.append((name, w))
    return mix


def tool_cycle(mix: list[tuple[str, int]], offset: int) -> itertools.cycle:
    order = [name for name, weight in mix for _ in range(weight)]
    return itertools.cycle(order[offset % len(order) :] + order[: offset % len(order)])


async def drive(
    client: Client, tools: itertools.cycle, seconds: float, samples: Samples | None, *, calls: int = MAX_CALLS_PER_ROUND
) -> None:
    """Call tools back to back for `seconds` or `calls` calls, whichever ends first; record into `samples` if
    given."""
    deadline = time.perf_counter() + seconds
    for _ in range(min(calls, MAX_CALLS_PER_ROUND)):
        if time.perf_counter() >= deadline:
            return
        tool = next(tools)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(CALL_TIMEOUT):
                result = await client.call_tool(tool, DEFAULT_ARGS.get(tool, NO_ARGUMENTS))
        except CALL_ERRORS as exc:
            if samples is not None:
                samples.add_error(f"{tool}: {type(exc).__name__}: {exc}"[:200])
            continue
        if samples is not None:
            samples.latencies.append(time.perf_counter() - started)
            samples.instances[result.get("instance", "?")] += 1


async def run_round(
    setup: Setup, mix: list[tuple[str, int]], seconds: float, *, measure: bool = True, calls: int = MAX_CALLS_PER_ROUND
) -> None:
    """Each client of `setup` drives the mix for `seconds`, or `calls` calls each, whichever ends first."""
    watch = setup.redis if measure else None
    before = await watch.sample() if watch is not None else None
    made = len(setup.samples.latencies) + setup.samples.errors
    started = time.perf_counter()
    samples = setup.samples if measure else None
    await asyncio.gather(
        *(drive(c, tool_cycle(mix, i), seconds, samples, calls=calls) for i, c in enumerate(setup.clients))
    )
    elapsed = time.perf_counter() - started
    if measure:
        setup.samples.seconds += elapsed
    if watch is not None and before is not None:
        in_round = len(setup.samples.latencies) + setup.samples.errors - made
        watch.rounds.add(before, await watch.sample(), elapsed, in_round)


def new_http(sessions: int) -> httpx2.AsyncClient:
    limits = httpx2.Limits(max_connections=sessions + 4, max_keepalive_connections=sessions + 4)
    return httpx2.AsyncClient(timeout=CALL_TIMEOUT, limits=limits)


async def open_setup(name: str, url: str, kind: Callable[[httpx2.AsyncClient, str], Client], sessions: int) -> Setup:
    http = new_http(sessions)
    clients = [kind(http, url) for _ in range(sessions)]
    try:
        async with asyncio.timeout(30):
            await asyncio.gather(*(c.open() for c in clients))
    except CALL_ERRORS as exc:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        await http.aclose()
        raise BenchError(
            f"{name}: could not open a session at {url}: {type(exc).__name__}: {exc}".rstrip(": ")
        ) from None
    return Setup(name, url, clients, http)


async def close_setup(setup: Setup) -> None:
    try:
        async with asyncio.timeout(10):
            await asyncio.gather(*(c.close() for c in setup.clients), return_exceptions=True)
    except TimeoutError:
        pass
    if setup.http is not None:  # None: its clients speak no HTTP
        await setup.http.aclose()


async def probe_tools(setup: Setup, mix: list[tuple[str, int]]) -> None:
    """Each tool of the mix once: a tool that errors is reported before anything is measured."""
    for tool, _ in mix:
        try:
            async with asyncio.timeout(CALL_TIMEOUT):
                await setup.clients[0].call_tool(tool, DEFAULT_ARGS.get(tool, NO_ARGUMENTS))
        except CALL_ERRORS as exc:
            raise BenchError(
                f"{setup.name}: the tool {tool!r} fails at {setup.url}: {type(exc).__name__}: {exc}"
            ) from None


async def interleave(
    setups: list[Setup],
    mix: list[tuple[str, int]],
    rounds: int,
    round_seconds: float,
    progress: Progress,
    task,
    label: str,
) -> None:
    for setup in setups:  # warm connections, caches, the replicas' code paths
        await run_round(setup, mix, min(1.0, round_seconds), measure=False)
    for r in range(rounds):
        # Alternate the order too, so neither setup always follows the other.
        for setup in setups if r % 2 == 0 else setups[::-1]:
            progress.update(task, description=f"{label}: round {r + 1}/{rounds}, {setup.name}")
            await run_round(setup, mix, round_seconds)
            progress.advance(task, round_seconds)


# -- Redis, through redis-cli (only stores/redis_store.py imports redis) ------------------


def redis_cli(
    redis: StackConfig, *args: str, stdin: str | None = None, timeout: float = 120, port: int | None = None
) -> str:
    """As the admin: the benchmark fills, measures and empties Redis beside the kit's own user (the stack's
    Redis, or the server on `port`: a cluster's primary)."""
    result = subprocess.run(
        ["redis-cli", "-p", str(port or redis.redis_port), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=redis.redis_cli_env,
    )
    if result.returncode != 0 or result.stdout.startswith("ERR") or "(error)" in result.stdout:
        raise BenchError(f"redis-cli {' '.join(args[:2])} failed: {(result.stderr or result.stdout).strip()[:200]}")
    return result.stdout


def used_memory(redis: StackConfig) -> int:
    """Redis's used_memory less its clients' buffers, which come and go with the replicas'
    connection pools and, over a few hundred sessions, would swamp what the sessions cost."""
    lines = redis_cli(redis, "MEMORY", "STATS").splitlines()
    stats = dict(zip(lines[::2], lines[1::2], strict=False))
    try:
        total = int(
            next(
                line.split(":")[1]
                for line in redis_cli(redis, "INFO", "memory").splitlines()
                if line.startswith("used_memory:")
            )
        )
        return total - int(stats["clients.normal"]) - int(stats["clients.slaves"])
    except (StopIteration, KeyError, ValueError) as exc:
        raise BenchError(f"Redis did not report its memory use ({exc!r})") from exc


def scan(redis: StackConfig, pattern: str) -> list[str]:
    return [k for k in redis_cli(redis, "--scan", "--pattern", pattern).splitlines() if k]


def delete_keys(redis: StackConfig, keys: list[str]) -> None:
    for i in range(0, len(keys), 500):
        redis_cli(redis, stdin="DEL " + " ".join(keys[i : i + 500]) + "\n")


def fill(redis: StackConfig, script: str, count: int, marker: str) -> None:
    redis_cli(redis, "EVAL", script, "2", "mcp:session:", "mcp:sessions", str(count), marker)


# -- Redis round trips, commands and CPU per MCP call: INFO around one setup's rounds ---------------

# One round trip each: a call of a function of the kit's library (every store operation is one FCALL),
# or of a script (EVALSHA/EVAL, as other versions ran them). What they run inside counts in commandstats too.
ROUND_TRIP_COMMANDS = frozenset({"fcall", "fcall_ro", "evalsha", "evalsha_ro", "eval", "eval_ro"})


def parse_commandstats(text: str) -> Counter[str]:
    """`INFO commandstats` as calls per command: `cmdstat_hset:calls=3,usec=9,...` gives {"hset": 3}
    (a subcommand keeps its name, e.g. "client|setinfo"); other lines are skipped."""
    calls: Counter[str] = Counter()
    for line in text.splitlines():
        name, sep, fields = line.strip().partition(":")
        if not sep or not name.startswith("cmdstat_"):
            continue
        for item in fields.split(","):
            key, _, value = item.partition("=")
            if key == "calls":
                calls[name.removeprefix("cmdstat_")] = int(value)
    return calls


def parse_cpu(text: str) -> float:
    """`INFO cpu` as the CPU seconds of Redis's main thread: it runs every command, so it is what a busy
    primary saturates (the process's used_cpu_* also count its background threads)."""
    fields = dict(line.strip().partition(":")[::2] for line in text.splitlines())
    try:
        return float(fields["used_cpu_sys_main_thread"]) + float(fields["used_cpu_user_main_thread"])
    except (KeyError, ValueError) as exc:
        raise BenchError(f"Redis's INFO cpu reported no main thread's CPU ({exc!r})") from None


@dataclass(frozen=True)
class Reading:
    """Redis's counters at one instant: calls per command (INFO commandstats) and main-thread CPU seconds."""

    commands: Counter[str]
    cpu: float


@dataclass
class Tally:
    """What Redis ran over some windows, by command, and the CPU seconds it spent, with the windows' seconds
    and the MCP calls made in them."""

    commands: Counter[str] = field(default_factory=Counter)
    cpu: float = 0.0
    seconds: float = 0.0
    calls: int = 0
    windows: int = 0
    dropped: int = 0  # windows whose counters went back (CONFIG RESETSTAT, a restart): not counted, nor their calls

    def add(self, before: Reading, after: Reading, seconds: float, calls: int = 0) -> None:
        delta = {
            name: after.commands[name] - before.commands[name]
            for name in after.commands.keys() | before.commands.keys()
        }
        if any(n < 0 for n in delta.values()) or after.cpu < before.cpu:
            self.dropped += 1
            return
        self.commands.update(delta)
        self.cpu += after.cpu - before.cpu
        self.seconds += seconds
        self.calls += calls
        self.windows += 1


@dataclass
class RedisWatch:
    """The stack's Redis's `INFO cpu commandstats` (as the admin), sampled right before and after each measured
    round of one setup (run_round): the rounds of the setups interleaved with it, some on the same Redis
    (direct, the floor), fall outside. An idle window first gives what Redis runs with no calls at all. On a
    cluster, `ports` are its primaries': their counters summed, what the cluster ran for the calls."""

    redis: StackConfig
    rounds: Tally = field(default_factory=Tally)
    idle: Tally = field(default_factory=Tally)
    ports: tuple[int, ...] = ()

    async def sample(self) -> Reading:
        commands: Counter[str] = Counter()
        cpu = 0.0
        for port in self.ports or (self.redis.redis_port,):
            text = await asyncio.to_thread(redis_cli, self.redis, "INFO", "cpu", "commandstats", port=port)
            commands.update(parse_commandstats(text))
            cpu += parse_cpu(text)
        return Reading(commands, cpu)

    async def measure_idle(self, seconds: float) -> None:
        """No calls for `seconds`, sampled like a round: each replica's lease renewals, the health checks
        of the kit's and the floor's HAProxy, the sampling itself."""
        before = await self.sample()
        started = time.perf_counter()
        await asyncio.sleep(seconds)
        elapsed = time.perf_counter() - started
        self.idle.add(before, await self.sample(), elapsed)


def redis_watch(stack: Stack) -> RedisWatch:
    """The watch of the stack's Redis: on a cluster, of the primaries serving slots now."""
    if stack.config.redis_mode != "cluster":
        return RedisWatch(stack.config)
    return RedisWatch(stack.config, ports=tuple(stack.service(n).port for n in stack.cluster_primaries()))


def redis_per_call(rounds: Tally, idle: Tally) -> dict:
    """Redis round trips, commands and main-thread CPU per MCP call over `rounds`, less what Redis ran at
    rest: `idle`'s commands and CPU at its rate over the rounds' seconds (with an idle window one round long,
    that is one such window per round, the sampling's own AUTH and INFO included). No idle window: nothing
    subtracted."""
    scale = rounds.seconds / idle.seconds if idle.seconds else 0.0
    cpu = rounds.cpu - scale * idle.cpu
    net = {
        name: rounds.commands[name] - scale * idle.commands[name]
        for name in rounds.commands.keys() | idle.commands.keys()
    }

    def trips(commands: Counter[str] | dict[str, float]) -> float:
        return sum(n for name, n in commands.items() if name in ROUND_TRIP_COMMANDS)

    def per_call(n: float) -> float | None:
        return round(n / rounds.calls, 3) if rounds.calls else None

    by_command = {
        name: per_call(n)
        for name, n in sorted(net.items(), key=lambda kv: (-kv[1], kv[0]))
        if rounds.calls and abs(n) / rounds.calls >= 0.005
    }
    return {
        "redis_round_trips_per_call": per_call(trips(net)),
        "redis_commands_per_call": per_call(sum(net.values())),
        "redis_cpu_us_per_call": round(cpu / rounds.calls * 1e6, 2) if rounds.calls else None,
        "redis_per_call": {
            "mcp_calls": rounds.calls,
            "rounds": rounds.windows,
            "rounds_dropped": rounds.dropped,
            "seconds": round(rounds.seconds, 3),
            "round_trips": trips(rounds.commands),
            "commands": sum(rounds.commands.values()),
            "idle_seconds": round(idle.seconds, 3),
            "idle_round_trips": trips(idle.commands),
            "idle_commands": sum(idle.commands.values()),
            "subtracted_round_trips": round(scale * trips(idle.commands), 1),
            "subtracted_commands": round(scale * sum(idle.commands.values()), 1),
            "cpu_seconds": round(rounds.cpu, 6),
            "idle_cpu_seconds": round(idle.cpu, 6),
            "subtracted_cpu_seconds": round(scale * idle.cpu, 6),
            "idle_subtracted": bool(idle.seconds),
            "commands_per_call": by_command,
        },
    }


# -- the floor: tools.bench_floor replicas behind the kit's own haproxy.cfg ----------------


class Floor:
    """tools.bench_floor processes and an HAProxy in front of them, started and stopped by pid."""

    def __init__(self, stack: Stack, replicas: int, log_dir: Path) -> None:
        self.stack = stack
        self.host = stack.config.host
        self.http_port, self.https_port, self.stats_port, *self.ports = free_ports(3 + replicas)
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}/incr"

    def direct_url(self) -> str:
        return f"http://{self.host}:{self.ports[0]}/incr"

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self.procs.append(
                subprocess.Popen(
                    argv,
                    cwd=ROOT,
                    env={**os.environ, **env},
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def start(self) -> None:
        c = self.stack.config
        for i, port in enumerate(self.ports, start=1):
            self._spawn(
                f"floor-{i}",
                [c.python, "-m", "tools.bench_floor"],
                {
                    "INSTANCE_ID": f"floor-{i}",
                    "HOST": self.host,
                    "PORT": str(port),
                    "REDIS_URL": c.redis_url,
                    "REDIS_USERNAME": c.redis_user,
                    "REDIS_PASSWORD": c.redis_password,
                    "BENCH_FLOOR_PREFIX": FLOOR_PREFIX,
                },
            )
        # The same HAProxy settings as the stack's, so the floor pays for the same rules.
        env = {
            **c.haproxy_env(self.http_port, self.https_port, self.ports),
            "HAPROXY_STATS_BIND": f"{self.host}:{self.stats_port}",
            # The floor's endpoint is not the MCP one: HAProxy passes on only the paths listed.
            "HAPROXY_ALLOWED_PATHS": "/incr /health",
        }
        deadline = time.monotonic() + 30
        for port in self.ports:
            while http_status(f"http://{self.host}:{port}/health") != 200:
                if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                    raise BenchError(f"the floor's processes did not come up; see {self.log_dir}")
                time.sleep(0.1)
        self._spawn("floor-haproxy", list(HAPROXY_ARGV), env)
        # HAProxy starts its servers UP only after `rise` checks; wait for a real answer through it.
        while http_status(f"http://{self.host}:{self.http_port}/health") != 200 or not self._all_up():
            if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                raise BenchError(f"the floor's HAProxy did not come up; see {self.log_dir}")
            time.sleep(0.1)

    def _all_up(self) -> bool:
        c = self.stack.config
        try:
            text = read_stats_csv(f"http://{self.host}:{self.stats_port}/stats", *c.stats_auth)
        except (OSError, ValueError):
            return False
        rows = [line.split(",") for line in text.splitlines() if line.startswith("mcp_servers,mcp-server-")]
        return len(rows) == len(self.ports) and all(r[17].startswith("UP") for r in rows)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


# -- the sections -------------------------------------------------------------------------


@dataclass
class Plan:
    mix: list[tuple[str, int]]
    sessions: int
    duration: float
    generation: str
    quick: bool
    compare: str | None
    sections: frozenset[str]
    primary_memory_gib: float

    @property
    def rounds(self) -> int:
        return 3 if self.quick else max(3, round(self.duration / 2.5))

    @property
    def round_seconds(self) -> float:
        return self.duration / self.rounds

    @property
    def hop(self) -> tuple[int, float]:
        return (2, 1.0) if self.quick else (4, 1.5)

    @property
    def scale_levels(self) -> list[int]:
        return [0, 10_000, 100_000]

    @property
    def scale_seconds(self) -> float:
        return 1.0 if self.quick else 3.0

    @property
    def memory_sessions(self) -> int:
        return 100 if self.quick else 1000

    @property
    def durability(self) -> tuple[int, float]:
        """Rounds, and seconds per round of each setting."""
        return (2, 1.0) if self.quick else (4, 2.0)

    def capacity_calls(self, shape: str) -> int:
        """A task takes its client's poll interval (0.5 s) at least, so it makes fewer."""
        calls = 48 if self.quick else 400
        return calls // 3 if shape == "task" else calls

    @property
    def capacity_idle_seconds(self) -> float:
        """Redis with no calls, half before the shapes' batches and half after."""
        return 2.0 if self.quick else 6.0

    def planned_seconds(self, setups: int) -> float:
        rounds, seconds = self.hop
        wait_rounds, wait_seconds = self.durability
        planned = {
            "throughput": setups * self.duration + self.round_seconds,  # and its idle window (RedisWatch)
            "proxy_hop": 2 * rounds * seconds,
            "scale": (len(self.scale_levels) + 1) * self.scale_seconds,
            "durability": 2 * wait_rounds * wait_seconds,
            "capacity": self.capacity_idle_seconds,  # its batches are bounded in calls, not seconds
        }
        return sum(planned.get(name, 0.0) for name in self.sections)


def replica_url(stack: Stack, index: int = 0) -> str:
    return f"http://{stack.config.host}:{stack.config.replica_ports[index]}/mcp"


async def section_throughput(
    stack: Stack, floor: Floor, plan: Plan, progress: Progress, task, reference_url: str | None = None
) -> dict:
    kind = SessionClient if plan.generation == "session" else SessionlessClient
    setups: list[Setup] = []
    try:
        setups.append(await open_setup("haproxy", stack.config.mcp_url, kind, plan.sessions))
        await probe_tools(setups[0], plan.mix)
        setups.append(await open_setup("direct", replica_url(stack), kind, plan.sessions))
        setups.append(await open_setup("floor", floor.url, FloorClient, plan.sessions))
        if plan.compare:
            setups.append(await open_setup("compare", plan.compare, SessionClient, plan.sessions))
            await probe_tools(setups[-1], plan.mix)
        if reference_url:
            setups.append(await open_setup("reference", reference_url, SessionClient, plan.sessions))
            await probe_tools(setups[-1], plan.mix)
        # Redis per call: only the kit's own rounds through HAProxy are counted, less Redis at rest.
        watch = setups[0].redis = redis_watch(stack)
        progress.update(task, description="throughput: Redis with no calls, for one round's length")
        await watch.measure_idle(plan.round_seconds)
        progress.advance(task, plan.round_seconds)
        await interleave(setups, plan.mix, plan.rounds, plan.round_seconds, progress, task, "throughput")
    finally:
        for setup in setups:
            await close_setup(setup)
    out = {s.name: {"url": s.url, **s.samples.stats()} for s in setups}
    latencies = {s.name: s.samples.latencies for s in setups}
    h, d, f = out["haproxy"], out["direct"], out["floor"]
    ratios = {
        "haproxy_vs_floor_throughput": _ratio(h["calls_per_s"], f["calls_per_s"]),
        "haproxy_vs_direct_throughput": _ratio(h["calls_per_s"], d["calls_per_s"]),
        "haproxy_vs_direct_p50": _ratio(h["p50_ms"], d["p50_ms"]),
        "direct_vs_floor_throughput": _ratio(d["calls_per_s"], f["calls_per_s"]),
    }
    if "compare" in out:
        ratios["compare_vs_haproxy_throughput"] = _ratio(out["compare"]["calls_per_s"], h["calls_per_s"])
        ratios["compare_vs_haproxy_p50"] = _ratio(out["compare"]["p50_ms"], h["p50_ms"])
    if "reference" in out:
        r = out["reference"]
        ratios["haproxy_vs_reference_throughput"] = _ratio(h["calls_per_s"], r["calls_per_s"])
        ratios["haproxy_vs_reference_p50"] = _ratio(h["p50_ms"], r["p50_ms"])
        ratios["haproxy_vs_reference_p99"] = _ratio(h["p99_ms"], r["p99_ms"])
        ratios["reference_vs_floor_throughput"] = _ratio(r["calls_per_s"], f["calls_per_s"])
    return {"setups": out, "ratios": ratios, **redis_per_call(watch.rounds, watch.idle), "_latencies": latencies}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 3)


async def section_hop(stack: Stack, plan: Plan, progress: Progress, task) -> dict:
    kind = SessionClient if plan.generation == "session" else SessionlessClient
    setups: list[Setup] = []
    rounds, seconds = plan.hop
    try:
        setups.append(await open_setup("haproxy", stack.config.mcp_url, kind, 1))
        setups.append(await open_setup("direct", replica_url(stack), kind, 1))
        await interleave(setups, plan.mix, rounds, seconds, progress, task, "proxy hop, one session")
    finally:
        for setup in setups:
            await close_setup(setup)
    h, d = setups[0].samples.stats(), setups[1].samples.stats()
    hop = None if h["p50_ms"] is None or d["p50_ms"] is None else round(h["p50_ms"] - d["p50_ms"], 3)
    return {"haproxy": h, "direct": d, "hop_p50_ms": hop}


async def section_scale(stack: Stack, plan: Plan, progress: Progress, task) -> dict:
    """One session through HAProxy at 0 sessions in the store, then at each level between two windows at 0.

    The machine's load (2 cores, other processes) moves over seconds, and only ever adds latency: a level is
    compared with the slower of the windows at 0 on either side of it, each as close to it as its fill and
    emptying allow. Windows seconds apart (0, 10k, 100k, 0) read a load swing as the store's cost."""
    kind = SessionClient if plan.generation == "session" else SessionlessClient
    redis = stack.config
    setup = await open_setup("scale", stack.config.mcp_url, kind, 1)
    levels: list[dict] = []
    filled: list[tuple[str, int]] = []  # (marker, count) to empty afterwards

    async def measure(level: int) -> None:
        setup.samples = Samples()
        progress.update(task, description=f"scale: one session at {level:,} sessions in the store")
        await run_round(setup, plan.mix, plan.scale_seconds)
        progress.advance(task, plan.scale_seconds)
        levels.append({"sessions_in_store": level, **setup.samples.stats()})

    try:
        await run_round(setup, plan.mix, 0.5, measure=False)
        await measure(0)
        for level in plan.scale_levels:
            if not level:
                continue
            marker = uuid.uuid4().hex[:8]
            progress.update(task, description=f"scale: filling the store to {level:,} sessions")
            filled.append((marker, level))
            await asyncio.to_thread(fill, redis, FILL, level, marker)
            await measure(level)
            progress.update(task, description="scale: emptying the store")
            await asyncio.to_thread(fill, redis, EMPTY, level, marker)
            filled.pop()  # only once emptied: the finally below empties what is left
            await measure(0)
    finally:
        for marker, count in filled:
            await asyncio.to_thread(fill, redis, EMPTY, count, marker)
        await close_setup(setup)
    zero = [lv["p50_ms"] for lv in levels if lv["sessions_in_store"] == 0 and lv["p50_ms"]]
    base = statistics.fmean(zero) if zero else None
    ratios = {
        str(lv["sessions_in_store"]): _ratio(lv["p50_ms"], max(before["p50_ms"] or 0, after["p50_ms"] or 0))
        for before, lv, after in zip(levels, levels[1:], levels[2:], strict=False)
        if lv["sessions_in_store"]
    }
    return {"levels": levels, "baseline_p50_ms": None if base is None else round(base, 3), "p50_ratio_to_0": ratios}


async def section_memory(stack: Stack, plan: Plan, progress: Progress, task) -> dict:
    """Real sessions through HAProxy, each with a counter and three short notes; what Redis holds for them."""
    redis = stack.config
    count = plan.memory_sessions
    progress.update(task, description=f"memory: {count} sessions, each a counter and three notes")
    http = new_http(16)
    clients = [SessionClient(http, stack.config.mcp_url) for _ in range(count)]
    before = await asyncio.to_thread(used_memory, redis)
    try:
        failures = await make_noted_sessions(clients)
        after = await asyncio.to_thread(used_memory, redis)
        if failures:
            raise BenchError(f"memory: {len(failures)} of {count} sessions could not be made: {failures[0]}")
        # Every key each of a few sessions made, by MEMORY USAGE.
        per_session = [await session_key_sizes(redis, client.session_id) for client in clients[:5]]
        # At rest: what the session keeps once its retry and resumption records
        # have expired (op TTL, event TTL), deleted here rather than waited for.
        await asyncio.to_thread(_forget_transient, redis, [c.session_id for c in clients])
        at_rest = await asyncio.to_thread(used_memory, redis)
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        await http.aclose()
    per_key = {k: round(statistics.fmean(s[k] for s in per_session), 1) for k in ("session", "events", "op", "op_keys")}
    if os.environ.get("BENCH_KEEP_MEMORY_SESSIONS") != "1":
        await asyncio.to_thread(_forget_sessions, redis, [c.session_id for c in clients if c.session_id])
    return {
        "sessions_created": count,
        "memory_usage_per_key": per_key,
        "resident": per_key["session"],
        "transient": round(per_key["events"] + per_key["op"], 1),
        "used_memory_delta": after - before,
        "used_memory_delta_per_session": round((after - before) / count, 1),
        "used_memory_at_rest_per_session": round((at_rest - before) / count, 1),
        "note": "each session: initialize, increment_counter, add_note x3 (session-era, through HAProxy); "
        "MEMORY USAGE averaged over 5 of them. Resident: the session's hash (state and adoption "
        "record), kept while the session lives. Transient: op records (kept the op TTL, for retries) "
        "and the event log (kept the event TTL, for stream resumption). used_memory deltas over all, "
        "which also count the live-session index entry and Redis's own overhead; at rest is after "
        "the transient keys are gone",
    }


async def make_noted_sessions(clients: list[SessionClient]) -> list[str]:
    """Each client opens a session and makes a counter and three notes in it, 16 at a time; why those that
    failed did."""
    failures: list[str] = []
    gate = asyncio.Semaphore(16)

    async def make(client: SessionClient) -> None:
        async with gate:
            try:
                async with asyncio.timeout(30):
                    await client.open()
                    await client.call_tool("increment_counter", {})
                    for note in ("one", "two", "three"):
                        await client.call_tool("add_note", {"note": note})
            except CALL_ERRORS as exc:
                failures.append(f"{type(exc).__name__}: {exc}"[:200])

    await asyncio.gather(*(make(c) for c in clients))
    return failures


async def session_key_sizes(redis: StackConfig, sid: str | None) -> dict[str, int]:
    """MEMORY USAGE of every key of session `sid`, by kind (its hash, its event log, its op records), and how
    many op records it has."""
    keys = {
        "session": [f"mcp:session:{sid}"],
        "events": [f"mcp:events:{sid}"],
        "op": await asyncio.to_thread(scan, redis, f"mcp:ops:{sid}:*"),
    }
    sizes = {}
    for kind, names in keys.items():
        total = 0
        for name in names:
            out = (await asyncio.to_thread(redis_cli, redis, "MEMORY", "USAGE", name, "SAMPLES", "0")).strip()
            if not out.isdigit() and kind == "session":
                # Counting it as 0 would make the per-session figure look better than it is.
                raise BenchError(f"memory: {name} is missing ({out or 'no answer'})")
            total += int(out) if out.isdigit() else 0
        sizes[kind] = total
    sizes["op_keys"] = len(keys["op"])
    return sizes


async def section_durability(plan: Plan, call_p50_ms: float | None, state_dir: Path, progress: Progress, task) -> dict:
    """Keyed increments on a primary with one replica, with and without REDIS_WAIT_REPLICAS=1."""
    pair = Stack(StackConfig.on_free_ports(state_dir, replicas=0, redis_mode="sentinel"))
    stores: dict[str, RedisSessionStore] = {}
    setups: dict[str, Setup] = {}
    rounds, seconds = plan.durability
    try:
        progress.update(task, description="durability: starting a Redis primary and its replica")
        for name in ("redis-1", "redis-2"):
            await asyncio.to_thread(pair.start, name)
        url = pair.config.redis_url
        auth = pair.config.redis_auth
        stores = {
            "no_wait": RedisSessionStore(url, **auth, prefix="mcp:bench"),
            "wait_1": RedisSessionStore(url, **auth, prefix="mcp:bench", wait_replicas=1),
        }
        setups = {
            name: Setup(name, url, [StoreClient(store) for _ in range(plan.sessions)], None)
            for name, store in stores.items()
        }
        await interleave(list(setups.values()), [("incr", 1)], rounds, seconds, progress, task, "durability")
    finally:
        for store in stores.values():
            await store.aclose()
        await asyncio.to_thread(pair.down)
    out = {name: setup.samples.stats() for name, setup in setups.items()}
    added = (
        None
        if out["wait_1"]["p50_ms"] is None or out["no_wait"]["p50_ms"] is None
        else round(out["wait_1"]["p50_ms"] - out["no_wait"]["p50_ms"], 3)
    )
    return {
        **out,
        "throughput_ratio": _ratio(out["wait_1"]["calls_per_s"], out["no_wait"]["calls_per_s"]),
        "write_p50_added_ms": added,
        "share_of_call_p50": None if added is None or not call_p50_ms else round(added / call_p50_ms, 4),
        "note": f"{plan.sessions} sessions of keyed store.incr back to back on a loopback primary and replica; "
        "share_of_call_p50: the added write latency over the p50 of a tool call through HAProxy "
        "(throughput section)",
    }


# -- capacity: what Redis spends per call of each shape, and what that makes of 1, 3 and 9 primaries ----

ShapeKind = Callable[[httpx2.AsyncClient, str], Client]


def shape_kinds(plan: Plan) -> dict[str, tuple[ShapeKind, list[tuple[str, int]]]]:
    """Each call shape's kind of client and the tools it calls, in the tables' order; no task shape without
    fastmcp-tasks (the kit's tasks extra), without which the replicas serve no tasks."""
    kinds: dict[str, tuple[ShapeKind, list[tuple[str, int]]]] = {
        "plain": (SessionClient, [("increment_counter", 1)]),
        "streamed": (StreamedClient, [("analyze_data", 1)]),
        "task": (lambda http, url: TaskClient(url), [("analyze_data", 1)]),
        "initialize": (InitializeClient, [("initialize", 1)]),
        "mix": (SessionClient if plan.generation == "session" else SessionlessClient, plan.mix),
    }
    if importlib.util.find_spec("fastmcp_tasks") is None:
        del kinds["task"]
    return kinds


def shape_evidence(setup: Setup) -> Counter[str]:
    """What shows the calls were of their shape: answers that came as SSE streams, and tasks/get polls."""
    return Counter(
        answers_streamed=sum(c.streamed for c in setup.clients if isinstance(c, StreamedClient)),
        task_polls=sum(c.polls for c in setup.clients if isinstance(c, TaskClient)),
    )


async def measure_shape(
    stack: Stack, plan: Plan, shape: str, sessions: int, kind: ShapeKind, tools: list[tuple[str, int]]
) -> tuple[dict, Tally]:
    """`plan.capacity_calls(shape)` calls of one shape through HAProxy, `sessions` at a time, between two
    readings of Redis's INFO cpu and commandstats: the calls' figures, and what Redis ran meanwhile."""
    setup = await open_setup(shape, stack.config.mcp_url, kind, sessions)
    try:
        await probe_tools(setup, tools)
        # One call each first, outside the window: a session's first write makes what later ones reuse.
        await run_round(setup, tools, CALL_TIMEOUT, measure=False, calls=1)
        watch = setup.redis = redis_watch(stack)
        before = shape_evidence(setup)
        calls = -(-plan.capacity_calls(shape) // sessions)  # per client, rounded up
        await run_round(setup, tools, calls * CALL_TIMEOUT, calls=calls)
        evidence = shape_evidence(setup)
        evidence.subtract(before)
    finally:
        await close_setup(setup)
    return {"sessions": sessions, **setup.samples.stats(), **evidence}, watch.rounds


def shape_figures(stats: dict, rounds: Tally, idle: Tally) -> dict:
    """One shape's calls, with Redis's work per call less Redis at rest, and the calls/s that CPU allows."""
    figures = redis_per_call(rounds, idle)
    cpu_us = figures["redis_cpu_us_per_call"]
    # Computed, not measured: one primary's main thread busy with these calls and nothing else.
    per_primary = round(1e6 / cpu_us) if cpu_us and cpu_us > 0 else None
    return {**stats, **figures, "calls_per_s_per_primary": per_primary}


async def section_capacity(stack: Stack, plan: Plan, at_rest_bytes: float | None, progress: Progress, task) -> dict:
    """Redis CPU and commands per call of each call shape, and what they and a session's bytes make of 1, 3
    and 9 primaries. Redis at rest is measured half before the shapes' batches and half after."""
    try:  # The replicas' settings: they start from the environment recorded with the stack, not the bench's.
        settings = Settings.from_env(stack.config.env)
    except SettingsError as exc:
        raise BenchError(f"capacity: the stack's settings cannot be read: {exc}") from None
    watch = redis_watch(stack)
    half = plan.capacity_idle_seconds / 2
    progress.update(task, description="capacity: Redis with no calls")
    await watch.measure_idle(half)
    measured = {}
    for shape, (kind, tools) in shape_kinds(plan).items():
        # One client address has at most MAX_TASKS_PER_CLIENT tasks unfinished: more at once are refused.
        sessions = min(plan.sessions, settings.max_tasks_per_client) if shape == "task" else plan.sessions
        progress.update(task, description=f"capacity: {plan.capacity_calls(shape)} calls, {shape}")
        measured[shape] = await measure_shape(stack, plan, shape, sessions, kind, tools)
    progress.update(task, description="capacity: Redis with no calls, again")
    await watch.measure_idle(half)
    progress.advance(task, plan.capacity_idle_seconds)
    shapes = {shape: shape_figures(stats, rounds, watch.idle) for shape, (stats, rounds) in measured.items()}
    figures = capacity_figures(shapes, at_rest_bytes, settings, round(plan.primary_memory_gib * 1024**3))
    if stack.config.redis_mode == "cluster":
        figures["cluster_primaries"] = len(watch.ports)
    return figures


def session_bounds(settings: Settings) -> dict[str, int]:
    """What a session at its bounds holds beyond a session at rest, as the store's quota counts it: in its
    hash, a full state (its JSON text) and record (the client's info and capabilities); a full event log (its
    text, EVENT_BYTES per event, and its two keys, the log and its byte count, each key_bytes)."""
    log = "mcp:events:" + "0" * 32
    return {
        "MAX_SESSION_STATE_BYTES": settings.max_state_bytes,
        "MAX_SESSION_RECORD_BYTES": settings.max_record_bytes,
        "MAX_SESSION_LOG_BYTES": settings.max_log_bytes,
        f"{DEFAULT_MAX_EVENTS:,} events x EVENT_BYTES {EVENT_BYTES}": DEFAULT_MAX_EVENTS * EVENT_BYTES,
        "the event log's 2 keys": key_bytes(log) + key_bytes(f"{log}:bytes"),
    }


def capacity_figures(shapes: dict[str, dict], at_rest: float | None, settings: Settings, primary_memory: int) -> dict:
    """Per primary and for 1, 3 and 9: sessions held (memory / bytes per session) and calls/s served
    (primaries x 1 / CPU seconds per call), with sessions, and so calls, spread evenly over the primaries.
    `at_rest` None (no memory section: a cluster's run): calls/s alone."""
    bounds = session_bounds(settings)
    at_bounds = None if at_rest is None else round(at_rest + sum(bounds.values()))
    # A noisy memory section can measure nothing at rest: then no figure is made of it.
    held_at_rest = int(primary_memory // at_rest) if at_rest else None
    held_at_bounds = None if at_bounds is None else primary_memory // at_bounds
    serve = {shape: figures["calls_per_s_per_primary"] for shape, figures in shapes.items()}
    return {
        "shapes": shapes,
        "bytes_per_session": None
        if at_rest is None
        else {"at_rest": at_rest, "at_bounds": at_bounds, "bounds_added": bounds},
        "primary_memory_bytes": primary_memory,
        "max_sessions": settings.max_sessions,
        "primaries": [
            {
                "primaries": n,
                "memory_bytes": n * primary_memory,
                "sessions_at_rest": None if held_at_rest is None else n * held_at_rest,
                "sessions_at_bounds": None if held_at_bounds is None else n * held_at_bounds,
                "calls_per_s": {shape: None if v is None else n * v for shape, v in serve.items()},
            }
            for n in PRIMARIES
        ],
        "note": "calls_per_s_per_primary and primaries are computed, not measured, from the measured CPU per "
        "call and bytes per session",
    }


def _forget_transient(redis: StackConfig, sids: list[str | None]) -> None:
    wanted = {sid for sid in sids if sid}
    keys = [k for k in scan(redis, "mcp:ops:*") if k.split(":")[2] in wanted]
    delete_keys(redis, keys + [f"mcp:events:{sid}" for sid in wanted])


def _forget_sessions(redis: StackConfig, sids: list[str]) -> None:
    """What the memory section made goes again (also on the running stack, which outlives the bench)."""
    wanted = set(sids)
    keys = [k for k in scan(redis, "mcp:ops:*") if k.split(":")[2] in wanted]
    for sid in sids:
        keys += [f"mcp:session:{sid}", f"mcp:events:{sid}"]
    delete_keys(redis, keys)
    for i in range(0, len(sids), 500):
        redis_cli(redis, stdin="ZREM mcp:sessions " + " ".join(sids[i : i + 500]) + "\n")


def forget_floor_keys(redis: StackConfig) -> None:
    delete_keys(redis, scan(redis, f"{FLOOR_PREFIX}:*"))


# -- targets ------------------------------------------------------------------------------


def targets(report: dict) -> list[dict]:
    """The targets of the sections that ran."""

    def row(target: str, value: float | None, bound: float, *, higher_is_better: bool = False) -> dict:
        holds = value is not None and (value >= bound if higher_is_better else value <= bound)
        return {"target": target, "value": value, "bound": bound, "higher_is_better": higher_is_better, "holds": holds}

    t = report["throughput"]["ratios"] if "throughput" in report else {}
    rows = []
    if t:
        what = f"MCP throughput through HAProxy >= {TARGET_FLOOR_FRACTION:.0%} of the floor's"
        rows.append(row(what, t["haproxy_vs_floor_throughput"], TARGET_FLOOR_FRACTION, higher_is_better=True))
    if "scale" in report:
        scale = report["scale"]["p50_ratio_to_0"]
        top = max(scale, key=int) if scale else None
        what = f"latency at {int(top):,} sessions <= {TARGET_SCALE_RATIO}x at 0" if top else "latency at scale"
        rows.append(row(what, scale.get(top) if top else None, TARGET_SCALE_RATIO))
        rows[-1]["sessions"] = int(top) if top else None
    if "memory" in report:
        what = f"Redis bytes per session <= {TARGET_BYTES_PER_SESSION} (resident, MEMORY USAGE)"
        rows.append(row(what, report["memory"]["resident"], TARGET_BYTES_PER_SESSION))
    if "proxy_hop" in report:
        what = f"p50 through HAProxy <= direct p50 + {TARGET_HOP_MS:g} ms (one session)"
        rows.append(row(what, report["proxy_hop"]["hop_p50_ms"], TARGET_HOP_MS))
    if "haproxy_vs_reference_throughput" in t:
        what = f"MCP throughput through HAProxy >= {TARGET_REFERENCE_THROUGHPUT:g}x the reference kit's"
        rows.append(row(what, t["haproxy_vs_reference_throughput"], TARGET_REFERENCE_THROUGHPUT, higher_is_better=True))
        what = f"p99 through HAProxy <= {TARGET_REFERENCE_P99:g}x the reference kit's"
        rows.append(row(what, t["haproxy_vs_reference_p99"], TARGET_REFERENCE_P99))
    return rows


def against_reference(report: dict) -> dict:
    """This kit against the reference kit, from the throughput section's one interleaved run: what ran, the
    calls/s and p50/p99 of each, their ratios, and each one's calls/s as a fraction of the floor's."""
    setups, ratios = report["throughput"]["setups"], report["throughput"]["ratios"]

    def figures(stats: dict) -> dict:
        return {k: stats[k] for k in ("url", "calls", "errors", "calls_per_s", "p50_ms", "p95_ms", "p99_ms")}

    return {
        **report["reference"],
        "sessions": report["config"]["sessions"],
        "mix": report["config"]["mix"],
        "generation": report["config"]["generation"],
        "kit": figures(setups["haproxy"]),
        "reference": figures(setups["reference"]),
        "floor_calls_per_s": setups["floor"]["calls_per_s"],
        "throughput_ratio": ratios["haproxy_vs_reference_throughput"],
        "p50_ratio": ratios["haproxy_vs_reference_p50"],
        "p99_ratio": ratios["haproxy_vs_reference_p99"],
        "kit_vs_floor_throughput": ratios["haproxy_vs_floor_throughput"],
        "reference_vs_floor_throughput": ratios["reference_vs_floor_throughput"],
        "targets": {
            "throughput_ratio_at_least": TARGET_REFERENCE_THROUGHPUT,
            "p99_ratio_at_most": TARGET_REFERENCE_P99,
        },
        "note": "the throughput section's haproxy and reference setups, interleaved in one run: "
        "throughput_ratio and p50/p99_ratio are this kit's over the reference kit's",
    }


def measured_errors(report: dict) -> list[str]:
    out = []
    groups = {
        **{f"throughput/{k}": v for k, v in report.get("throughput", {"setups": {}})["setups"].items()},
        **{f"proxy_hop/{k}": report["proxy_hop"][k] for k in ("haproxy", "direct") if "proxy_hop" in report},
        **{f"scale/{lv['sessions_in_store']}": lv for lv in report.get("scale", {"levels": []})["levels"]},
        **{f"durability/{k}": report["durability"][k] for k in ("no_wait", "wait_1") if "durability" in report},
        **{f"capacity/{k}": v for k, v in report.get("capacity", {"shapes": {}})["shapes"].items()},
    }
    for name, stats in groups.items():
        if stats["errors"] or not stats["ok"]:
            sample = stats["error_samples"][0] if stats["error_samples"] else "no call succeeded"
            out.append(f"{name}: {stats['errors']} of {stats['calls']} calls failed ({sample})")
    return out


# -- output -------------------------------------------------------------------------------


console = Console(width=None if sys.stdout.isatty() else 160)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


@dataclass
class Section:
    """One table of figures, as plain strings: printed with rich, or written as markdown."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    caption: str = ""
    left: tuple[str, ...] = ()  # the columns aligned left; the others (figures) right


def sections(report: dict) -> list[Section]:
    """The tables of the bench markers' block, of the sections that ran."""
    return [table(report) for name, table in BENCH_TABLES.items() if name in report]


def throughput_table(report: dict) -> Section:
    """The throughput section: each setup's calls, latency and instances, the ratios, Redis per call."""
    c = report["config"]
    rows = [
        [
            name,
            str(s["calls"]),
            str(s["errors"]),
            f"{s['calls_per_s']:.0f}",
            _ms(s["p50_ms"]),
            _ms(s["p95_ms"]),
            _ms(s["p99_ms"]),
            " ".join(f"{k}:{v}" for k, v in s["instances"].items()),
        ]
        for name, s in report["throughput"]["setups"].items()
    ]
    caption = "  ".join(f"{k} {v}" for k, v in report["throughput"]["ratios"].items())
    if "redis_per_call" in report["throughput"]:
        caption += "\n" + redis_line(report["throughput"])
    return Section(
        f"Throughput: {c['sessions']} sessions, mix {c['mix']}, {c['generation']} clients",
        ["setup", "calls", "errors", "calls/s", "p50 ms", "p95 ms", "p99 ms", "answered by"],
        rows,
        caption,
        left=("setup", "answered by"),
    )


def hop_table(report: dict) -> Section:
    """The proxy hop: one session through HAProxy and directly."""
    h = report["proxy_hop"]
    rows = [
        [
            name,
            str(h[name]["calls"]),
            str(h[name]["errors"]),
            _ms(h[name]["p50_ms"]),
            _ms(h[name]["p95_ms"]),
            _ms(h[name]["p99_ms"]),
        ]
        for name in ("haproxy", "direct")
    ]
    return Section(
        "Proxy hop, one session",
        ["setup", "calls", "errors", "p50 ms", "p95 ms", "p99 ms"],
        rows,
        f"hop (p50 difference): {_ms(h['hop_p50_ms'])} ms",
        left=("setup",),
    )


def scale_table(report: dict) -> Section:
    """Latency as sessions pile up in the store."""
    sc = report["scale"]
    rows = []
    for lv in sc["levels"]:
        n = lv["sessions_in_store"]
        ratio = sc["p50_ratio_to_0"].get(str(n)) if n else None
        rows.append(
            [
                f"{n:,}",
                str(lv["calls"]),
                str(lv["errors"]),
                _ms(lv["p50_ms"]),
                _ms(lv["p95_ms"]),
                _ms(lv["p99_ms"]),
                "-" if ratio is None else f"{ratio:.2f}",
            ]
        )
    return Section(
        "Latency as sessions pile up (one session, through HAProxy)",
        ["sessions in store", "calls", "errors", "p50 ms", "p95 ms", "p99 ms", "p50 / the slower 0 beside it"],
        rows,
    )


def memory_table(report: dict) -> Section:
    """Redis bytes per session, by key and by used_memory."""
    m = report["memory"]
    per = m["memory_usage_per_key"]
    rows = [
        ["resident: mcp:session:<id> (state + adoption record)", f"{per['session']:.0f}"],
        ["transient: mcp:events:<id> (event TTL)", f"{per['events']:.0f}"],
        [f"transient: mcp:ops:<id>:* (its calls' op records, {per['op_keys']:.0f} key(s), op TTL)", f"{per['op']:.0f}"],
        [
            "used_memory delta / session, right after the calls (no client buffers)",
            f"{m['used_memory_delta_per_session']:.0f}",
        ],
        ["used_memory delta / session, at rest (no client buffers)", f"{m['used_memory_at_rest_per_session']:.0f}"],
    ]
    return Section(
        f"Redis per session (counter + 3 notes), {m['sessions_created']} sessions",
        ["key", "bytes"],
        rows,
        left=("key",),
    )


def durability_table(report: dict) -> Section:
    """A keyed write with and without waiting for a replica."""
    d = report["durability"]
    rows = [
        [
            label,
            str(d[name]["calls"]),
            str(d[name]["errors"]),
            f"{d[name]['calls_per_s']:.0f}",
            _ms(d[name]["p50_ms"]),
            _ms(d[name]["p95_ms"]),
            _ms(d[name]["p99_ms"]),
        ]
        for name, label in (("no_wait", "0"), ("wait_1", "1"))
    ]
    share = "-" if d["share_of_call_p50"] is None else f"{d['share_of_call_p50']:.1%}"
    return Section(
        "Durability: a keyed write, with and without a replica's acknowledgement (WAIT)",
        ["REDIS_WAIT_REPLICAS", "writes", "errors", "writes/s", "p50 ms", "p95 ms", "p99 ms"],
        rows,
        f"throughput ratio {d['throughput_ratio']}; p50 added {_ms(d['write_p50_added_ms'])} ms per "
        f"write, {share} of a tool call's p50 through HAProxy",
        left=("REDIS_WAIT_REPLICAS",),
    )


BENCH_TABLES: dict[str, Callable[[dict], Section]] = {
    "throughput": throughput_table,
    "proxy_hop": hop_table,
    "scale": scale_table,
    "memory": memory_table,
    "durability": durability_table,
}


def _gib(n: int) -> str:
    return f"{n / 1024**3:g} GiB"


def _count(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def capacity_tables(capacity: dict) -> list[Section]:
    """The capacity section as three tables: Redis per call by shape, bytes per session, 1, 3 and 9 primaries."""
    shapes = capacity["shapes"]
    rows = [
        [
            name,
            str(s["sessions"]),
            str(s["calls"]),
            str(s["errors"]),
            _ratio_text(s["redis_round_trips_per_call"]),
            _ratio_text(s["redis_commands_per_call"], 1),
            _ratio_text(s["redis_cpu_us_per_call"], 1),
            _count(s["calls_per_s_per_primary"]),
        ]
        for name, s in shapes.items()
    ]
    d = next(iter(shapes.values()))["redis_per_call"]
    idle_rate = d["idle_cpu_seconds"] / d["idle_seconds"] * 1e3 if d["idle_seconds"] else 0.0
    primaries = capacity.get("cluster_primaries")
    on = "" if primaries is None else f", on a Redis Cluster of {primaries} primaries"
    summed = "" if primaries is None else f" Summed over the {primaries} primaries, so per call, whichever serves it."
    per_call = Section(
        f"Capacity: Redis per call of each shape, through HAProxy{on}",
        [
            "shape",
            "sessions at a time",
            "calls",
            "errors",
            "round trips / call",
            "commands / call",
            "CPU µs / call",
            "calls/s per primary (computed)",
        ],
        rows,
        "Measured: Redis's INFO cpu (its main thread: used_cpu_sys_main_thread + used_cpu_user_main_thread) "
        "and INFO commandstats right before and after each shape's batch, less Redis at rest at its rate "
        f"({d['idle_seconds']:.1f} s with no calls: {idle_rate:.2f} ms of CPU a second), per call.{summed}\n"
        "Computed, not measured: calls/s per primary = 1 / (CPU seconds per call), one Redis primary's main "
        "thread busy with nothing but such calls, however many replicas are in front of it.",
        left=("shape",),
    )
    if capacity["bytes_per_session"] is None:
        return [per_call, primaries_table(capacity)]
    return [per_call, bytes_table(capacity), primaries_table(capacity)]


def bytes_table(capacity: dict) -> Section:
    """Bytes per session at rest (measured) and at its bounds (computed), the arithmetic in the caption."""
    b = capacity["bytes_per_session"]
    terms = " + ".join(f"{name} ({n:,})" for name, n in b["bounds_added"].items())
    return Section(
        "Capacity: Redis bytes per session",
        ["session", "bytes"],
        [
            ["at rest (measured: the memory section's used_memory delta at rest)", f"{b['at_rest']:,.0f}"],
            ["at its bounds (computed from the settings)", f"{b['at_bounds']:,.0f}"],
        ],
        f"At its bounds = at rest ({b['at_rest']:,.0f}) + {terms} = {b['at_bounds']:,} bytes: a full state, "
        "record and event log, as the store's quota counts them. Not per session: a write's op record (one "
        "per keyed call, kept OP_TTL_SECONDS), which with all else a client holds counts against "
        "MAX_CLIENT_BYTES per client.",
        left=("session",),
    )


def primaries_table(capacity: dict) -> Section:
    """What 1, 3 and 9 primaries hold and serve."""
    shapes = list(capacity["shapes"])
    rows = [
        [
            str(p["primaries"]),
            _gib(p["memory_bytes"]),
            _count(p["sessions_at_rest"]),
            _count(p["sessions_at_bounds"]),
            *(_count(p["calls_per_s"][shape]) for shape in shapes),
        ]
        for p in capacity["primaries"]
    ]
    if capacity["bytes_per_session"] is None:
        return Section(
            "Capacity: what 1, 3 and 9 Redis primaries of a cluster serve (computed)",
            ["primaries", *(f"{s} calls/s" for s in shapes)],
            [[row[0], *row[4:]] for row in rows],
            "Computed, not measured, from the CPU per call measured on the cluster above: calls/s = primaries x "
            "1 / (CPU seconds per call), each primary's main thread fully busy, sessions (and so calls) spread "
            "evenly over the primaries by their hash tags. A session's bytes are the single Redis's table's.",
        )
    return Section(
        f"Capacity: what 1, 3 and 9 Redis primaries hold and serve, {_gib(capacity['primary_memory_bytes'])} "
        "per primary (computed)",
        ["primaries", "memory", "sessions at rest", "sessions at bounds", *(f"{s} calls/s" for s in shapes)],
        rows,
        "Computed, not measured, from the measured CPU per call and bytes per session above: sessions = memory "
        "/ bytes per session (used_memory; leave Redis headroom beyond it); calls/s = primaries x 1 / (CPU "
        "seconds per call), each primary's main thread fully busy. Assumes sessions, and so calls, spread "
        "evenly over the primaries, as a cluster layout that hash-tags each session's keys gives. MAX_SESSIONS "
        f"({capacity['max_sessions']:,}) caps live sessions across the deployment.",
    )


def redis_line(throughput: dict) -> str:
    """One line: the haproxy setup's Redis round trips and commands per MCP call (redis_per_call)."""
    rt, cmds, d = (
        throughput["redis_round_trips_per_call"],
        throughput["redis_commands_per_call"],
        throughput["redis_per_call"],
    )
    at_rest = (
        f"less Redis at rest ({d['subtracted_commands']:g} commands, {d['subtracted_round_trips']:g} round trips "
        f"at its rate over {d['idle_seconds']:.1f} s with no calls)"
        if d["idle_subtracted"]
        else "Redis at rest included (leases, health checks)"
    )
    return (
        f"Redis per MCP call through HAProxy: {_ratio_text(rt)} round trips (FCALL), {_ratio_text(cmds, 1)} "
        f"commands (INFO commandstats around the {d['rounds']} haproxy rounds, {d['mcp_calls']} calls; {at_rest})"
    )


def _ratio_text(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def reference_section(ref: dict) -> Section:
    """report["reference"] as one table: each kit's calls/s and latency, then the ratios, then what ran."""
    rows = [
        [
            label,
            str(s["calls"]),
            str(s["errors"]),
            f"{s['calls_per_s']:.0f}",
            _ms(s["p50_ms"]),
            _ms(s["p99_ms"]),
            _ratio_text(share, 3),
        ]
        for label, s, share in (
            ("this kit", ref["kit"], ref["kit_vs_floor_throughput"]),
            ("reference kit", ref["reference"], ref["reference_vs_floor_throughput"]),
        )
    ]
    t, p99 = ref["throughput_ratio"], ref["p99_ratio"]
    holds_t = t is not None and t >= TARGET_REFERENCE_THROUGHPUT
    holds_p99 = p99 is not None and p99 <= TARGET_REFERENCE_P99
    pinned = ", ".join(f"{k} {v}" for k, v in ref["pinned"].items())
    where = f"commit {ref['commit'][:12]}" if ref.get("commit") else f"requirements digest {ref['requirements_digest']}"
    caption = (
        f"this kit / reference: throughput {_ratio_text(t)}x (target >= {TARGET_REFERENCE_THROUGHPUT:g}x: "
        f"{'holds' if holds_t else 'missed'}), p50 {_ratio_text(ref['p50_ratio'])}x, p99 {_ratio_text(p99)}x "
        f"(target <= {TARGET_REFERENCE_P99:g}x: {'holds' if holds_p99 else 'missed'}); this kit's throughput is "
        f"{_ratio_text(ref['kit_vs_floor_throughput'], 3)} of the floor's ({ref['floor_calls_per_s']:.0f} calls/s). "
        f"Reference: vikrantjain/mcp-high-availability ({where}; {pinned}), {ref['replicas']} replicas, "
        f"its redis-server, its haproxy.cfg on loopback ports."
    )
    return Section(
        f"Against the reference kit: {ref['sessions']} sessions, mix {ref['mix']}, {ref['generation']} clients, "
        "through each kit's HAProxy, interleaved",
        ["kit", "calls", "errors", "calls/s", "p50 ms", "p99 ms", "calls/s / floor"],
        rows,
        caption,
        left=("kit",),
    )


def _styled(column: str, value: str) -> str:
    """A cell for rich: errors above 0 and missed targets in red, targets that hold in green."""
    if column in ("errors", "failed") and value not in ("0", ""):
        return f"[red]{escape(value)}[/red]"
    if column in ("targets", "holds") and value:
        return f"[green]{value}[/green]" if value in ("met", "holds") else f"[red]{escape(value)}[/red]"
    return escape(value)


def rich_table(section: Section, *, show_lines: bool = False) -> Table:
    """`section` for the terminal."""
    table = Table(title=section.title, title_justify="left", show_lines=show_lines)
    for column in section.columns:
        table.add_column(column, justify="left" if column in section.left else "right")
    for row in section.rows:
        table.add_row(*(_styled(column, value) for column, value in zip(section.columns, row, strict=True)))
    if section.caption:
        table.caption = escape(section.caption)
        table.caption_justify = "left"
    return table


def results_tables(report: dict) -> list[Table]:
    capacity = capacity_tables(report["capacity"]) if "capacity" in report else []
    extra = [reference_section(report["reference"])] if "reference" in report else []
    return [rich_table(s) for s in [*sections(report), *capacity, *extra]]


# -- figures into a markdown document (shared with tools.failover_bench) -----------------


class MarkdownError(Exception):
    """A document the figures cannot go into; the message says why."""


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def _region(text: str, path: Path, name: str) -> tuple[int, int]:
    """Where the figures go in `text`: from the end of the start marker to the start of the end marker."""
    start, end = markers(name)
    starts, ends = text.count(start), text.count(end)
    if starts != 1 or ends != 1 or text.index(start) > text.index(end):
        found = f"found {start} {starts} time(s) and {end} {ends} time(s)" + (
            ", the end marker first" if starts == ends == 1 else ""
        )
        raise MarkdownError(
            f"{path} needs the markers {start} and {end}, each once and in that order, where the figures go ({found})"
        )
    return text.index(start) + len(start), text.index(end)


def _read(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise MarkdownError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise MarkdownError(f"{path} is not UTF-8 text: {exc}") from None


def check_markers(path: Path, name: str) -> None:
    """MarkdownError unless `path` has `name`'s start and end markers, each once, in that order."""
    _region(_read(path), path, name)


def write_between_markers(path: Path, name: str, body: str) -> None:
    """Replace what lies between `name`'s markers in `path` with `body`; every byte outside them stays."""
    write_blocks(path, {name: body})


def write_blocks(path: Path, bodies: dict[str, str]) -> None:
    """Replace what lies between each name's markers in `path` with its body, all in one write; every byte
    outside them stays."""
    text = _read(path)
    for name, body in bodies.items():
        begin, end = _region(text, path, name)
        # The figures' lines end as the start marker's line does.
        newline = "\r\n" if text.startswith("\r\n", begin) else "\n"
        inner = newline + newline.join(body.strip("\n").split("\n")) + newline
        text = text[:begin] + inner + text[end:]
    data = text.encode("utf-8")
    # Written aside and moved over the document: an interrupted run never leaves it half written.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def markdown_option(name: str) -> Callable:
    """`--markdown FILE`, whose markers are checked before anything is measured."""
    start, end = markers(name)

    def check(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
        if value is not None:
            try:
                check_markers(value, name)
            except MarkdownError as exc:
                raise click.BadParameter(str(exc)) from None
        return value

    return click.option(
        "--markdown",
        "markdown_path",
        type=click.Path(dir_okay=False, path_type=Path),
        callback=check,
        metavar="FILE",
        help=f"After the run, write its figures as markdown tables into FILE, between {start} and "
        f"{end} (nothing else in FILE changes).",
    )


def md_escape(text: str) -> str:
    """Plain text for a markdown table cell or line: the characters markdown would read as its own escaped
    (an intraword `_`, as in used_memory, is left: no renderer emphasises it)."""
    return "".join("\\" + ch if ch in "\\`*[]<|" else ch for ch in text)


def md_table(section: Section) -> str:
    lines = [f"**{md_escape(section.title)}**", ""]
    lines.append("| " + " | ".join(md_escape(c.replace("\n", " ")) for c in section.columns) + " |")
    lines.append("|" + "|".join(":---" if c in section.left else "---:" for c in section.columns) + "|")
    lines += ["| " + " | ".join(md_escape(v.replace("\n", " ")) for v in row) + " |" for row in section.rows]
    for line in section.caption.split("\n") if section.caption else []:
        lines += ["", md_escape(line)]  # a paragraph each
    return "\n".join(lines)


def provenance(module: str) -> str:
    """One line: when the figures were measured, on what, and with which command line."""
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    command = shlex.join(["python", "-m", module, *sys.argv[1:]])
    fence = "``" if "`" in command else "`"
    return (
        f"Measured {when} on {platform.system()} {platform.machine()}, nproc {cpus}, "
        f"Python {platform.python_version()}, with {fence}{command}{fence}."
    )


def markdown_report(report: dict) -> str:
    targets_table = Section(
        "Targets",
        ["target", "value", "holds"],
        [
            [t["target"], "-" if t["value"] is None else str(t["value"]), "holds" if t["holds"] else "missed"]
            for t in report["targets"]
        ],
        left=("target", "holds"),
    )
    return "\n\n".join([provenance("tools.bench"), *(md_table(s) for s in [*sections(report), targets_table])])


def markdown_capacity(report: dict) -> str:
    """The block between the capacity markers: when and how it was measured, and its tables."""
    return "\n\n".join([provenance("tools.bench"), *(md_table(s) for s in capacity_tables(report["capacity"]))])


def markdown_blocks(path: Path, sections: frozenset[str], *, reference: bool, cluster: bool = False) -> list[str]:
    """The blocks a run of `sections` writes into `path`: bench's when every section but capacity runs,
    reference's with --reference (its markers required), capacity's when it runs and `path` has its markers.
    MarkdownError when that is none of them, or when markers are not each once and in order."""
    names = [MARKDOWN_MARKERS] if BENCH_SECTIONS <= sections else []
    if reference:
        check_markers(path, REFERENCE_MARKERS)
        names.append(REFERENCE_MARKERS)
    capacity = CLUSTER_CAPACITY_MARKERS if cluster else CAPACITY_MARKERS
    start, end = markers(capacity)
    if "capacity" in sections and any(marker in _read(path) for marker in (start, end)):
        check_markers(path, capacity)
        names.append(capacity)
    if not names:
        raise MarkdownError(
            f"{path}: these sections write nothing into it (the bench markers' block takes every section but "
            f"capacity; the capacity section goes between {start} and {end})"
        )
    return names


def markdown_reference(ref: dict) -> str:
    """The block between the reference markers: when and how it was measured, and the one table."""
    return "\n\n".join([provenance("tools.bench"), md_table(reference_section(ref))])


# -- the chart ----------------------------------------------------------------------------


MATPLOTLIB_MISSING = (
    "--chart needs matplotlib, which is not installed: it is in the 'bench' dependency group "
    "(uv sync --group bench; a plain `uv sync` or `make python-deps` installs it too), "
    "or pip install matplotlib==3.10.9"
)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise BenchError(MATPLOTLIB_MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_chart(report: dict, path: Path) -> None:
    plt = _pyplot()
    setups = report["throughput"]["setups"]
    lat = report["_latencies"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in setups:
        values = sorted(v * 1e3 for v in lat.get(name, []))
        if values:
            left.plot(values, [i / len(values) for i in range(1, len(values) + 1)], label=name)
    left.set_xscale("log")
    left.set_xlabel("latency, ms (log)")
    left.set_ylabel("fraction of calls at or below")
    left.set_title(f"Latency per setup, {report['config']['sessions']} sessions")
    left.grid(True, which="both", alpha=0.3)
    left.legend()
    names = list(setups)
    bars = right.bar(names, [setups[n]["calls_per_s"] for n in names], color=[f"C{i}" for i in range(len(names))])
    right.bar_label(bars, fmt="%.0f")
    right.set_ylabel("calls / s")
    right.set_title(f"Throughput per setup, mix {report['config']['mix']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- command line -------------------------------------------------------------------------


def require_loopback(url: str, what: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchError(f"{what} {url!r} is not an http(s) URL")
    host = "127.0.0.1" if parts.hostname == "localhost" else parts.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise BenchError(f"{what} {url} is not on loopback; this benchmark only runs against loopback addresses")
    return url


async def check_compare(url: str) -> None:
    """Before anything starts: an unreachable or non-MCP --compare URL is an error, said plainly."""
    setup = await open_setup("compare", url, SessionClient, 1)
    await close_setup(setup)


async def run(stack: Stack, plan: Plan, log_dir: Path, state_dir: Path, reference: ReferenceKit | None = None) -> dict:
    """The sections of `plan.sections`; `reference`, not yet started, runs for the throughput section only."""
    floor = Floor(stack, len(stack.config.replica_ports), log_dir) if "throughput" in plan.sections else None
    setups = 3 + bool(plan.compare) + bool(reference)
    reference_up = False
    report: dict = {}
    try:
        if floor is not None:
            # Inside the try: a floor that fails half-way is stopped too.
            with console.status("starting the floor (tools.bench_floor behind its own HAProxy)"):
                await asyncio.to_thread(floor.start)
        if reference is not None:
            with console.status("starting the reference kit (redis-server, 3 fastmcp run replicas, its HAProxy)"):
                # A start that fails half-way stops what it started itself, and keeps its logs.
                await asyncio.to_thread(reference.start)
                reference_up = True
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            console=console,
            transient=not console.is_terminal,
        ) as progress:
            task = progress.add_task("starting", total=plan.planned_seconds(setups) + 1)
            if floor is not None:
                report["throughput"] = await section_throughput(
                    stack, floor, plan, progress, task, reference.url if reference is not None else None
                )
                report["_latencies"] = report["throughput"].pop("_latencies")  # for the chart only, not the JSON
            if reference is not None:
                # Only the throughput section needs it: its processes leave the machine to the rest.
                reference_up = False
                await asyncio.to_thread(reference.stop)
            await later_sections(stack, plan, state_dir, report, progress, task)
            progress.update(task, description="done", completed=progress.tasks[0].total)
    finally:
        if reference is not None and reference_up:
            await asyncio.to_thread(reference.stop)
        if floor is not None:
            await asyncio.to_thread(floor.stop)
            await asyncio.to_thread(forget_floor_keys, stack.config)
    if reference is not None:
        report["reference"] = reference.describe()
    return report


async def later_sections(stack: Stack, plan: Plan, state_dir: Path, report: dict, progress: Progress, task) -> None:
    """The sections after throughput, those of `plan.sections`, into `report`."""
    if "proxy_hop" in plan.sections:
        report["proxy_hop"] = await section_hop(stack, plan, progress, task)
    # Before scale: Redis shrinks its keyspace table lazily after the 100,000 filled sessions go, which
    # would show up in these as negative bytes and as Redis CPU.
    if "memory" in plan.sections:
        report["memory"] = await section_memory(stack, plan, progress, task)
    if "capacity" in plan.sections:
        at_rest = report["memory"]["used_memory_at_rest_per_session"] if "memory" in report else None
        report["capacity"] = await section_capacity(stack, plan, at_rest, progress, task)
    if "scale" in plan.sections:
        report["scale"] = await section_scale(stack, plan, progress, task)
    if "durability" in plan.sections:
        call_p50 = report["throughput"]["setups"]["haproxy"]["p50_ms"] if "throughput" in report else None
        report["durability"] = await section_durability(plan, call_p50, state_dir, progress, task)


def parse_sections(text: str) -> frozenset[str]:
    """`--sections`: names of SECTIONS, comma-separated; capacity brings memory, whose figure it uses."""
    names = {name.strip() for name in text.split(",") if name.strip()}
    if unknown := names - set(SECTIONS):
        raise click.BadParameter(f"{', '.join(sorted(unknown))}: not a section (the sections: {', '.join(SECTIONS)})")
    if not names:
        raise click.BadParameter("name at least one section")
    return frozenset(names | ({"memory"} if "capacity" in names else set()))


def check_sections(
    sections: frozenset[str], markdown_path: Path | None, *, reference: bool, chart: bool, cluster: bool = False
) -> list[str]:
    """Before anything starts: the options that need a section get it, and the `--markdown` blocks this run
    writes (markdown_blocks)."""
    if (reference or chart) and "throughput" not in sections:
        option = "--reference" if reference else "--chart"
        raise click.BadParameter(f"{option} needs the throughput section", param_hint="'--sections'")
    if cluster and sections - {"memory"} != {"capacity"}:
        # The other sections, memory's included, read and fill one Redis's keys by name.
        raise click.BadParameter("on a Redis Cluster, only the capacity section runs", param_hint="'--sections'")
    if markdown_path is None:
        return []
    try:
        return markdown_blocks(markdown_path, sections, reference=reference, cluster=cluster)
    except MarkdownError as exc:
        raise click.BadParameter(str(exc), param_hint="'--markdown'") from None


@click.command()
@click.option(
    "--mix",
    default="increment_counter",
    show_default=True,
    help="Tools to call and their weights, e.g. increment_counter=3,get_counter=1.",
)
@click.option(
    "--sessions",
    type=click.IntRange(1, 256),
    default=8,
    show_default=True,
    help="Concurrent sessions per setup, each calling back to back.",
)
@click.option(
    "--duration",
    type=click.FloatRange(1, 600),
    default=None,
    help="Seconds of measured load per setup (split into interleaved rounds); 15, or 3 with --quick.",
)
@click.option(
    "--generation",
    type=click.Choice(["session", "sessionless"]),
    default="session",
    show_default=True,
    help="session: 2025-11-25 with mcp-session-id; sessionless: 2026-07-28 with a create_session handle.",
)
@click.option(
    "--compare",
    "compare",
    metavar="URL",
    help="Another MCP endpoint (session-era, the kit's tool contract) measured beside ours.",
)
@click.option(
    "--reference",
    "reference_path",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    metavar="PATH",
    help="A checkout of the reference kit (vikrantjain/mcp-high-availability), run as local processes "
    "(tools/reference.py) and measured beside ours in the throughput section; session-era clients only.",
)
@click.option(
    "--sections",
    "section_names",
    default=",".join(SECTIONS),
    show_default=True,
    callback=lambda ctx, param, value: parse_sections(value),
    help="The sections to run, comma-separated; capacity runs memory too (it takes a session's bytes from it). "
    "--markdown writes the bench markers' block only when every section but capacity runs.",
)
@click.option(
    "--primary-memory",
    "primary_memory_gib",
    type=click.FloatRange(0, min_open=True),
    default=8.0,
    show_default=True,
    help="The capacity section's memory per Redis primary, in GiB.",
)
@click.option("--quick", is_flag=True, help="Short rounds and fewer sessions made: under a minute, for CI.")
@click.option("--own-stack", is_flag=True, help="Start a stack of its own on free loopback ports, stop it at the end.")
@click.option(
    "--redis",
    "redis_mode",
    type=click.Choice(["single", "cluster"]),
    default="single",
    show_default=True,
    help="The stack's Redis: one server, or a Redis Cluster (with --own-stack, one of three primaries, a "
    "replica each; the capacity section only, its figures in the capacity-cluster block).",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the results here.")
@click.option(
    "--chart",
    "chart_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Draw latency distributions and throughput per setup into this PNG.",
)
@markdown_option(MARKDOWN_MARKERS)
@click.option("--check-targets", is_flag=True, help="Exit 1 when a target is missed (otherwise they are only printed).")
def main(
    mix: str,
    sessions: int,
    duration: float | None,
    generation: str,
    compare: str | None,
    reference_path: Path | None,
    section_names: frozenset[str],
    primary_memory_gib: float,
    quick: bool,
    own_stack: bool,
    redis_mode: str,
    json_path: Path | None,
    chart_path: Path | None,
    markdown_path: Path | None,
    check_targets: bool,
) -> None:
    """Measure calls/s and latency through HAProxy, directly and against a bare floor; scale; memory;
    Redis per call of each call shape, and what 1, 3 and 9 primaries hold and serve."""
    duration = duration or (3.0 if quick else 15.0)
    checkout = reference_checkout(reference_path, generation)
    cluster = redis_mode == "cluster"
    blocks = check_sections(
        section_names, markdown_path, reference=checkout is not None, chart=chart_path is not None, cluster=cluster
    )
    if cluster:
        section_names = frozenset({"capacity"})  # without memory's bytes per session: one Redis's
    plan = Plan(parse_mix(mix), sessions, duration, generation, quick, compare, section_names, primary_memory_gib)
    state_dir = Path(tempfile.mkdtemp(prefix="bench-"))
    started = time.monotonic()
    stack, report = measure(
        plan, state_dir, checkout, chart=chart_path is not None, own_stack=own_stack, redis_mode=redis_mode
    )
    latencies = report.pop("_latencies", {})  # none without the throughput section
    report["config"] = run_config(plan, mix, stack, checkout, own_stack=own_stack, redis_mode=redis_mode)
    report = finish_report(report, started)
    show(report, json_path, chart_path, latencies)
    if report["errors"]:
        refuse_figures(report["errors"], markdown_path, state_dir)
    if markdown_path is not None:
        write_markdown(markdown_path, blocks, report)
    shutil.rmtree(state_dir, ignore_errors=True)
    if check_targets and not all(r["holds"] for r in report["targets"]):
        sys.exit(1)


def run_config(
    plan: Plan, mix: str, stack: Stack, checkout: Checkout | None, *, own_stack: bool, redis_mode: str
) -> dict:
    """What the run was: its options (`mix` as given), the stack's replicas and the machine's CPUs."""
    return {
        "mix": mix,
        "sessions": plan.sessions,
        "duration_s": plan.duration,
        "rounds": plan.rounds,
        "generation": plan.generation,
        "quick": plan.quick,
        "own_stack": own_stack,
        "redis": redis_mode,
        "compare": plan.compare,
        "reference": None if checkout is None else str(checkout.path),
        "sections": [name for name in SECTIONS if name in plan.sections],
        "replicas": len(stack.config.replica_ports),
        "cpus": os.cpu_count(),
    }


def reference_checkout(reference_path: Path | None, generation: str) -> Checkout | None:
    """`--reference PATH` as a checkout of the reference kit, which speaks session-era MCP only."""
    if reference_path is None:
        return None
    if generation != "session":
        raise click.BadParameter(
            "the reference kit speaks session-era MCP only; --reference takes --generation session",
            param_hint="'--reference'",
        )
    try:
        return Checkout.at(reference_path)
    except ReferenceKitError as exc:
        raise click.BadParameter(str(exc), param_hint="'--reference'") from None


def measure(
    plan: Plan, state_dir: Path, checkout: Checkout | None, *, chart: bool, own_stack: bool, redis_mode: str
) -> tuple[Stack, dict]:
    """Run the plan's sections on the stack (its own, started and stopped here, or the running one); the
    stack and the report. Exit 2 when there is nothing sound to measure, its logs kept if it has any."""
    stack: Stack | None = None
    try:
        reference = prepare(plan, checkout, chart=chart)
        if own_stack:
            stack = Stack(StackConfig.on_free_ports(state_dir / "stack", redis_mode=redis_mode))
            with console.status(f"starting a stack of its own in {state_dir}"):
                stack.up()
        else:
            stack = running_stack()
            if (stack.config.redis_mode == "cluster") != (redis_mode == "cluster"):
                raise BenchError(
                    f"the running stack's Redis is {stack.config.redis_mode}: give --redis "
                    f"{'cluster' if stack.config.redis_mode == 'cluster' else 'single'}"
                )
        report = asyncio.run(run(stack, plan, state_dir / "floor-logs", state_dir / "durability", reference))
    except (BenchError, StackError, ReferenceKitError) as exc:
        click.echo(f"error: {exc}", err=True)
        if own_stack and stack is not None:
            stack.down()
        if any(state_dir.rglob("*.log")):
            click.echo(f"logs are kept in {state_dir}", err=True)
        else:
            shutil.rmtree(state_dir, ignore_errors=True)
        sys.exit(2)
    except BaseException:
        if own_stack and stack is not None:
            stack.down()
        click.echo(f"logs are kept in {state_dir}", err=True)
        raise
    if own_stack:
        with console.status("stopping the benchmark's stack"):
            stack.down()
    return stack, report


def prepare(plan: Plan, checkout: Checkout | None, *, chart: bool) -> ReferenceKit | None:
    """Before anything starts: a chart that cannot be drawn and a --compare URL that is not a loopback MCP
    endpoint are said at once; the reference kit, with `checkout`, gets its venv."""
    if chart:
        _pyplot()
    if plan.compare:
        require_loopback(plan.compare, "--compare")
        asyncio.run(check_compare(plan.compare))
    if checkout is None:
        return None
    # Made once (minutes), then reused while its lock is unchanged.
    with console.status("the reference kit's venv, from its uv.lock (made once, outside this repository)"):
        return ReferenceKit(checkout, ensure_venv(checkout))


# The report's keys, in the order its JSON gives them.
REPORT_KEYS = (
    "ok",
    "errors",
    "config",
    "targets",
    "throughput",
    "proxy_hop",
    "scale",
    "memory",
    "durability",
    "capacity",
    "reference",
    "seconds",
)


def finish_report(report: dict, started: float) -> dict:
    """The report with its targets, the reference comparison, the calls that failed, and its keys in order."""
    report["targets"] = targets(report)
    if "reference" in report:
        report["reference"] = against_reference(report)
    errors = measured_errors(report)
    report["errors"] = errors
    report["ok"] = not errors
    report["seconds"] = round(time.monotonic() - started, 1)
    return {k: report[k] for k in REPORT_KEYS if k in report}


def show(report: dict, json_path: Path | None, chart_path: Path | None, latencies: dict) -> None:
    """The tables and targets, and the report as JSON and a chart where asked for."""
    for table in results_tables(report):
        console.print(table)
    for row in report["targets"]:
        mark = "[green]holds[/green]" if row["holds"] else "[red]missed[/red]"
        console.print(f"{mark}  {row['target']}: {row['value']}")
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2))
        console.print(f"results written to {json_path}")
    if chart_path is not None:
        draw_chart({**report, "_latencies": latencies}, chart_path)
        console.print(f"chart drawn in {chart_path}")


def refuse_figures(errors: list[str], markdown_path: Path | None, state_dir: Path) -> NoReturn:
    """Exit 1: calls failed, so no figure is a result (the markdown file is left as it was)."""
    click.echo("error: calls failed during the measurement, so these figures are not a result:", err=True)
    for e in errors:
        click.echo(f"  - {e}", err=True)
    if markdown_path is not None:
        click.echo(f"{markdown_path} is left as it was", err=True)
    click.echo(f"logs are kept in {state_dir}", err=True)
    sys.exit(1)


def write_markdown(markdown_path: Path, blocks: list[str], report: dict) -> None:
    """The figures into each of `blocks` of the markdown file; exit 2 when they cannot go in."""
    render = {
        MARKDOWN_MARKERS: markdown_report,
        REFERENCE_MARKERS: lambda report: markdown_reference(report["reference"]),
        CAPACITY_MARKERS: markdown_capacity,
        CLUSTER_CAPACITY_MARKERS: markdown_capacity,
    }
    try:
        write_blocks(markdown_path, {name: render[name](report) for name in blocks})
    except MarkdownError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    for name in blocks:
        console.print(f"figures written into {markdown_path}, between {' and '.join(markers(name))}")


if __name__ == "__main__":
    main()
