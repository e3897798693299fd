"""The abuse suite (issue 17): each class of attack, bounded to seconds, against a stack of its own.

`abuse_stack` (tests/conftest.py): Redis, two replicas with static-token authentication and a few bounds set
low (ABUSE_BOUNDS), HAProxy in front. Each test runs one class of attack from a loopback address of its own
(127.0.0.2 and up, so HAProxy's per-address caps meet the attacker, not the bystander) and asserts:

- the bound holds (the attack is answered as the bound says: a status, a JSON-RPC or tool error, Redis
  memory added within a figure);
- every replica stays in rotation (HAProxy's stats, polled through the attack, then each replica's /health,
  under the pid it had);
- a bystander session, calling increment_counter through HAProxy from 127.0.0.1 in a process of its own,
  keeps its p99 under attack within P99_RATIO its own p99 measured just before the attack in the same test
  (ratios only, never absolute times); the attack runs in a thread at ATTACKER_NICE, so that on a small
  machine its client takes only the CPU the stack and the bystander leave: the stack's cost is measured;
- nothing acknowledged is lost: the bystander's counter equals the increments it was told succeeded.

Every attack loop is bounded in count and in time. The figures (memory added, p99 ratios) are printed at
the end of the run (conftest.ABUSE_FIGURES).

Issue 25 (what one principal can take from the others) has a class per finding of its review, at the end of
the file (TestOneClientCannotFillRedis ... TestDisconnectsLogNoTraceback), each asserting the same and the
refusal of the bound that finding called for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx2
import pytest
from conftest import ABUSE_BOUNDS, ABUSE_FIGURES, ROOT, Replica, replica_on

from mcp_ha.ops.check.wire import (
    ACCEPT,
    PROTOCOL,
    SESSIONLESS_PROTOCOL,
    RawSession,
    SessionlessSession,
    final_message,
    jsonrpc_messages,
    last_jsonrpc_message,
)
from mcp_ha.ops.stack import Stack, http_status
from mcp_ha.session_store import DEFAULT_MAX_BYTES_PER_HOLDER

pytestmark = pytest.mark.timeout(90)

T = TypeVar("T")

# The bounds, as the replicas' settings give them (defaults, or ABUSE_BOUNDS where the stack sets them low).
MAX_BODY_BYTES = 1_048_576
MAX_SESSION_RECORD_BYTES = 4096
MAX_SESSION_LOG_BYTES = 262_144
MAX_SESSION_STATE_BYTES = 262_144
MAX_NOTE_BYTES = 10_000
MAX_NOTES = 250
MAX_SESSIONS_PER_CLIENT = int(ABUSE_BOUNDS["MAX_SESSIONS_PER_CLIENT"])
SESSION_IDLE_SECONDS = float(ABUSE_BOUNDS["SESSION_IDLE_SECONDS"])
MAX_REPLAYS_PER_SESSION = 8
MAX_REPLAYS = int(ABUSE_BOUNDS["MAX_REPLAYS"])
MAX_CONN_PER_SOURCE = 500  # HAProxy's default (stack.DEFAULT_MAX_CONN_PER_SOURCE)

# The bystander's p99 under attack, over its p99 just before: at most this.
P99_RATIO = 3.0
# Long enough for a p99 of a few hundred calls: a shorter one is a maximum, and one hiccup moves it.
BASELINE_SECONDS = 3.0
MIN_ATTACK_SECONDS = 2.0
# The bystander calls at most once per this many seconds (so it measures, and does not load, the stack).
BYSTANDER_PERIOD = 0.01
# The attacker's client runs this much lower in CPU priority (nice) than the stack and the bystander: on a machine
# of 2 cores it would otherwise take one of them from the stack (a 0.2 s burst of 2 MiB bodies cost this process
# 0.17 CPU-seconds, the stack 0.05), which an attacker on a host of its own cannot. What is measured is then the
# stack's cost of the attack, not the machine's scheduler (as test_limits' attacker, at nice 19).
ATTACKER_NICE = 10
MiB = 1 << 20

# The bystander, in a process of its own: opens a session through HAProxy, then on "run" calls
# increment_counter every BYSTANDER_PERIOD until "pause". Each call is one line on stdout:
# {"t": start (time.monotonic, the system's clock, comparable across processes), "s": seconds, "ok": bool,
# "e": what failed}; "pause" answers {"paused": acked, "failed": n} once its call in flight is answered.
BYSTANDER = r"""
import asyncio, json, sys, threading, time
import httpx2
from mcp_ha.ops.check.wire import CallFailed, RawSession

url, token, period = sys.argv[1], sys.argv[2], float(sys.argv[3])

def say(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()

async def main():
    loop = asyncio.get_running_loop()
    commands = asyncio.Queue()
    def read():
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, line.strip())
        loop.call_soon_threadsafe(commands.put_nowait, "quit")
    threading.Thread(target=read, daemon=True).start()
    async with httpx2.AsyncClient(timeout=30) as http:
        session = RawSession(http, url, token=token, timeout=30, client_name="bystander")
        say({"ready": await session.initialize()})
        acked = failed = 0
        state = "pause"
        while True:
            if state != "run":
                say({"paused": acked, "failed": failed})
                state = await commands.get()
                if state == "quit":
                    return
                continue
            start = time.monotonic()
            error = ""
            try:
                await session.call_tool("increment_counter")
                acked += 1
            except (CallFailed, httpx2.HTTPError, TimeoutError) as exc:
                failed += 1
                error = f"{type(exc).__name__}: {exc}"[:300]
            elapsed = time.monotonic() - start
            say({"t": start, "s": elapsed, "ok": not error, "e": error})
            if not commands.empty():
                state = commands.get_nowait()
            else:
                await asyncio.sleep(max(0.0, start + period - time.monotonic()))

asyncio.run(main())
"""


@dataclass
class Sample:
    start: float
    seconds: float
    ok: bool
    error: str


class Bystander:
    """The bystander process: its session, its samples, run and pause."""

    def __init__(self, proc: subprocess.Popen, log: Path) -> None:
        self.proc = proc
        self.log = log
        self.samples: list[Sample] = []
        self.replies: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._reply(30)
        self.session_id: str = ready["ready"]
        self._reply(5)  # paused, at the start

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            if "t" in message:
                self.samples.append(Sample(message["t"], message["s"], message["ok"], message["e"]))
            else:
                self.replies.put(message)

    def _reply(self, timeout: float) -> dict:
        try:
            return self.replies.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the bystander did not answer: {self.log.read_text()[-2000:]}") from None

    def _send(self, command: str) -> None:
        assert self.proc.stdin is not None and self.proc.poll() is None, self.log.read_text()[-2000:]
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def run(self) -> None:
        self._send("run")

    async def pause(self) -> tuple[int, int]:
        """Stops calling; (acknowledged increments, failed calls) since it started."""
        self._send("pause")
        reply = await asyncio.to_thread(self._reply, 40)
        return reply["paused"], reply["failed"]


def percentile(values: list[float], fraction: float) -> float:
    """Nearest rank."""
    assert values, "no samples"
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def used_memory(stack: Stack) -> int:
    return int(stack.redis_info("redis", "memory")["used_memory"])


def replica_urls(stack: Stack) -> list[str]:
    return [f"http://127.0.0.1:{port}/mcp" for port in stack.config.replica_ports]


def attacker_http(source: str, connections: int = 100, timeout: float = 20) -> httpx2.AsyncClient:
    """An HTTP client whose connections come from `source` (a loopback address of the attacker's own)."""
    limits = httpx2.Limits(max_connections=connections, max_keepalive_connections=connections)
    transport = httpx2.AsyncHTTPTransport(local_address=source, limits=limits)
    return httpx2.AsyncClient(transport=transport, timeout=timeout)


async def open_session(http: httpx2.AsyncClient, url: str, token: str, name: str = "attacker") -> RawSession:
    """A session opened through `url` (HAProxy, or a replica) as the principal whose token this is."""
    session = RawSession(http, url, token=token, timeout=20, client_name=name)
    await session.initialize()
    return session


def initialize_body(client_info: dict, capabilities: dict | None = None) -> dict:
    return {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": PROTOCOL, "capabilities": capabilities or {}, "clientInfo": client_info},
    }


def headers(token: str, session_id: str | None = None) -> dict[str, str]:
    h = {
        "Content-Type": "application/json",
        "Accept": ACCEPT,
        "MCP-Protocol-Version": PROTOCOL,
        "Authorization": f"Bearer {token}",
    }
    if session_id:
        h["mcp-session-id"] = session_id
    return h


def assert_json_rpc_error(response: httpx2.Response) -> dict:
    """The response carries a JSON-RPC error (as JSON, or as an SSE stream's last message); the error."""
    kind = response.headers.get("content-type", "")
    assert kind.startswith(("application/json", "text/event-stream")), (
        f"HTTP {response.status_code} {kind!r}, not a JSON-RPC error: {response.text[:200]!r}"
    )
    message = response.json() if kind.startswith("application/json") else last_jsonrpc_message(response)
    error = message.get("error")
    assert isinstance(error, dict) and isinstance(error.get("code"), int) and error.get("message"), message
    return error


def assert_retry_after(response: httpx2.Response) -> None:
    value = response.headers.get("retry-after", "")
    assert value.isdigit(), (response.status_code, dict(response.headers))


def tool_error_text(message: dict) -> str | None:
    """A tools/call answer's error text: a tool error's content, or a JSON-RPC error's message; None on success."""
    if "error" in message:
        return str(message["error"].get("message"))
    result = message["result"]
    if result.get("isError"):
        return " ".join(str(part.get("text", "")) for part in result.get("content", []))
    return None


async def call(session: RawSession, tool: str, arguments: dict | None = None) -> dict:
    """A tools/call's final JSON-RPC message (an HTTP error status fails the test)."""
    response = await session.post("tools/call", {"name": tool, "arguments": arguments or {}})
    assert response.status_code == 200, (response.status_code, response.text[:300])
    return final_message(response)


class Rotation:
    """Polls, in a thread, HAProxy's view of every replica and each replica's /health while an attack runs."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.problems: list[str] = []
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        names = self.stack.config.replica_names()
        while not self._stop.is_set():
            status = self.stack.backend_status()
            for name in names:
                if not status.get(name, "").startswith("UP"):
                    self.problems.append(f"HAProxy: {name} {status.get(name, 'missing')}")
            for name, port in zip(names, self.stack.config.replica_ports, strict=True):
                code = http_status(f"http://127.0.0.1:{port}/health", timeout=5)
                if code != 200:
                    self.problems.append(f"{name} /health: {code}")
            self.polls += 1
            self._stop.wait(0.25)

    def __enter__(self) -> Rotation:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


@dataclass
class Abuse:
    """What every class shares: the stack, the tokens, the bystander, and the replicas' pids."""

    stack: Stack
    tokens: dict[str, str]
    bystander: Bystander
    pids: dict[str, int | None] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.stack.config.mcp_url

    async def counter_of_bystander(self) -> int:
        async with httpx2.AsyncClient(timeout=20) as http:
            session = RawSession(http, self.url, token=self.tokens["bystander"])
            session.session_id = self.bystander.session_id
            return int((await session.call("get_counter"))["counter"])

    async def quiet(self, seconds: float) -> list[float]:
        """The bystander's call times over `seconds` of calls with no attack."""
        self.bystander.run()
        started = time.monotonic()
        await asyncio.sleep(seconds)
        await self.bystander.pause()
        return [s.seconds for s in self.bystander.samples if s.start >= started]

    async def under_attack(
        self,
        name: str,
        attack: Callable[[], Awaitable[T]],
        *,
        memory_bound: int | None = None,
        allow_bystander_errors: Callable[[str], bool] | None = None,
    ) -> T:
        """Runs `attack` while the bystander calls, and asserts what every class must hold (module docstring).

        `memory_bound`: at most this many bytes of Redis memory added by the attack.
        `allow_bystander_errors`: the bystander's failed calls are allowed if each one's error passes it
        (a clear refusal, say, while Redis is full); its counter must still equal its acknowledged calls.
        """
        memory_before = used_memory(self.stack)
        _, failed_before = await self.bystander.pause()  # its count runs over the whole module: this class's part
        self.bystander.run()
        await asyncio.sleep(BASELINE_SECONDS)
        with Rotation(self.stack) as rotation:
            started = time.monotonic()
            try:
                result = await in_attacker_thread(attack)
            finally:
                ended = time.monotonic()
                await asyncio.sleep(max(0.0, started + MIN_ATTACK_SECONDS - ended))
                acked, failed = await self.bystander.pause()
        await asyncio.sleep(0.2)
        memory_added = used_memory(self.stack) - memory_before
        failed -= failed_before
        baseline = [s for s in self.bystander.samples if started - BASELINE_SECONDS + 0.2 <= s.start < started]
        # The attack, or its first MIN_ATTACK_SECONDS if it was shorter: a p99 of a dozen calls is their
        # maximum, which one scheduler hiccup sets. The bystander calls on after the attack for that long.
        until = max(ended, started + MIN_ATTACK_SECONDS)
        during = [s for s in self.bystander.samples if started <= s.start < until]
        failures = [s.error for s in baseline + during if not s.ok]
        baseline_p99 = percentile([s.seconds for s in baseline], 0.99)
        # A call still in flight when the attack ended counts: its time is what the attack cost it.
        attack_p99 = percentile([s.seconds for s in during] or [ended - started], 0.99)
        ratio = attack_p99 / baseline_p99
        ABUSE_FIGURES.append(
            f"{name:<44} memory added {memory_added / MiB:7.2f} MiB   bystander p99 ratio {ratio:5.2f} "
            f"({len(during)} calls under attack, {len(baseline)} before; {len(failures)} failed)   "
            f"attack {ended - started:4.1f} s"
        )
        # Every replica in rotation throughout, and each still the process it was.
        assert rotation.polls > 0 and rotation.problems == [], rotation.problems[:10]
        for replica, port in zip(self.stack.config.replica_names(), self.stack.config.replica_ports, strict=True):
            assert self.stack.pid(replica) == self.pids[replica], f"{replica} restarted"
            assert http_status(f"http://127.0.0.1:{port}/health", timeout=5) == 200, replica
        # Nothing acknowledged lost, nothing unacknowledged applied.
        assert await self.counter_of_bystander() == acked
        if allow_bystander_errors is None:
            assert failed == 0 and failures == [], failures[:5]
        else:
            assert all(allow_bystander_errors(error) for error in failures), failures[:5]
        assert len(during) >= 1, "the bystander made no call during the attack"
        quiet_p99 = baseline_p99
        if ratio > P99_RATIO:
            # One scheduler hiccup on a 2-core machine sets the p99 of a 2 s window. Whether it was the attack
            # or the machine, a quiet window of the same length right after tells: the attack is held to
            # P99_RATIO of the slower of the quiet windows on either side of it.
            after = await self.quiet(until - started)
            after_p99 = percentile(after, 0.99)
            quiet_p99 = max(baseline_p99, after_p99)
            ratio = attack_p99 / quiet_p99
            baseline_p50, after_p50 = percentile([s.seconds for s in baseline], 0.5), percentile(after, 0.5)
            ABUSE_FIGURES.append(
                f"  {name}: p99 ratio {ratio:.2f} against a quiet window after the attack "
                f"(p99 {after_p99 / baseline_p99:.2f}x, p50 {after_p50 / baseline_p50:.2f}x the one before)"
            )
            # But harm that outlasts the attack would excuse itself there, so that window is held to the bound
            # too: by its median, which harm that lasts (a replica still busy, a leaked loop) moves for every
            # call, and which one scheduler hiccup on a busy machine does not (its p99 did: 3.16x once,
            # beside a benchmark loop, 24.9 ms against 7.9 ms).
            assert after_p50 <= P99_RATIO * baseline_p50, (
                f"bystander p50 {after_p50 * 1000:.1f} ms after the attack, {baseline_p50 * 1000:.1f} ms before it: "
                f"{after_p50 / baseline_p50:.2f}x (at most {P99_RATIO}x)"
            )
        assert ratio <= P99_RATIO, (
            f"bystander p99 {attack_p99 * 1000:.1f} ms under attack, {quiet_p99 * 1000:.1f} ms in the slower "
            f"quiet window: {ratio:.2f}x (at most {P99_RATIO}x)"
        )
        if memory_bound is not None:
            assert memory_added <= memory_bound, f"{name}: Redis grew by {memory_added} bytes (at most {memory_bound})"
        return result


async def in_attacker_thread(attack: Callable[[], Awaitable[T]]) -> T:
    """`attack()` on an event loop of its own, in a thread of its own at ATTACKER_NICE (a thread's own attribute
    on Linux; the thread ends with the attack, so nothing is put back, which an unprivileged process could not)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    async def main() -> T:
        return await attack()

    def run() -> None:
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + ATTACKER_NICE)
        try:
            result = asyncio.run(main())
        except BaseException as exc:  # the attack's own assertions: the test reports them
            loop.call_soon_threadsafe(done.set_exception, exc)
        else:
            loop.call_soon_threadsafe(done.set_result, result)

    threading.Thread(target=run, name="attacker", daemon=True).start()
    return await done


@contextlib.contextmanager
def bystander_process(url: str, token: str, log: Path) -> Iterator[Bystander]:
    """A bystander process calling through `url` as the principal whose token this is; stopped afterwards."""
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", BYSTANDER, url, token, str(BYSTANDER_PERIOD)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        try:
            yield Bystander(proc, log)
        finally:
            if proc.stdin:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def abuse(
    abuse_stack: Stack, abuse_tokens: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Abuse]:
    log = tmp_path_factory.mktemp("bystander") / "bystander.log"
    with bystander_process(abuse_stack.config.mcp_url, abuse_tokens["bystander"], log) as bystander:
        pids = {name: abuse_stack.pid(name) for name in abuse_stack.config.replica_names()}
        yield Abuse(abuse_stack, abuse_tokens, bystander, pids)


async def bounded(count: int, seconds: float, one: Callable[[int], Awaitable[T]], *, concurrency: int = 1) -> list[T]:
    """`one(i)` for i in 0..count-1, `concurrency` at a time, starting none after `seconds`: what they answered."""
    deadline = time.monotonic() + seconds
    results: list[T] = []
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < count and time.monotonic() < deadline:
            i = next_index
            next_index += 1
            results.append(await one(i))

    async with asyncio.timeout(seconds + 30):
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


# -- request bodies -------------------------------------------------------------------------------


async def chunks(body: bytes, size: int = 65536) -> AsyncIterator[bytes]:
    """`body` as a chunked request's content: no Content-Length."""
    for start in range(0, len(body), size):
        yield body[start : start + size]


async def test_bodies_over_max_body_bytes_get_413(abuse: Abuse) -> None:
    """Bodies of 2 MiB, declared and chunked, through HAProxy and at each replica: 413 with a JSON-RPC error."""
    token = abuse.tokens["attacker"]
    head, tail = b'{"jsonrpc":"2.0","method":"ping","id":"', b'"}'
    body = head + b"x" * (2 * MAX_BODY_BYTES - len(head) - len(tail)) + tail
    targets = [abuse.url, *replica_urls(abuse.stack)]
    statuses: Counter[int] = Counter()

    async def attack() -> None:
        async with attacker_http("127.0.0.2") as http:

            async def one(i: int) -> None:
                url = targets[i % len(targets)]
                content: bytes | AsyncIterator[bytes] = body if i % 2 else chunks(body)
                response = await http.post(url, content=content, headers=headers(token))
                statuses[response.status_code] += 1
                assert response.status_code == 413, (url, i % 2, response.status_code, response.text[:300])
                assert_json_rpc_error(response)

            await bounded(24, 8, one, concurrency=4)

    await abuse.under_attack("body over MAX_BODY_BYTES", attack, memory_bound=1 * MiB)
    assert statuses[413] >= 8, statuses


# -- session records ---------------------------------------------------------------------------------


async def test_padded_initialize_gets_400_and_records_nothing(abuse: Abuse) -> None:
    """An initialize whose clientInfo or capabilities pass MAX_SESSION_RECORD_BYTES: 400, -32602 naming
    clientInfo, no session recorded."""
    token = abuse.tokens["attacker"]
    sessions_before = abuse.stack.redis_command("redis", "ZCARD", "mcp:sessions")
    padding = "x" * (MAX_SESSION_RECORD_BYTES + 100)
    bodies = [
        initialize_body({"name": padding, "version": "1"}),
        initialize_body({"name": "a", "version": "1"}, {"experimental": {"pad": {"x": padding}}}),
        initialize_body({"name": "a", "version": "1", "extra": ["y" * 1000] * 5}),
    ]

    async def attack() -> int:
        async with attacker_http("127.0.0.2") as http:

            async def one(i: int) -> None:
                response = await http.post(abuse.url, json=bodies[i % len(bodies)], headers=headers(token))
                assert response.status_code == 400, (i % len(bodies), response.status_code, response.text[:300])
                assert not response.headers.get("mcp-session-id")
                error = assert_json_rpc_error(response)
                assert error["code"] == -32602 and "clientInfo" in error["message"], error

            return len(await bounded(150, 6, one, concurrency=4))

    sent = await abuse.under_attack("initialize over MAX_SESSION_RECORD_BYTES", attack, memory_bound=1 * MiB)
    assert sent >= 10
    assert abuse.stack.redis_command("redis", "ZCARD", "mcp:sessions") == sessions_before
    # Within the bound, the same principal opens a session as ever.
    async with httpx2.AsyncClient(timeout=20) as http:
        session = await open_session(http, abuse.url, token, name="x" * (MAX_SESSION_RECORD_BYTES // 2))
        await session.close()


# -- event log ---------------------------------------------------------------------------------------


async def test_huge_request_ids_add_nothing_to_redis(abuse: Abuse) -> None:
    """`ping` with a 900 KB id, 50 times, on one session: answered, and Redis grows by at most 10 MB."""
    token = abuse.tokens["attacker"]
    huge_id = "i" * 900_000

    async def attack() -> list[int]:
        async with attacker_http("127.0.0.2") as http:
            session = await open_session(http, abuse.url, token)
            hdrs = session.headers()

            async def one(i: int) -> int:
                body = {"jsonrpc": "2.0", "id": f"{huge_id}{i}", "method": "ping", "params": {}}
                response = await http.post(abuse.url, json=body, headers=hdrs)
                assert response.status_code < 500, (response.status_code, response.text[:300])
                return response.status_code

            try:
                return await bounded(50, 15, one, concurrency=2)
            finally:
                await session.close()

    statuses = await abuse.under_attack("ping with a 900 KB id x50", attack, memory_bound=10 * MiB)
    assert len(statuses) >= 20, statuses


# -- session state ------------------------------------------------------------------------------------


async def test_state_past_max_session_state_bytes_is_a_tool_error(abuse: Abuse) -> None:
    """Notes of 9,999 quotes (9,999 bytes, ~20 KB as JSON text) until the state passes 1 MiB: a tool error
    naming the bound, nothing applied, every acknowledged note kept."""
    token = abuse.tokens["attacker"]
    note = '"' * (MAX_NOTE_BYTES - 1)
    refusal: list[str] = []

    async def attack() -> int:
        async with attacker_http("127.0.0.2") as http:
            session = await open_session(http, abuse.url, token)
            acked = 0
            # 1 MiB of 20 KB notes is 53: 80 is past it whichever way the state is counted. Bounded by count
            # (and each call by its client's timeout), not by a time a loaded machine stretches.
            for _ in range(80):
                message = await call(session, "add_note", {"note": note})
                error = tool_error_text(message)
                if error is not None:
                    assert message.get("result", {}).get("isError") is True, message
                    refusal.append(error)
                    break
                acked += 1
                assert message["result"]["structuredContent"]["notes_count"] == acked
            # Nothing of the refused write applied; everything acknowledged kept.
            notes = (await session.call("list_notes"))["notes"]
            assert notes == [note] * acked
            await session.close()
            return acked

    acked = await abuse.under_attack("state over MAX_SESSION_STATE_BYTES", attack, memory_bound=4 * MiB)
    assert refusal, f"{acked} notes of ~20 KB as JSON were all kept: no bound at {MAX_SESSION_STATE_BYTES} bytes"
    assert str(MAX_SESSION_STATE_BYTES) in refusal[0] or "MAX_SESSION_STATE_BYTES" in refusal[0], refusal[0]
    assert acked * (2 * len(note) + 3) <= MAX_SESSION_STATE_BYTES + 2 * (2 * len(note) + 3), acked


# -- notes ------------------------------------------------------------------------------------------


async def test_notes_are_bounded_in_bytes_and_count_and_append_in_constant_time(abuse: Abuse) -> None:
    """add_note: over MAX_NOTE_BYTES UTF-8 bytes refused (an emoji is 4); past MAX_NOTES a tool error; the
    append at the cap costs at most 3x the append on an empty session (p50s, the two made in turns); a
    list_notes answer over MAX_EVENT_BYTES, asked for again and again, is not kept in Redis."""
    token = abuse.tokens["attacker"]
    # MAX_NOTES of them within MAX_SESSION_STATE_BYTES, so the count's bound is the one met.
    note = "n" * 800
    early: list[float] = []
    late: list[float] = []
    memory_by_answers: list[int] = []

    async def attack() -> None:
        async with attacker_http("127.0.0.2") as http:
            session = await open_session(http, abuse.url, token)
            for refused in ("x" * (MAX_NOTE_BYTES + 1), "😀" * (MAX_NOTE_BYTES // 4 + 1)):
                assert tool_error_text(await call(session, "add_note", {"note": refused})) is not None, len(refused)
            assert tool_error_text(await call(session, "add_note", {"note": "😀" * (MAX_NOTE_BYTES // 4)})) is None
            await session.close()

            async def add(s: RawSession, n: int) -> float:
                """The time add_note took, the session's n-th note."""
                t = time.perf_counter()
                message = await call(s, "add_note", {"note": note})
                elapsed = time.perf_counter() - t
                assert tool_error_text(message) is None, (n, message)
                assert message["result"]["structuredContent"]["notes_count"] == n
                return elapsed

            sessions = [await open_session(http, abuse.url, token) for _ in range(3)]
            for n in range(1, MAX_NOTES - 10 + 1):
                for s in sessions:
                    await add(s, n)

            async def fresh_beside(full: RawSession) -> RawSession:
                """A new session on the replica `full` is on (HAProxy sends new sessions to each in turn)."""
                replica = await instance_of(full)
                for _ in range(4 * len(abuse.stack.config.replica_ports)):
                    session = await open_session(http, abuse.url, token)
                    if await instance_of(session) == replica:
                        return session
                    await session.close()
                raise AssertionError(f"no new session on {replica}")

            # The last 10 notes at the cap, each beside a note on a fresh session on the same replica, in turns:
            # the fill lasts seconds, over which the machine's load changes, and the replicas' loads differ
            # (in turn, the fresh sessions would be on the other replica), so only samples taken together on
            # one replica are compared.
            fresh = [await fresh_beside(s) for s in sessions]
            for n in range(1, 11):
                for full, empty in zip(sessions, fresh, strict=True):
                    if n % 2:
                        late.append(await add(full, MAX_NOTES - 10 + n))
                        early.append(await add(empty, n))
                    else:
                        early.append(await add(empty, n))
                        late.append(await add(full, MAX_NOTES - 10 + n))
            for s in fresh:
                await s.close()
            for s in sessions:
                error = tool_error_text(await call(s, "add_note", {"note": "one too many"}))
                assert error is not None and str(MAX_NOTES) in error, error
                assert len((await s.call("list_notes"))["notes"]) == MAX_NOTES
            # Answers of ~200 KB, each one SSE event past MAX_EVENT_BYTES: sent whole, not kept.
            before = used_memory(abuse.stack)
            for i in range(12):
                assert (await sessions[i % 3].call("list_notes"))["notes"] == [note] * MAX_NOTES
            memory_by_answers.append(used_memory(abuse.stack) - before)
            for s in sessions:
                await s.close()

    await abuse.under_attack("add_note to MAX_NOTES, 800 B each, x3", attack, memory_bound=8 * MiB)
    ratio = percentile(late, 0.5) / percentile(early, 0.5)
    ABUSE_FIGURES.append(
        f"{'  add_note p50 at the cap / on an empty session':<44} {ratio:5.2f}   "
        f"12 list_notes answers of 200 KB added {memory_by_answers[0] / MiB:.2f} MiB"
    )
    assert ratio <= 3, f"add_note at {MAX_NOTES - 10}..{MAX_NOTES} notes: {ratio:.2f}x the p50 on an empty session"
    assert memory_by_answers[0] <= 2 * MiB, f"large answers grew Redis by {memory_by_answers[0]} bytes"


# -- sessions per client, and in all --------------------------------------------------------------------


async def test_session_flood_stops_at_max_sessions_per_client(abuse: Abuse) -> None:
    """One principal opening sessions without end: 429 with Retry-After past MAX_SESSIONS_PER_CLIENT, and
    create_session a tool error; Redis memory it adds bounded; another principal opens sessions as ever;
    an ended session frees a place."""
    token, other = abuse.tokens["flooder"], abuse.tokens["other"]
    # Each record as large as the record bound lets it be.
    body = initialize_body({"name": "f" * (MAX_SESSION_RECORD_BYTES - 200), "version": "1"})
    opened: list[str] = []
    refused: list[httpx2.Response] = []

    async def attack() -> None:
        async with attacker_http("127.0.0.3") as http:

            async def one(i: int) -> None:
                response = await http.post(abuse.url, json=body, headers=headers(token))
                if response.status_code == 200 and "result" in final_message(response):
                    opened.append(response.headers["mcp-session-id"])
                else:
                    refused.append(response)

            await bounded(MAX_SESSIONS_PER_CLIENT * 2, 15, one, concurrency=3)

    try:
        # A session's record and bookkeeping, at ~4 KB of record each: far within 20 KB a session.
        await abuse.under_attack(
            "initialize flood past MAX_SESSIONS_PER_CLIENT", attack, memory_bound=MAX_SESSIONS_PER_CLIENT * 20_000
        )
        assert len(opened) == MAX_SESSIONS_PER_CLIENT, (len(opened), [r.status_code for r in refused][:5])
        assert refused, "no initialize was refused"
        for response in refused:
            assert_refused(response, 429)
        async with httpx2.AsyncClient(timeout=20) as http:
            flooder = RawSession(http, abuse.url, token=token)
            flooder.session_id = opened[0]
            error = tool_error_text(await call(flooder, "create_session"))
            assert error is not None, "create_session past MAX_SESSIONS_PER_CLIENT gave a handle"
            # Another principal is not held back by the flood.
            bystander = await open_session(http, abuse.url, other, name="other")
            handle = (await bystander.call("create_session"))["session_id"]
            assert (await bystander.call("increment_counter", {"session_id": handle}))["counter"] == 1
            assert (await bystander.call("end_session", {"session_id": handle})) is not None
            await bystander.close()
            # An ended session frees its place.
            await flooder.close()
            opened.pop(0)
            again = await open_session(http, abuse.url, token, name="flooder")
            opened.append(str(again.session_id))
    finally:
        async with httpx2.AsyncClient(timeout=20) as http:
            for sid in opened:
                await http.delete(abuse.url, headers=headers(token, sid))


async def test_sessions_past_max_sessions_in_all_get_503(abuse: Abuse, tmp_path: Path) -> None:
    """A replica whose MAX_SESSIONS is what the store holds plus 10: the 11th new session is 503 with
    Retry-After, and create_session a tool error. Sessions through HAProxy carry on."""
    stack = abuse.stack
    live = int(stack.redis_command("redis", "ZCARD", "mcp:sessions"))  # type: ignore[arg-type]
    auth = {"MCP_AUTH": "static", "MCP_AUTH_TOKENS": stack.service("mcp-server-1").env["MCP_AUTH_TOKENS"]}
    env = {
        **ABUSE_BOUNDS,
        **auth,
        "REQUEST_STATE_KEYS": stack.config.request_state_keys,
        "MAX_SESSIONS": str(live + 10),
    }
    token = abuse.tokens["other"]
    opened: list[str] = []
    refused: list[httpx2.Response] = []
    with replica_on(stack, tmp_path, "mcp-server-capped", **env) as capped:

        async def attack() -> str | None:
            async with attacker_http("127.0.0.4") as http:

                async def one(i: int) -> None:
                    response = await http.post(
                        capped.url, json=initialize_body({"name": "o", "version": "1"}), headers=headers(token)
                    )
                    if response.status_code == 200 and "result" in final_message(response):
                        opened.append(response.headers["mcp-session-id"])
                    else:
                        refused.append(response)

                await bounded(30, 10, one, concurrency=3)
                if not opened:
                    return None
                session = RawSession(http, capped.url, token=token)
                session.session_id = opened[0]
                return tool_error_text(await call(session, "create_session"))

        try:
            error = await abuse.under_attack("initialize past MAX_SESSIONS (in all)", attack, memory_bound=1 * MiB)
        finally:
            async with httpx2.AsyncClient(timeout=20) as http:
                for sid in opened:
                    await http.delete(capped.url, headers=headers(token, sid))
    assert len(opened) == 10, (len(opened), [r.status_code for r in refused][:5])
    assert refused
    for response in refused:
        assert_refused(response, 503)
    assert error is not None, "create_session past MAX_SESSIONS gave a handle"


def assert_refused(response: httpx2.Response, status: int) -> None:
    """An initialize refused for a count: `status` with Retry-After and a JSON-RPC error, before the SDK saw
    it; or, for one that raced others past that check, the store's own atomic refusal, a JSON-RPC error in
    the SDK's answer (FastMCP can only answer an initialize's refusal that way)."""
    if response.status_code == status:
        assert_retry_after(response)
        assert_json_rpc_error(response)
        return
    assert response.status_code == 200, (response.status_code, response.text[:300])
    error = final_message(response).get("error") or {}
    assert str(error.get("message", "")).startswith("Refused:"), response.text[:300]


# -- idle transports ----------------------------------------------------------------------------------


def sessions_held(stack: Stack) -> int:
    """Transports the stack's replicas hold now (each replica's mcp_sessions_held)."""
    total = 0
    for port in stack.config.replica_ports:
        text = httpx2.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        total += sum(
            int(float(line.split()[-1])) for line in text.splitlines() if line.startswith("mcp_sessions_held ")
        )
    return total


async def test_idle_sessions_lose_their_transport_and_come_back(abuse: Abuse) -> None:
    """30 sessions idle past SESSION_IDLE_SECONDS: the replicas forget their transports, and each session's
    next call is served (adopted from the store) with the same counter."""
    token = abuse.tokens["idler"]
    held: dict[str, int] = {}

    async def attack() -> None:
        async with attacker_http("127.0.0.5") as http:
            sessions = [await open_session(http, abuse.url, token, name="idler") for _ in range(30)]
            try:
                for s in sessions:
                    assert (await s.call("increment_counter"))["counter"] == 1
                held["open"] = await asyncio.to_thread(sessions_held, abuse.stack)
                # Idle (the bystander is not): bounded, past the setting, until the transports are gone.
                await asyncio.sleep(SESSION_IDLE_SECONDS)
                for _ in range(24):  # 6 s more at most
                    held["idle"] = await asyncio.to_thread(sessions_held, abuse.stack)
                    if held["idle"] <= 5:
                        break
                    await asyncio.sleep(0.25)
                for s in sessions:
                    assert (await s.call("increment_counter"))["counter"] == 2
                    assert (await s.call("get_counter"))["counter"] == 2
            finally:
                for s in sessions:
                    await s.close()

    await abuse.under_attack("30 sessions idle past SESSION_IDLE_SECONDS", attack, memory_bound=2 * MiB)
    assert held["open"] >= 30, held
    # The bystander's own transport and at most a few others' remain.
    assert held["idle"] <= 5, f"{held}: idle transports were kept past SESSION_IDLE_SECONDS"


# -- stream resumption -----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def long_call(session: RawSession, seconds: int) -> AsyncIterator[tuple[str, asyncio.Task]]:
    """A watch_counter of `seconds` on `session`, and a change for it to report: its stream's first event id,
    and the task reading the rest."""
    first: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def read() -> dict | None:
        async with session.stream(
            "tools/call", {"name": "watch_counter", "arguments": {"duration_seconds": seconds}}
        ) as stream:
            last = None
            async for event in stream:
                if event.id and not first.done():
                    first.set_result(event.id)
                if event.message is not None:
                    last = event.message
            return last

    task = asyncio.create_task(read())
    try:
        # A change for the watch to report: until it has something to stream, its answer is JSON-to-be. Made
        # again until one is reported: on a loaded machine the watch may read its counter after the first.
        async with asyncio.timeout(10):
            while not first.done():
                await asyncio.sleep(0.2)
                await session.call("increment_counter")
                await asyncio.wait([first], timeout=1.0)
        yield first.result(), task
    finally:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(seconds + 15):
                await task


async def replay(
    http: httpx2.AsyncClient, url: str, token: str, session_id: str, event_id: str
) -> tuple[int, httpx2.Response, str]:
    """A `GET` with Last-Event-ID: its status, response and whole body (a 200 follows the call to its end)."""
    hdrs = {**headers(token, session_id), "Last-Event-ID": event_id}
    async with http.stream("GET", url, headers=hdrs) as response:
        try:
            body = (await response.aread()).decode(errors="replace")
        except httpx2.RemoteProtocolError as exc:
            body = f"cut: {exc}"
    return response.status_code, response, body


async def test_replay_floods_are_refused_past_the_per_session_and_per_replica_bounds(abuse: Abuse) -> None:
    """~600 concurrent resumptions of one session through HAProxy (75 times the bound; more only measures
    the attacker's own client, which shares the bystander's two cores here): at most MAX_REPLAYS_PER_SESSION are
    served, the rest 429 with Retry-After. Then 8 for each of 4 sessions at one replica: at most MAX_REPLAYS
    served there, the rest 503 with Retry-After."""
    token = abuse.tokens["replayer"]
    per_session: Counter[int] = Counter()
    per_replica: Counter[int] = Counter()
    ended = [0, 0]  # served replays of one session: followed to the call's answer, cut before it

    async def attack() -> None:
        sources = [f"127.0.0.{i}" for i in range(10, 14)]
        clients = [attacker_http(source, connections=300, timeout=30) for source in sources]
        try:
            session = await open_session(clients[0], abuse.url, token, name="replayer")
            # The call outlasts the launch window by far, so every replay served is one waiting on it.
            async with long_call(session, 8) as (event_id, _):
                launch_until = time.monotonic() + 2

                async def one(i: int) -> None:
                    if time.monotonic() > launch_until:
                        return
                    status, response, body = await replay(
                        clients[i % 4], abuse.url, token, str(session.session_id), event_id
                    )
                    per_session[status] += 1
                    if status == 429:
                        assert_retry_after(response)
                        assert_json_rpc_error(response)
                    elif status == 200:
                        ended[0 if "total_changes" in body else 1] += 1

                async with asyncio.timeout(25):
                    await asyncio.gather(*(one(i) for i in range(600)))
            await session.close()

            sessions = [await open_session(clients[1], abuse.url, token, name="replayer") for _ in range(4)]
            async with contextlib.AsyncExitStack() as calls:
                # Calls that outlast the launch of every replay on a loaded machine: the bound is on replays
                # at once, and one launched after a call had ended would be served as a new one.
                ids = [(await calls.enter_async_context(long_call(s, 8)))[0] for s in sessions]
                direct = replica_urls(abuse.stack)[0]

                async def at_replica(i: int) -> None:
                    s = sessions[i % 4]
                    status, response, _ = await replay(clients[2], direct, token, str(s.session_id), ids[i % 4])
                    per_replica[status] += 1
                    if status == 503:
                        assert_retry_after(response)
                        assert_json_rpc_error(response)

                async with asyncio.timeout(25):
                    await asyncio.gather(*(at_replica(i) for i in range(4 * MAX_REPLAYS_PER_SESSION)))
            for s in sessions:
                await s.close()
        finally:
            for client in clients:
                await client.aclose()

    try:
        await abuse.under_attack("concurrent Last-Event-ID replays", attack, memory_bound=4 * MiB)
    finally:
        ABUSE_FIGURES.append(f"{'  replays of one session, by status':<44} {dict(per_session)}, 200s cut: {ended[1]}")
        ABUSE_FIGURES.append(f"{'  8 replays x 4 sessions at one replica':<44} {dict(per_replica)}")
    assert set(per_session) <= {200, 429}, per_session
    assert 1 <= per_session[200] <= MAX_REPLAYS_PER_SESSION, per_session
    assert ended[1] == 0, f"{ended[1]} of {per_session[200]} served replays were cut before the call's answer"
    assert per_session[429] >= 100, per_session
    assert set(per_replica) <= {200, 503}, per_replica
    assert 1 <= per_replica[200] <= MAX_REPLAYS, per_replica
    assert per_replica[503] >= 4 * MAX_REPLAYS_PER_SESSION - MAX_REPLAYS, per_replica


# -- idle connections at HAProxy -------------------------------------------------------------------------


async def test_idle_connection_flood_from_one_address_is_capped_by_haproxy(abuse: Abuse) -> None:
    """MAX_CONN_PER_SOURCE + 20 connections from one address that send nothing: a request on a further one is
    429 with Retry-After; other addresses are served."""
    stack = abuse.stack
    answers: dict[str, httpx2.Response] = {}

    async def attack() -> None:
        writers = []
        try:
            for _ in range(MAX_CONN_PER_SOURCE + 20):
                _, writer = await asyncio.open_connection(
                    stack.config.host, stack.config.http_port, local_addr=("127.0.0.20", 0)
                )
                writers.append(writer)
            await asyncio.sleep(0.5)
            async with attacker_http("127.0.0.20") as http:
                answers["flooder"] = await http.get(f"http://127.0.0.1:{stack.config.http_port}/health")
            async with attacker_http("127.0.0.21") as http:
                answers["other"] = await http.get(f"http://127.0.0.1:{stack.config.http_port}/health")
        finally:
            for writer in writers:
                writer.close()

    await abuse.under_attack("idle connections from one address", attack, memory_bound=1 * MiB)
    assert answers["flooder"].status_code == 429, answers["flooder"].text[:300]
    assert_retry_after(answers["flooder"])
    assert answers["other"].status_code == 200


# -- Redis full ------------------------------------------------------------------------------------------


def clear_refusal(error: str) -> bool:
    """A refusal a client can act on: a tool error naming the store's memory, never a bare traceback."""
    lowered = error.lower()
    return ("memory" in lowered or "full" in lowered) and "Traceback" not in error


async def test_a_full_redis_refuses_writes_clearly_and_loses_nothing(abuse: Abuse) -> None:
    """Redis at its maxmemory (noeviction), set 4 MiB above what it holds: 9 KB notes until a write is
    refused: a tool error saying why, every acknowledged note kept; once there is room, writes go on."""
    stack = abuse.stack
    token = abuse.tokens["attacker"]
    original = stack.redis_command("redis", "CONFIG", "GET", "maxmemory")
    note = "m" * 9_000
    outcome: dict[str, Any] = {}

    async def attack() -> None:
        stack.redis_command("redis", "CONFIG", "SET", "maxmemory", str(used_memory(stack) + 4 * MiB))
        try:
            async with attacker_http("127.0.0.2") as http:
                # 25 notes a session stay within MAX_SESSION_STATE_BYTES; 24 sessions of them overflow 4 MiB.
                sessions = [await open_session(http, abuse.url, token) for _ in range(24)]
                acked = [0] * len(sessions)
                refusal = None
                # Bounded by count (5.4 MB of notes, past the 4 MiB), not by a time a loaded machine stretches:
                # 20 s ran out once beside other test loops, where 6.4 s is usual.
                for i in range(len(sessions) * 25):
                    k = i % len(sessions)
                    response = await sessions[k].post("tools/call", {"name": "add_note", "arguments": {"note": note}})
                    assert response.status_code < 500 or "memory" in response.text.lower(), (
                        response.status_code,
                        response.text[:300],
                    )
                    message = final_message(response) if response.status_code == 200 else response.json()
                    refusal = tool_error_text(message)
                    if refusal is not None:
                        break
                    acked[k] += 1
                outcome["refusal"] = refusal
                # Reads still work while Redis is full: every acknowledged note is there.
                for k, s in enumerate(sessions):
                    assert len((await s.call("list_notes"))["notes"]) == acked[k], k
                outcome["acked"] = sum(acked)
        finally:
            stack.redis_command("redis", "CONFIG", "SET", "maxmemory", str(original[1]))  # type: ignore[index]
            await asyncio.sleep(0.3)

    await abuse.under_attack(
        "notes until Redis is full (maxmemory)", attack, memory_bound=8 * MiB, allow_bystander_errors=clear_refusal
    )
    assert outcome["refusal"] is not None and clear_refusal(outcome["refusal"]), outcome


# -- duplicate request ids -------------------------------------------------------------------------------


async def test_a_request_id_reused_while_in_flight_does_not_take_the_first_calls_answer(abuse: Abuse) -> None:
    """Two tools/call with the same JSON-RPC id at once on one session: the first gets its own answer, the
    second its own or a JSON-RPC error, both in time; the session goes on."""
    token = abuse.tokens["attacker"]
    answers: dict[str, dict] = {}

    async def attack() -> None:
        async with attacker_http("127.0.0.2") as http:
            session = await open_session(http, abuse.url, token)
            hdrs = session.headers()

            async def send(name: str, items: int, delay: float) -> None:
                await asyncio.sleep(delay)
                body = {
                    "jsonrpc": "2.0",
                    "id": 7,
                    "method": "tools/call",
                    "params": {"name": "analyze_data", "arguments": {"num_items": items}},
                }
                response = await http.post(abuse.url, json=body, headers=hdrs)
                answers[name] = {
                    "status": response.status_code,
                    "message": final_message(response) if response.status_code == 200 else response.json(),
                }

            async with asyncio.timeout(8):
                await asyncio.gather(send("first", 20, 0), send("second", 2, 0.3))
            assert (await session.call("increment_counter"))["counter"] == 1
            await session.close()

    await abuse.under_attack("a request id reused while in flight", attack, memory_bound=1 * MiB)
    first = answers["first"]["message"]
    assert first.get("result", {}).get("structuredContent", {}).get("items_processed") == 20, answers
    second = answers["second"]["message"]
    assert "error" in second or second["result"]["structuredContent"]["items_processed"] == 2, answers


# == Fair share (issue 25): one class per finding of the review, each attack scaled to seconds ==========
#
# Each runs its finding's attack, past the bound it meets, and asserts what every class asserts
# (Abuse.under_attack) and the bound's own refusal. The figures each one measured go to ABUSE_FIGURES,
# passed or failed, so one run prints them all.

MAX_CLIENT_BYTES = int(ABUSE_BOUNDS["MAX_CLIENT_BYTES"])
MAX_CALLS_PER_SESSION = 16
MAX_CALLS_PER_CLIENT = int(ABUSE_BOUNDS["MAX_CALLS_PER_CLIENT"])
MAX_LISTEN_STREAMS_PER_CLIENT = int(ABUSE_BOUNDS["MAX_LISTEN_STREAMS_PER_CLIENT"])
ABANDONED_CALL_SECONDS = float(ABUSE_BOUNDS["ABANDONED_CALL_SECONDS"])
MAX_REQUEST_ITEMS = 10_000
SUMMARY = "resource://session/{}/summary"
KiB = 1 << 10


def figure(label: str, text: str) -> None:
    """One figure line under the class's own (Abuse.under_attack's) line."""
    ABUSE_FIGURES.append(f"{'  ' + label:<44} {text}")


def redis_cpu_and_commands(stack: Stack) -> tuple[float, int]:
    """Redis's CPU seconds so far (user and system) and the commands it has processed."""
    cpu = stack.redis_info("redis", "cpu")
    stats = stack.redis_info("redis", "stats")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), int(stats["total_commands_processed"])


async def redis_load(stack: Stack, seconds: float) -> tuple[float, float]:
    """Redis's load over the next `seconds`: (CPU in cores, commands per second)."""
    cpu, commands = redis_cpu_and_commands(stack)
    start = time.monotonic()
    await asyncio.sleep(seconds)
    cpu_after, commands_after = redis_cpu_and_commands(stack)
    elapsed = time.monotonic() - start
    return (cpu_after - cpu) / elapsed, (commands_after - commands) / elapsed


async def redis_commands_beside(abuse: Abuse, seconds: float, parts: int = 5) -> tuple[float, float]:
    """Over the next `seconds`: Redis's commands per second, the median of `parts` equal spans (a burst of
    the replicas' own housekeeping moves one span, not the figure), and the bystander's calls per second
    (most of Redis's commands are its, and their rate follows its calls)."""
    rates = []
    start = time.monotonic()
    _, commands = redis_cpu_and_commands(abuse.stack)
    for part in range(1, parts + 1):
        await asyncio.sleep(max(0.0, start + part * seconds / parts - time.monotonic()))
        _, commands_after = redis_cpu_and_commands(abuse.stack)
        rates.append((commands_after - commands) * parts / seconds)
        commands = commands_after
    end = time.monotonic()
    calls = sum(1 for s in abuse.bystander.samples if start <= s.start < end)
    return statistics.median(rates), calls / (end - start)


def process_cpu(pid: int) -> float:
    """A process's CPU seconds so far, all its threads', to the nanosecond: its CPU-time clock (Linux's
    clockid for a pid). /proc's counts are in ticks of 10 ms, and 250 writes cost a replica 2 or 3 of them."""
    return time.clock_gettime(((~pid) << 3) | 2)  # CPUCLOCK_SCHED of the process `pid`


def process_rss(pid: int) -> int:
    """A process's resident memory in bytes, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * KiB
    raise AssertionError(f"no VmRSS for pid {pid}")


def metric(port: int, name: str) -> float:
    """One unlabelled series of a replica's /metrics."""
    text = httpx2.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{name} "))


def replica_env(abuse: Abuse, **env: str) -> dict[str, str]:
    """The settings of the stack's replicas (ABUSE_BOUNDS, its authentication), with `env` on top: for a
    replica of a test's own (replica_on)."""
    service = abuse.stack.service("mcp-server-1")
    auth = {"MCP_AUTH": "static", "MCP_AUTH_TOKENS": service.env["MCP_AUTH_TOKENS"]}
    return {**ABUSE_BOUNDS, **auth, "REQUEST_STATE_KEYS": abuse.stack.config.request_state_keys, **env}


async def instance_of(session: RawSession) -> str:
    return str((await session.call("get_server_info"))["instance"])


async def session_on_each_replica(http: httpx2.AsyncClient, abuse: Abuse, token: str, name: str) -> list[RawSession]:
    """Sessions opened through HAProxy until one is on each replica (it sends new ones to each in turn)."""
    found: dict[str, RawSession] = {}
    for _ in range(4 * len(abuse.stack.config.replica_ports)):
        session = await open_session(http, abuse.url, token, name=name)
        instance = await instance_of(session)
        if instance in found:
            await session.close()
        else:
            found[instance] = session
        if len(found) == len(abuse.stack.config.replica_ports):
            return list(found.values())
    raise AssertionError(f"new sessions reached only {sorted(found)}")


def error_of(response: httpx2.Response) -> dict:
    """The JSON-RPC error a response carries ({} when none): as JSON, or as an SSE stream's last message."""
    try:
        messages = jsonrpc_messages(response)
    except (ValueError, json.JSONDecodeError):
        return {}
    error = messages[-1].get("error") if messages else None
    return error if isinstance(error, dict) else {}


async def listen_until(session: SessionlessSession, notifications: dict, until: float) -> str:
    """A subscriptions/listen stream held open until `until` (time.monotonic): how it went, as
    "<HTTP version> <status> held", "... refused: <the error>", or the name of the exception that ended it."""
    try:
        async with session.stream("subscriptions/listen", {"notifications": notifications}) as stream:
            response = stream.response
            answer = f"{response.http_version} {response.status_code}"
            if not response.headers.get("content-type", "").startswith("text/event-stream"):
                await response.aread()
                return f"{answer} refused: {error_of(response).get('message', response.text[:120])}"
            async for event in stream:
                if event.message is None:
                    continue
                if "error" in event.message:
                    return f"{answer} refused: {event.message['error'].get('message')}"
                break  # acknowledged: the stream is open
            else:
                return f"{answer} ended"
            await asyncio.sleep(max(0.0, until - time.monotonic()))
            return f"{answer} held"
    except httpx2.HTTPError as exc:
        return type(exc).__name__


def sessionless_meta(name: str) -> dict:
    """What a 2026-07-28 request carries in params._meta (as SessionlessSession sends it)."""
    return {
        "io.modelcontextprotocol/protocolVersion": SESSIONLESS_PROTOCOL,
        "io.modelcontextprotocol/clientInfo": {"name": name, "version": "1"},
        "io.modelcontextprotocol/clientCapabilities": {},
    }


def sessionless_headers(token: str, method: str, name: str | None = None) -> dict[str, str]:
    h = {**headers(token), "MCP-Protocol-Version": SESSIONLESS_PROTOCOL, "Mcp-Method": method}
    if name:
        h["Mcp-Name"] = name
    return h


async def wait_on_replay(
    http: httpx2.AsyncClient, url: str, token: str, session_id: str, event_id: str, statuses: Counter[int]
) -> None:
    """A `GET` with Last-Event-ID, followed until the call ends (or the task is cancelled); its status
    counted as soon as it comes."""
    hdrs = {**headers(token, session_id), "Last-Event-ID": event_id}
    async with http.stream("GET", url, headers=hdrs) as response:
        statuses[response.status_code] += 1
        with contextlib.suppress(httpx2.HTTPError):
            await response.aread()


def h2c_client(source: str) -> httpx2.AsyncClient:
    """One HTTP/2 connection with prior knowledge (h2c) from `source`, carrying up to 100 requests at once."""
    limits = httpx2.Limits(max_connections=1, max_keepalive_connections=1)
    transport = httpx2.AsyncHTTPTransport(http1=False, http2=True, local_address=source, limits=limits)
    return httpx2.AsyncClient(transport=transport, timeout=10)


def listen_streams(stack: Stack) -> list[int]:
    """The listen streams each replica serves now."""
    return [int(metric(port, "mcp_listen_streams")) for port in stack.config.replica_ports]


def raw_request(method: str, path: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    """An HTTP/1.1 request as bytes, its path exactly as given (an HTTP client would normalize it)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def raw_exchange(port: int, source: str, request: bytes) -> tuple[int, str]:
    """Sends `request` (raw_request: Connection: close) on a connection of its own from `source`: the
    answer's status and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(10):
            answer = await reader.read()  # to the end: the server closes after its answer
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body.decode(errors="replace")


# -- finding 1: one client filled Redis -----------------------------------------------------------------


class TestOneClientCannotFillRedis:
    """Finding 1: resume_session copied a 256 KiB state into fresh handles (~800 bytes stored for each byte
    sent), a streamed call left its re-run record for 300 s, and no bound counted either: one client took
    Redis to maxmemory in ~4 s, and every principal's writes failed."""

    async def test_copies_and_call_records_stop_at_max_client_bytes(self, abuse: Abuse) -> None:
        """Redis's maxmemory set to what it holds plus 2 x MAX_CLIENT_BYTES. One client makes 300 streamed
        calls with 15 KB of _meta each (4.5 MB of re-run records if kept), then copies its 256 KiB state into
        up to 48 handles (12 MiB, 1.5 x MAX_CLIENT_BYTES): the call records are gone once the calls answered;
        a copy past the quota is a tool error naming MAX_CLIENT_BYTES, nothing of it applied; Redis never
        fills, so every write of the bystander succeeds."""
        stack, token = abuse.stack, abuse.tokens["filler"]
        original = stack.redis_command("redis", "CONFIG", "GET", "maxmemory")
        note = "n" * (MAX_NOTE_BYTES - 1)
        outcome: dict[str, Any] = {"copies": 0, "refusal": None, "refused_copy_notes": 0}

        async def attack() -> None:
            stack.redis_command("redis", "CONFIG", "SET", "maxmemory", str(used_memory(stack) + 2 * MAX_CLIENT_BYTES))
            try:
                async with attacker_http("127.0.0.30") as http:
                    caller = await open_session(http, abuse.url, token, name="filler")
                    before = used_memory(stack)

                    async def streamed(i: int) -> int:
                        params = {"name": "analyze_data", "arguments": {"num_items": 0}, "_meta": {"pad": "p" * 15_000}}
                        return (await caller.post("tools/call", params)).status_code

                    outcome["calls"] = Counter(await bounded(300, 10, streamed, concurrency=6))
                    outcome["records"] = used_memory(stack) - before
                    holder = await open_session(http, abuse.url, token, name="filler")
                    for _ in range(25):  # 25 notes of 10 KB: just within MAX_SESSION_STATE_BYTES
                        assert tool_error_text(await call(holder, "add_note", {"note": note})) is None
                    deadline = time.monotonic() + 20
                    for _ in range(48):
                        if time.monotonic() > deadline:
                            break
                        message = await call(holder, "create_session")
                        refusal = tool_error_text(message)
                        if refusal is None:
                            handle = message["result"]["structuredContent"]["session_id"]
                            arguments = {"old_session_id": str(holder.session_id), "session_id": handle}
                            refusal = tool_error_text(await call(holder, "resume_session", arguments))
                            if refusal is not None:
                                notes = await call(holder, "list_notes", {"session_id": handle})
                                outcome["refused_copy_notes"] = len(
                                    notes.get("result", {}).get("structuredContent", {}).get("notes", [])
                                )
                        if refusal is not None:
                            outcome["refusal"] = refusal
                            break
                        outcome["copies"] += 1
            finally:
                stack.redis_command("redis", "CONFIG", "SET", "maxmemory", str(original[1]))  # type: ignore[index]

        try:
            await abuse.under_attack(
                "copies and call records (MAX_CLIENT_BYTES)", attack, memory_bound=MAX_CLIENT_BYTES * 3 // 2
            )
        finally:
            figure(
                "300 streamed calls, 15 KB _meta each",
                f"{outcome.get('calls')}, Redis {outcome.get('records', 0) / MiB:.2f} MiB after they answered",
            )
            figure(
                "256 KiB copies into handles",
                f"{outcome['copies']} copied ({outcome['copies'] * MAX_SESSION_STATE_BYTES / MiB:.1f} MiB), then "
                f"{(outcome['refusal'] or 'no refusal')[:90]!r}",
            )
        assert outcome["records"] <= 1 * MiB, f"{outcome['records']} bytes of call records outlived their calls"
        refusal = outcome["refusal"]
        assert refusal is not None and "MAX_CLIENT_BYTES" in refusal, refusal
        assert outcome["copies"] * MAX_SESSION_STATE_BYTES <= MAX_CLIENT_BYTES, outcome
        assert outcome["refused_copy_notes"] == 0, "the refused copy was applied"


class TestABusyClientAffordsItsOwnRecords:
    """Issue 35: every call through HAProxy carries an X-Request-Id, so every write kept an op record, each a
    key of its own charged ~800 bytes for OP_TTL_SECONDS: past ~70 writes a second a principal was refused by
    its own records at the default MAX_CLIENT_BYTES. A gateway serving many users is one principal."""

    async def test_a_thousand_writes_a_second_for_a_minute_fit_the_default_quota(self, abuse: Abuse) -> None:
        """600 increments through HAProxy, 6 at a time. What their records are charged, per write, times
        60,000 (1,000 writes a second for 60 s, all within the default op TTL, so none is freed meanwhile),
        stays within the default MAX_CLIENT_BYTES, with room for the state itself. The charge, not Redis's
        memory: the charge is what refuses a client, and it is exact where memory is noisy."""
        stack, token = abuse.stack, abuse.tokens["gateway"]
        writes = 600

        async def attack() -> tuple[int, Counter[str]]:
            async with attacker_http("127.0.0.31") as http:
                session = await open_session(http, abuse.url, token, name="gateway")
                payer = str(stack.redis_command("redis", "HGET", f"mcp:session:{session.session_id}", ".owner"))
                usage = f"mcp:usage:{payer.strip(chr(34))}:bytes"

                def op_charges() -> int:
                    flat = stack.redis_command("redis", "HGETALL", usage)
                    pairs = zip(flat[::2], flat[1::2], strict=True)  # type: ignore[index]
                    return sum(int(value) for name, value in pairs if str(name).startswith("omcp:op"))

                before = op_charges()

                async def increment(_: int) -> str:
                    return tool_error_text(await call(session, "increment_counter")) or "ok"

                outcome = Counter(await bounded(writes, 60, increment, concurrency=6))
                return op_charges() - before, outcome

        charged, outcome = await abuse.under_attack("600 keyed writes (op records)", attack)
        per_write = charged / writes
        figure("op records of 600 keyed writes", f"{outcome}, {per_write:.0f} bytes charged per write")
        assert outcome == Counter({"ok": writes}), outcome
        assert per_write > 0, "the writes kept no op record: a retry would apply them twice"
        assert 60_000 * per_write <= 0.75 * DEFAULT_MAX_BYTES_PER_HOLDER, f"{per_write:.0f} bytes a write"


class TestTasksStayWithinTheirClientsShare:
    """Issue 35: a durable task's arguments and context snapshot were kept in Redis for its life (and
    TASK_TTL_SECONDS after), charged to nobody, and a task that failed at once freed its slot, so
    MAX_TASKS_PER_CLIENT never bound: one principal took Redis from 2 MB to its maxmemory in 7.7 s."""

    async def test_tasks_that_fail_at_once_stop_at_max_client_bytes(self, abuse: Abuse) -> None:
        """Up to 400 analyze_data tasks, 2 at a time, each with a 60 KB session_id (within
        MAX_TASK_ARGUMENT_BYTES; no such session, so each fails at once), through FastMCP's own client
        with its tasks extension: a creation past the client's MAX_CLIENT_BYTES is refused by name,
        nothing started; Redis grows by at most the quota and a half; the bystander is untouched."""
        from fastmcp import Client

        outcome: dict[str, Any] = {"created": 0, "refusal": None}

        async def attack() -> None:
            async with Client(abuse.url, auth=abuse.tokens["tasker"], timeout=30) as client:

                async def create(_: int) -> None:
                    if outcome["refusal"] is not None:
                        return
                    # As fastmcp_tasks.call_tool_task sends it, but keeping a refusal's text (it raises instead).
                    arguments = {"num_items": 0, "session_id": "s" * 60_000}
                    answer = await client.session.call_tool("analyze_data", arguments, allow_claimed=True)
                    if getattr(answer, "task_id", None) is not None:  # a CreateTaskResult
                        outcome["created"] += 1
                    else:
                        outcome["refusal"] = " ".join(getattr(part, "text", "") for part in answer.content)

                await bounded(400, 40, create, concurrency=2)

        try:
            await abuse.under_attack("failing tasks (MAX_CLIENT_BYTES)", attack, memory_bound=MAX_CLIENT_BYTES * 3 // 2)
        finally:
            figure(
                "tasks of 60 KB arguments",
                f"{outcome['created']} created, then {(outcome['refusal'] or 'no refusal')[:100]!r}",
            )
        refusal = outcome["refusal"]
        assert refusal is not None and "MAX_CLIENT_BYTES" in refusal, refusal
        assert outcome["created"] * 60_000 <= MAX_CLIENT_BYTES, outcome


# -- finding 2: HTTP/2 past the per-address connection cap, and listen streams per client ---------------


class TestH2cCannotPassTheConnectionCap:
    """Finding 2: the MCP port took HTTP/2 with prior knowledge (h2c), 100 requests per connection, so one
    address held ~50,000 requests within its 500 connections; 3,100 listen streams over 31 connections took
    every replica out. Ramped instead, one client held every replica's 1,024 listen streams."""

    async def test_h2c_is_refused_on_the_plain_port(self, abuse: Abuse) -> None:
        """600 listen streams from one address over 6 h2c connections (past its cap of 500 connections,
        each carrying one request): none is served over HTTP/2."""
        token = abuse.tokens["h2c"]
        outcomes: Counter[str] = Counter()
        held: list[int] = [0]

        async def attack() -> None:
            clients = [h2c_client("127.0.0.31") for _ in range(6)]
            until = time.monotonic() + 3
            try:
                sessions = [SessionlessSession(client, abuse.url, token=token, client_name="h2c") for client in clients]

                async def look() -> None:
                    # Once, while they are held: a replica's /metrics page is work for it too.
                    await asyncio.sleep(until - 1 - time.monotonic())
                    held[0] = sum(await asyncio.to_thread(listen_streams, abuse.stack))

                async with asyncio.timeout(20):
                    results = await asyncio.gather(
                        look(),
                        *(listen_until(s, {"toolsListChanged": True}, until) for s in sessions for _ in range(100)),
                    )
                outcomes.update(str(r).split(":")[0] for r in results[1:])
            finally:
                for client in clients:
                    await client.aclose()

        try:
            await abuse.under_attack("600 listen streams over 6 h2c connections", attack, memory_bound=1 * MiB)
        finally:
            figure(
                "h2c listen streams, by outcome", f"{dict(outcomes)}; {held[0]} listen streams held 1 s before the end"
            )
        served = sum(n for kind, n in outcomes.items() if kind.startswith("HTTP/2"))
        assert served == 0, f"{served} of 600 h2c requests were served: {dict(outcomes)}"

    async def test_listen_streams_stop_at_the_per_client_cap(self, abuse: Abuse) -> None:
        """4 x MAX_LISTEN_STREAMS_PER_CLIENT listen streams per replica over HTTP/1.1 from one client, one
        every 20 ms (ramped, as in the review): at most MAX_LISTEN_STREAMS_PER_CLIENT held on each replica,
        the rest refused naming it; another principal listens as ever meanwhile."""
        replicas = len(abuse.stack.config.replica_ports)
        attempts = 4 * MAX_LISTEN_STREAMS_PER_CLIENT * replicas
        outcomes: Counter[str] = Counter()
        refusals: list[str] = []
        other: list[str] = []
        peak: list[int] = [0]

        async def attack() -> None:
            until = time.monotonic() + 4
            async with attacker_http("127.0.0.31", connections=attempts) as http, attacker_http("127.0.0.32") as them:
                listener = SessionlessSession(http, abuse.url, token=abuse.tokens["h2c"], client_name="h2c")
                bystander = SessionlessSession(them, abuse.url, token=abuse.tokens["other"], client_name="other")

                async def ramped(i: int) -> str:
                    await asyncio.sleep(i * 0.02)
                    return await listen_until(listener, {"toolsListChanged": True}, until)

                async def other_listens() -> None:
                    await asyncio.sleep(1.5)  # while the flood opens
                    other.append(await listen_until(bystander, {"toolsListChanged": True}, until))

                async def look() -> None:
                    # Once, when all are open (or refused): a replica's /metrics page is work for it too.
                    await asyncio.sleep(until - 0.5 - time.monotonic())
                    peak[0] = max(await asyncio.to_thread(listen_streams, abuse.stack))

                async with asyncio.timeout(20):
                    results = await asyncio.gather(look(), other_listens(), *(ramped(i) for i in range(attempts)))
                for result in results[2:]:
                    outcomes["held" if str(result).endswith("held") else "refused"] += 1
                    if " refused: " in str(result):
                        refusals.append(str(result).split(" refused: ", 1)[1])

        try:
            await abuse.under_attack(f"{attempts} listen streams from one client", attack, memory_bound=1 * MiB)
        finally:
            figure(
                "listen streams of one client, HTTP/1.1",
                f"{dict(outcomes)}; {peak[0]} on the fuller replica; another principal: {other}",
            )
        assert outcomes["held"] <= MAX_LISTEN_STREAMS_PER_CLIENT * replicas, outcomes
        assert peak[0] <= MAX_LISTEN_STREAMS_PER_CLIENT + 1, f"{peak[0]} listen streams on one replica"
        assert refusals and all("MAX_LISTEN_STREAMS_PER_CLIENT" in r for r in refusals), refusals[:3]
        assert other == ["HTTP/1.1 200 held"], other


# -- finding 3: large structures within the body limit ---------------------------------------------------


def structure_body(request_id: int, arguments: str) -> bytes:
    """A tools/call of increment_counter whose arguments are `arguments` (JSON text, as sent)."""
    head = (
        f'{{"jsonrpc":"2.0","id":{request_id},"method":"tools/call","params":{{"name":"increment_counter","arguments":'
    )
    return (head + arguments + "}}").encode()


class TestLargeStructuresAreRefusedCheaply:
    """Finding 3: 32 requests at once whose arguments were objects of 80,000 keys (~1 MB, within the body
    limit) stalled each replica's event loop while it parsed, validated and digested them: the replicas
    were marked down one after another."""

    async def test_wide_and_deep_bodies_get_400_before_any_work(self, abuse: Abuse) -> None:
        """64 tools/call bodies, one every 80 ms (the review's ~12 a second) and at most 16 at once, at a
        session on each replica through HAProxy: three in four
        with arguments of 80,000 keys (880 KB, 8 x MAX_REQUEST_ITEMS), one in four nested 5,000 deep. Each
        is 400 with a -32600 naming the bound it passed."""
        token = abuse.tokens["attacker"]
        wide = "{" + ",".join(f'"k{i:05d}":0' for i in range(8 * MAX_REQUEST_ITEMS)) + "}"
        deep = '{"a":' + "[" * 5000 + "]" * 5000 + "}"
        assert len(structure_body(64, wide)) < MAX_BODY_BYTES
        answers: list[tuple[str, int, dict, float]] = []

        async def attack() -> None:
            async with attacker_http("127.0.0.33") as http:
                sessions = await session_on_each_replica(http, abuse, token, "wide")

                began = time.monotonic()

                async def one(i: int) -> None:
                    await asyncio.sleep(max(0.0, began + i * 0.08 - time.monotonic()))
                    kind, arguments = ("deep", deep) if i % 4 == 3 else ("wide", wide)
                    hdrs = sessions[i % len(sessions)].headers()
                    body = structure_body(i, arguments)  # ids of their own: one in flight twice is another refusal
                    started = time.monotonic()
                    try:
                        response = await http.post(abuse.url, content=body, headers=hdrs)
                    except httpx2.HTTPError as exc:  # cut: its replica was taken out under it
                        answers.append((kind, 0, {"message": type(exc).__name__}, time.monotonic() - started))
                        return
                    answers.append((kind, response.status_code, error_of(response), time.monotonic() - started))

                await bounded(64, 10, one, concurrency=16)
                for session in sessions:
                    await session.close()

        try:
            await abuse.under_attack("64 bodies of 80,000 keys or 5,000 deep", attack, memory_bound=1 * MiB)
        finally:
            kinds = Counter((kind, status, error.get("code")) for kind, status, error, _ in answers)
            seconds = percentile([s for *_, s in answers], 0.5) if answers else 0.0
            figure("wide and deep bodies, by answer", f"{dict(kinds)}; p50 answer {seconds * 1000:.0f} ms")
        assert len(answers) >= 32, len(answers)
        for kind, status, error, _ in answers:
            bound = "MAX_REQUEST_ITEMS" if kind == "wide" else "MAX_REQUEST_DEPTH"
            assert status == 400 and error.get("code") == -32600, (kind, status, error)
            assert bound in str(error.get("message")), (kind, error)


# -- finding 4: replays read the whole log on every event -----------------------------------------------


class TestReplayReadsFromItsCursor:
    """Finding 4: a waiting replay re-read the session's whole event log (up to 1,000 entries) on every event
    of the session: 4 sessions x 8 replays took Redis from 0.05 to 0.83 cores, the bystander's p99 x18."""

    async def test_replays_of_a_quiet_call_beside_a_busy_one_cost_what_they_read(self, abuse: Abuse) -> None:
        """4 sessions, each with its event log filled first (~1,000 events; before the bystander's baseline),
        a quiet watch_counter and a busy analyze_data (~40 events/s). 6 replays of each quiet call wait on it:
        Redis's CPU with them is at most twice what it is without them."""
        token = abuse.tokens["rereader"]
        load: dict[str, tuple[float, float]] = {}
        statuses: Counter[int] = Counter()

        async def fill(session: RawSession) -> None:
            # ~83 events a call (each item's log and progress): 12 fill the log to its 1,000 events, 4 at a time
            # (4 sessions of one client within MAX_CALLS_PER_CLIENT wherever they are).
            for _ in range(3):
                await asyncio.gather(*(call(session, "analyze_data", {"num_items": 40}) for _ in range(4)))

        async with attacker_http("127.0.0.34", connections=200, timeout=30) as http:
            sessions = [await open_session(http, abuse.url, token, name="rereader") for _ in range(4)]
            async with asyncio.timeout(30):
                await asyncio.gather(*(fill(s) for s in sessions))

            async def attack() -> None:
                # The attack runs on an event loop of its own (in_attacker_thread): so does its client, for the
                # same sessions.
                async with attacker_http("127.0.0.34", connections=200, timeout=30) as own:
                    for s in sessions:
                        s.http = own
                    try:
                        async with contextlib.AsyncExitStack() as calls:
                            entered = await asyncio.gather(
                                *(calls.enter_async_context(long_call(s, 6)) for s in sessions)
                            )
                            ids = [event_id for event_id, _ in entered]
                            busy = [asyncio.create_task(call(s, "analyze_data", {"num_items": 100})) for s in sessions]
                            await asyncio.sleep(0.5)
                            load["without"] = await redis_load(abuse.stack, 1.5)
                            replays = [
                                asyncio.create_task(
                                    wait_on_replay(own, abuse.url, token, str(s.session_id), event_id, statuses)
                                )
                                for s, event_id in zip(sessions * 6, ids * 6, strict=True)
                            ]
                            await asyncio.sleep(0.5)  # past the replays' catching up: what they cost waiting
                            load["with"] = await redis_load(abuse.stack, 2.0)
                            for task in replays:
                                task.cancel()
                            async with asyncio.timeout(15):
                                await asyncio.gather(*busy)
                                await asyncio.gather(*replays, return_exceptions=True)
                    finally:
                        for s in sessions:
                            s.http = http

            try:
                await abuse.under_attack("24 replays beside a busy call", attack, memory_bound=4 * MiB)
            finally:
                for s in sessions:
                    await s.close()
                if len(load) == 2:
                    figure(
                        "Redis without / with the 24 replays",
                        f"{load['without'][0]:.3f} / {load['with'][0]:.3f} cores, {load['without'][1]:.0f} / "
                        f"{load['with'][1]:.0f} commands/s; replays by status {dict(statuses)}",
                    )
        assert load["with"][0] <= 2 * max(load["without"][0], 0.02), load


# -- finding 5: calls in flight ----------------------------------------------------------------------


class TestCallsInFlightAreBounded:
    """Finding 5: nothing bounded calls in flight, and a call ran on after its client hung up: 600
    analyze_data calls, each abandoned after its first event, took the bystander's p99 x30."""

    async def test_abandoned_calls_are_capped_and_then_cancelled(self, abuse: Abuse) -> None:
        """30 analyze_data calls of 50 s on each of 2 sessions on one replica, all at once, each abandoned
        after its first event: past MAX_CALLS_PER_SESSION and MAX_CALLS_PER_CLIENT 429 with Retry-After and a
        JSON-RPC error naming the cap; within ABANDONED_CALL_SECONDS (and a little) the abandoned calls are
        cancelled: each session takes a new call, and Redis is back to its load without them."""
        token = abuse.tokens["caller"]
        by_session: list[Counter[int]] = []
        refusals: list[str] = []
        after: dict[str, Any] = {}

        async def attack() -> None:
            async with attacker_http("127.0.0.35", connections=100) as http:
                # Two sessions on one replica (HAProxy sends new ones to each in turn), so both caps meet them.
                sessions = [await open_session(http, abuse.url, token, name="caller")]
                home = await instance_of(sessions[0])
                for _ in range(6):
                    s = await open_session(http, abuse.url, token, name="caller")
                    if await instance_of(s) == home:
                        sessions.append(s)
                        break
                    await s.close()
                assert len(sessions) == 2, "no two new sessions on one replica"
                by_session.extend(Counter() for _ in sessions)
                before = await redis_load(abuse.stack, 1.0)

                async def abandon(i: int) -> None:
                    params = {"name": "analyze_data", "arguments": {"num_items": 1000}}
                    async with sessions[i % 2].stream("tools/call", params) as stream:
                        response = stream.response
                        by_session[i % 2][response.status_code] += 1
                        if response.status_code == 429:
                            assert_retry_after(response)
                            await response.aread()
                            refusals.append(str(error_of(response).get("message")))
                            return
                        async for event in stream:
                            if event.message is not None:
                                break  # its first event: then the client hangs up

                async with asyncio.timeout(20):
                    await asyncio.gather(*(abandon(i) for i in range(60)))
                during = await redis_load(abuse.stack, 1.0)
                await asyncio.sleep(ABANDONED_CALL_SECONDS + 1)
                after["redis"] = (before, during, await redis_load(abuse.stack, 1.0))
                # Each session takes a call again: the abandoned ones no longer hold its places.
                after["new call"] = [
                    (await s.post("tools/call", {"name": "analyze_data", "arguments": {"num_items": 1}})).status_code
                    for s in sessions
                ]
                for s in sessions:
                    await s.close()

        try:
            await abuse.under_attack("60 calls abandoned after their first event", attack, memory_bound=4 * MiB)
        finally:
            figure("abandoned calls per session, by status", f"{[dict(c) for c in by_session]}")
            if "redis" in after:
                (_, before_rate), (_, during_rate), (_, after_rate) = after["redis"]
                figure(
                    "Redis commands/s: before, during, after",
                    f"{before_rate:.0f}, {during_rate:.0f}, {after_rate:.0f} "
                    f"({ABANDONED_CALL_SECONDS + 1:.0f} s after); a new call per session: {after.get('new call')}",
                )
        for served in by_session:
            assert set(served) <= {200, 429}, by_session
            assert served[200] <= MAX_CALLS_PER_SESSION, by_session
        assert sum(c[200] for c in by_session) <= MAX_CALLS_PER_CLIENT, by_session
        assert refusals and all("MAX_CALLS_PER_" in r for r in refusals), refusals[:3]
        assert after["new call"] == [200] * 2, after["new call"]
        (_, before_rate), _, (_, after_rate) = after["redis"]
        # The bystander's own commands vary; the served calls, run on, would add ~40 events a second each.
        assert after_rate <= 2 * before_rate, after["redis"]


# -- finding 6: a write costs O(listeners) -----------------------------------------------------------------


@pytest.mark.timeout(150)  # replicas of its own to start
class TestWritesReachOnlyTheirListeners:
    """Finding 6: every write reached every listen stream on every replica: with 3,000 idle listeners, a
    write cost the replica 2.2x its CPU, and a writer's throughput halved."""

    async def test_writes_elsewhere_cost_a_listened_replica_nothing_per_listener(
        self, abuse: Abuse, tmp_path: Path
    ) -> None:
        """Two replicas of the test's own, their listen caps raised (what is measured here is the cost of a
        write, not the count of streams): one listen stream on one of them, 200 on the other, the 199 more
        to a handle nobody writes. A writer's increments through HAProxy (on the stack's replicas) cost the
        one with 200 listeners at most 1.5x the CPU they cost the one with one.

        Both hear the same writes at the same time, so a change of the machine's load meets both. A
        replica's timers cost it ~25 ms of CPU a second, more than the writes a writer makes meanwhile:
        measured while the writes came, CPU per write was mostly its timers over the writer's pace, which
        the load sets (1.53x once). So both are paused (SIGSTOP) while the writes are made, and what each
        spends once let go, until it has heard the last of them, is theirs."""
        env = replica_env(abuse, MAX_LISTEN_STREAMS="4000", MAX_LISTEN_STREAMS_PER_CLIENT="4000", METRICS="on")
        spent: dict[str, list[float]] = {"one": [], "200": []}
        made: list[int] = []
        held: list[int] = []
        listens: Counter[str] = Counter()

        with (
            replica_on(abuse.stack, tmp_path, "mcp-server-one-listener", **env) as alone,
            replica_on(abuse.stack, tmp_path, "mcp-server-200-listeners", **env) as crowded,
        ):
            replicas = {"one": alone, "200": crowded}

            async def attack() -> None:
                async with attacker_http("127.0.0.36") as http:
                    writer = await open_session(http, abuse.url, abuse.tokens["writer"], name="writer")
                    token = abuse.tokens["listener"]
                    # Its handle's update, written through HAProxy, tells when a paused replica has heard what
                    # was written before it: the feed is in order.
                    marker = SessionlessSession(http, abuse.url, token=token, client_name="marker")
                    idle = await SessionlessSession(http, crowded.url, token=token).open()
                    connections: list[asyncio.StreamWriter] = []

                    async def one_listener(replica: Replica, uri: str) -> asyncio.StreamReader | None:
                        """A listen stream on `replica` to `uri`, once acknowledged: what it sends next."""
                        params = {
                            "notifications": {"resourceSubscriptions": [uri]},
                            "_meta": sessionless_meta("listener"),
                        }
                        body = json.dumps(
                            {"jsonrpc": "2.0", "id": 1, "method": "subscriptions/listen", "params": params}
                        )
                        hdrs = sessionless_headers(token, "subscriptions/listen")
                        reader, w = await asyncio.open_connection(
                            "127.0.0.1", replica.port, local_addr=(f"127.0.0.{37 + len(connections) % 4}", 0)
                        )
                        connections.append(w)
                        w.write(raw_request("POST", "/mcp", hdrs, body.encode()))
                        await w.drain()
                        try:
                            async with asyncio.timeout(10):
                                head = await reader.readuntil(b"\r\n\r\n")
                                sse = b"text/event-stream" in head
                                # Its first event (the acknowledgement), or a JSON refusal.
                                first = await (reader.readuntil(b"\r\n\r\n") if sse else reader.read(4096))
                        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
                            listens[type(exc).__name__] += 1
                            return None
                        acknowledged = b"acknowledged" in first
                        listens["acknowledged" if acknowledged else first.decode()[-120:]] += 1
                        return reader if acknowledged else None

                    async def heard(
                        count: int, events: dict[str, asyncio.StreamReader]
                    ) -> tuple[int, dict[str, float]]:
                        """Up to `count` of the writer's increments, made while both replicas stood paused: how
                        many writes that was, the bystander's meanwhile included, and the CPU each replica
                        spent hearing them."""
                        pids = {name: replica.proc.pid for name, replica in replicas.items()}
                        for pid in pids.values():
                            os.kill(pid, signal.SIGSTOP)
                        # Silent for WATCH_SILENCE_SECONDS (5), a replica would take its feed for lost; and the
                        # three pauses end within 15 s of the 199 streams' opening (below).
                        deadline = time.monotonic() + 2.0
                        writes = 0
                        try:
                            counter = await abuse.counter_of_bystander()
                            while writes < count and time.monotonic() < deadline:
                                await writer.call("increment_counter")
                                writes += 1
                            writes += await abuse.counter_of_bystander() - counter
                            await marker.call("increment_counter", {"session_id": marker.handle})
                            before = {name: process_cpu(pid) for name, pid in pids.items()}
                        finally:
                            for pid in pids.values():
                                os.kill(pid, signal.SIGCONT)

                        async def cpu(name: str) -> float:
                            async with asyncio.timeout(10):
                                while b"notifications/resources/updated" not in await events[name].readuntil(
                                    b"\r\n\r\n"
                                ):
                                    pass
                            return process_cpu(pids[name]) - before[name]

                        costs = await asyncio.gather(*(cpu(name) for name in pids))
                        return writes, dict(zip(pids, costs, strict=True))

                    try:
                        # One listener on each, so each watches the change feed: the writes reach both.
                        uri = SUMMARY.format(await marker.open())
                        events: dict[str, asyncio.StreamReader] = {}
                        for name, replica in replicas.items():
                            reader = await one_listener(replica, uri)
                            assert reader is not None, listens
                            events[name] = reader
                        await heard(100, events)  # warm
                        await bounded(199, 15, lambda _: one_listener(crowded, SUMMARY.format(idle)), concurrency=20)
                        held.append(int(await asyncio.to_thread(metric, crowded.port, "mcp_listen_streams")))
                        # Within 15 s of their opening, before the 199 streams' first keepalives.
                        for _ in range(3):
                            writes, cost = await heard(500, events)
                            made.append(writes)
                            for name in spent:
                                spent[name].append(cost[name])
                    finally:
                        for w in connections:
                            w.close()
                    await writer.close()

            try:
                await abuse.under_attack("writes beside 200 listen streams", attack, memory_bound=2 * MiB)
            finally:
                batches = ", ".join(
                    f"{one / n * 1e6:.0f} / {crowded / n * 1e6:.0f}"
                    for n, one, crowded in zip(made, spent["one"], spent["200"], strict=False)
                )
                figure(
                    "replicas' CPU per write, 1 / 200 listeners",
                    f"{batches} us ({held} listen streams held; listens {dict(listens)})",
                )
        assert held and held[0] >= 195, (held, listens)
        ratio = sum(spent["200"]) / sum(spent["one"])
        figure("replicas' CPU for the same writes, 200 / 1", f"{ratio:.2f} (over {sum(made)} writes)")
        assert ratio <= 1.5, spent


# -- finding 7: waiting replays of a quiet call poll Redis ------------------------------------------------


class TestQuietReplaysShareOneCheck:
    """Finding 7: a waiting replay of a quiet, live call asked Redis 12.5 times a second whether the call's
    replica still lived: 192 replays took Redis from 55 to 2,458 commands/s."""

    async def test_more_replays_of_a_quiet_call_add_almost_no_commands(self, abuse: Abuse) -> None:
        """12 sessions with a quiet watch_counter each; one replay waiting on each, then three more on each
        (48 in all, at most MAX_REPLAYS on a replica): the 36 more replays of the same calls add at most 4
        Redis commands/s each, once they wait (a replay polling on its own, as before, adds ~12.5).

        Most of Redis's commands are the bystander's, and their rate follows its calls: what a window adds
        is its rate (redis_commands_beside) less the window before's, scaled by the bystander's calls in
        each."""
        token = abuse.tokens["poller"]
        window: list[tuple[float, float]] = []  # (Redis commands/s, bystander calls/s): 0, 12, 48 replays
        statuses: Counter[int] = Counter()

        def added(i: int) -> float:
            (commands, calls), (commands_before, calls_before) = window[i], window[i - 1]
            return commands - commands_before * calls / calls_before

        async def attack() -> None:
            async with attacker_http("127.0.0.41", connections=100, timeout=30) as http:
                sessions = [await open_session(http, abuse.url, token, name="poller") for _ in range(12)]
                async with contextlib.AsyncExitStack() as watches:
                    entered = await asyncio.gather(*(watches.enter_async_context(long_call(s, 14)) for s in sessions))
                    ids = [event_id for event_id, _ in entered]
                    window.append(await redis_commands_beside(abuse, 2.5))
                    replays: list[asyncio.Task] = []
                    for per_session in (1, 3):
                        for s, event_id in zip(sessions * per_session, ids * per_session, strict=True):
                            replays.append(
                                asyncio.create_task(
                                    wait_on_replay(http, abuse.url, token, str(s.session_id), event_id, statuses)
                                )
                            )
                            await asyncio.sleep(0.01)
                        # All waiting, past what each does once as it starts: what a waiting replay costs.
                        await asyncio.sleep(1.5)
                        window.append(await redis_commands_beside(abuse, 2.5))
                    for task in replays:
                        task.cancel()
                    await asyncio.gather(*replays, return_exceptions=True)
                for s in sessions:
                    await s.close()

        try:
            await abuse.under_attack("48 replays of 12 quiet calls", attack, memory_bound=2 * MiB)
        finally:
            if len(window) == 3:
                figure(
                    "Redis commands/s a waiting replay adds",
                    f"the first of a call {added(1) / 12:.1f}, each further one {added(2) / 36:.1f} "
                    f"(bystander calls/s {', '.join(f'{calls:.0f}' for _, calls in window)}); "
                    f"replays by status {dict(statuses)}",
                )
        assert statuses[200] == 48, statuses
        assert added(2) <= 4 * 36, window


# -- finding 8: /metrics through HAProxy ----------------------------------------------------------------

METRICS_SPELLINGS = (
    "/metrics",
    "/%6detrics",
    "/%6Detrics",
    "/m%65trics",
    "/%6d%65%74%72%69%63%73",
    "/metrics/",
    "//metrics",
    "/./metrics",
    "/mcp/../metrics",
    "/%2fmetrics",
    "/%2e/metrics",
    "/metrics?format=prometheus",
    "/metrics;x",
    "/METRICS",
)


class TestMetricsIsNotReachableThroughHAProxy:
    """Finding 8: /metrics was refused through HAProxy only as spelled so: /%6detrics reached a replica,
    which decoded it, and answered with per-tool call counts and durations, store memory and sessions held."""

    async def test_every_spelling_of_metrics_is_404(self, abuse: Abuse) -> None:
        """14 spellings of /metrics, 10 times each, through HAProxy: each 404, none with a metric in it; the
        paths meant to be there (/health, /mcp) are served."""
        port = abuse.stack.config.http_port
        answers: dict[str, Counter[int]] = {path: Counter() for path in METRICS_SPELLINGS}
        leaked: list[str] = []
        health: list[int] = []

        async def attack() -> None:
            for _ in range(10):
                for path in METRICS_SPELLINGS:
                    status, body = await raw_exchange(port, "127.0.0.42", raw_request("GET", path, {}))
                    answers[path][status] += 1
                    if "mcp_" in body or "# HELP" in body:
                        leaked.append(path)
            health.append((await raw_exchange(port, "127.0.0.42", raw_request("GET", "/health", {})))[0])

        try:
            await abuse.under_attack("140 requests for /metrics, 14 spellings", attack, memory_bound=1 * MiB)
        finally:
            figure("spellings of /metrics answered 200", f"{sorted({p for p, c in answers.items() if c[200]})}")
        assert not leaked, f"metrics reached through HAProxy as {sorted(set(leaked))}"
        assert all(set(c) == {404} for c in answers.values()), {p: dict(c) for p, c in answers.items()}
        assert health == [200], health


# -- finding 9: /health tells everyone the store's memory ---------------------------------------------------


class TestHealthSaysNothingAboutMemory:
    """Finding 9: the unauthenticated /health showed Redis's used_bytes: anyone could watch another
    principal's use of the store."""

    async def test_health_has_no_memory_figures(self, abuse: Abuse) -> None:
        """/health, 50 times through HAProxy and 50 times at each replica: 200, and nothing about memory
        or bytes in it."""
        targets = [f"http://127.0.0.1:{abuse.stack.config.http_port}/health"] + [
            f"http://127.0.0.1:{port}/health" for port in abuse.stack.config.replica_ports
        ]
        bodies: Counter[tuple[int, str]] = Counter()

        async def attack() -> None:
            async with attacker_http("127.0.0.43") as http:
                for _ in range(50):
                    for url in targets:
                        response = await http.get(url)
                        bodies[(response.status_code, ",".join(sorted(response.json())))] += 1

        try:
            await abuse.under_attack("/health read 150 times", attack, memory_bound=1 * MiB)
        finally:
            figure("/health answers, by status and keys", f"{dict(bodies)}")
        for status, keys in bodies:
            assert status == 200, bodies
            assert "memory" not in keys and "bytes" not in keys, keys


# -- finding 10: the client chose its replica ----------------------------------------------------------------


class TestTheClientDoesNotChooseItsReplica:
    """Finding 10: sessionless requests carrying one made-up mcp-session-id all hashed to one replica (the
    bystander's p50 x10 there); and with a second mcp-session-id header, HAProxy's stick table read the last
    one and the hash the first, so the request skipped its session's replica and another adopted it."""

    async def test_a_made_up_session_id_does_not_route_sessionless_requests(self, abuse: Abuse) -> None:
        """200 sessionless (2026-07-28) get_server_info calls, each with the same made-up mcp-session-id, one
        every 25 ms, 4 at most at once: every one answered, and no replica answers more than 3 in 4 of them."""
        instances: Counter[str] = Counter()

        async def attack() -> None:
            async with attacker_http("127.0.0.44") as http:
                session = SessionlessSession(http, abuse.url, token=abuse.tokens["attacker"], client_name="router")
                junk = {"mcp-session-id": "made-up-session-id"}

                began = time.monotonic()

                async def one(i: int) -> None:
                    await asyncio.sleep(max(0.0, began + i * 0.025 - time.monotonic()))
                    params = {"name": "get_server_info", "arguments": {}}
                    response = await session.post("tools/call", params, headers=junk)
                    message = final_message(response) if response.status_code == 200 else {}
                    instances[str(message.get("result", {}).get("structuredContent", {}).get("instance"))] += 1

                await bounded(200, 8, one, concurrency=4)

        try:
            await abuse.under_attack("sessionless calls with one made-up session id", attack, memory_bound=1 * MiB)
        finally:
            figure("made-up session id: answered by", f"{dict(instances)}")
        assert "None" not in instances, instances
        assert max(instances.values()) <= 0.75 * sum(instances.values()), instances

    async def test_a_second_session_header_is_refused(self, abuse: Abuse) -> None:
        """8 sessions; on each, 5 calls carrying its own mcp-session-id and then a made-up one: each 400,
        and every session still answered by the replica it had."""
        moved: list[str] = []
        statuses: Counter[int] = Counter()

        async def attack() -> None:
            async with attacker_http("127.0.0.45") as http:
                for _ in range(8):
                    session = await open_session(http, abuse.url, abuse.tokens["attacker"], name="router")
                    home = await instance_of(session)
                    body = {"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": "increment_counter"}}
                    for i in range(5):
                        hdrs = [*session.headers().items(), ("mcp-session-id", f"made-up-{i}")]
                        response = await http.post(abuse.url, json=body, headers=hdrs)
                        statuses[response.status_code] += 1
                        if response.status_code == 200:
                            served_by = final_message(response).get("result", {}).get("structuredContent", {})
                            if served_by.get("instance") != home:
                                moved.append(str(session.session_id))
                    await session.close()

        try:
            await abuse.under_attack("calls with a second session header", attack, memory_bound=1 * MiB)
        finally:
            figure("two session headers", f"statuses {dict(statuses)}; sessions moved: {len(set(moved))} of 8")
        assert set(statuses) == {400}, statuses
        assert not moved, f"{len(set(moved))} sessions served (and adopted) by another replica"


# -- finding 11: what new sessions hold on a replica --------------------------------------------------------


@pytest.mark.timeout(150)  # a replica of its own to start
class TestNewSessionsCostABoundedAmount:
    """Finding 11: each new session held ~37 KB of a replica for its first minute: one address's 4,762
    sessions in 10 s grew the replicas by 180 MB, and MAX_SESSIONS of them would take ~7 GB."""

    async def test_one_clients_new_sessions_hold_a_bounded_number_of_transports(
        self, abuse: Abuse, tmp_path: Path
    ) -> None:
        """A replica of the test's own (MAX_SESSIONS_PER_CLIENT raised to 1,000, MAX_TRANSPORTS_PER_CLIENT
        16, and SESSION_IDLE_SECONDS 60, so only the per-client bound can drop a transport within the test):
        one client opens 150 sessions on it, then 150 more. The replica holds at most 16 of its transports
        (and the 8 in flight), the second 150 grow it by at most 16 KiB a session (RSS moves by whole arenas:
        the issue's ~4 KB cannot be told from it here; the first 150 warm it; each held ~40 KiB before), and
        each session is served afterwards."""
        transports = 16
        env = replica_env(
            abuse,
            MAX_SESSIONS_PER_CLIENT="1000",
            MAX_TRANSPORTS_PER_CLIENT=str(transports),
            SESSION_IDLE_SECONDS="60",
            METRICS="on",
        )
        figures: dict[str, Any] = {}

        with replica_on(abuse.stack, tmp_path, "mcp-server-opened", **env) as replica:

            async def attack() -> None:
                async with attacker_http("127.0.0.46") as http:
                    token = abuse.tokens["opener"]
                    opened: list[RawSession] = []

                    async def one(i: int) -> None:
                        opened.append(await open_session(http, replica.url, token, name="opener"))

                    await bounded(150, 20, one, concurrency=8)
                    rss = process_rss(replica.proc.pid)
                    figures["rss first"] = (rss - figures["rss"]) / max(len(opened), 1)
                    await bounded(150, 20, one, concurrency=8)
                    figures["held"] = int(await asyncio.to_thread(metric, replica.port, "mcp_sessions_held"))
                    figures["rss per session"] = (process_rss(replica.proc.pid) - rss) / max(len(opened) - 150, 1)
                    figures["opened"] = len(opened)
                    # Each, asked again (the forgotten ones adopted back), keeps its own state.
                    for session in opened[::20]:
                        assert (await session.call("increment_counter"))["counter"] == 1

            figures["rss"] = process_rss(replica.proc.pid)
            try:
                await abuse.under_attack("300 new sessions of one client", attack, memory_bound=2 * MiB)
            finally:
                figure(
                    "300 new sessions on one replica",
                    f"{figures.get('opened')} opened, {figures.get('held')} transports held; RSS "
                    f"{figures.get('rss first', 0) / KiB:.1f} KiB a session for the first 150, "
                    f"{figures.get('rss per session', 0) / KiB:.1f} KiB for the next",
                )
        assert figures["opened"] == 300, figures
        assert figures["held"] <= transports + 8, figures
        assert figures["rss per session"] <= 16 * KiB, figures


# -- finding 12: tracebacks for what a client does -------------------------------------------------------


class TestDisconnectsLogNoTraceback:
    """Finding 12: a 2026-07-28 request cut before its body had arrived (HAProxy cuts them at a mark-down)
    logged an ERROR "Exception in ASGI application" with a traceback (ClientDisconnect in the SDK's path)."""

    async def test_requests_cut_mid_body_log_at_most_a_line_each_below_error(self, abuse: Abuse) -> None:
        """At each replica, 30 sessionless tools/call and 10 initialize requests whose connection closes
        half way through the body: no line at ERROR, no traceback, at most one line each."""
        stack = abuse.stack
        names = stack.config.replica_names()
        token = abuse.tokens["attacker"]
        params = {"name": "get_server_info", "arguments": {}, "_meta": sessionless_meta("leaver")}
        modern = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params}).encode()
        legacy = json.dumps(initialize_body({"name": "leaver", "version": "1"})).encode()
        # Three in four sessionless (the SDK's modern path), one in four a session-era initialize.
        kinds = [(sessionless_headers(token, "tools/call", "get_server_info"), modern)] * 3
        kinds.append((headers(token), legacy))
        sizes = {name: (stack.log_dir / f"{name}.log").stat().st_size for name in names}
        cut = 0

        async def half(port: int, hdrs: dict[str, str], body: bytes) -> None:
            nonlocal cut
            _, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.47", 0))
            request = raw_request("POST", "/mcp", hdrs, body)
            writer.write(request[: len(request) - len(body) // 2])
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.close()
            cut += 1

        async def attack() -> None:
            for port in stack.config.replica_ports:
                for i in range(40):
                    await half(port, *kinds[i % 4])
            await asyncio.sleep(0.5)  # for the replicas to have logged what they log

        try:
            await abuse.under_attack("80 requests cut half way through the body", attack, memory_bound=1 * MiB)
        finally:
            lines: list[str] = []
            for name in names:
                with (stack.log_dir / f"{name}.log").open("rb") as log:
                    log.seek(sizes[name])
                    lines += log.read().decode(errors="replace").splitlines()
            errors = [line for line in lines if '"level": "ERROR"' in line or '"level": "CRITICAL"' in line]
            tracebacks = [line for line in lines if "Traceback" in line]
            about = [
                line
                for line in lines
                if "127.0.0.47" in line or ('"uvicorn.access"' not in line and '"level": "WARNING"' in line)
            ]
            figure("disconnects: ERROR lines, tracebacks", f"{len(errors)}, {len(tracebacks)} for {cut} cut requests")
        assert not errors and not tracebacks, (errors + tracebacks)[0][:600]
        assert len(about) + len(errors) <= cut, about[:3]


# -- issue 35: fair latency, not only fair counts -------------------------------------------------------


HOG_SOURCE = "127.0.0.60"
# A second of progress per call (ANALYZE_STEP_SECONDS 0.05): ~40 notifications, each logged and streamed.
HOG_ITEMS = 20
# Added to P99_RATIO x the bystander's p99 alone, which on loopback is 2-5 ms: there one late wake-up of a
# process on a busy 2-core machine (the hog's client runs in this one) is a ratio of 2, whatever the replica
# does. Small, because the hog's whole harm without a share is 15-40 ms here, not the issue's 500 (no
# HAProxy, one replica's process).
FLOOR_SECONDS = 0.003
# ABUSE_BOUNDS's call bounds, which the test gives its replica at their defaults.
CALL_BOUNDS = ("MAX_CALLS_PER_CLIENT", "CALL_QUEUE_SECONDS", "FAIR_SHARE_CALLS")
# The bystander's windows measured while the hog calls, one after the other.
WITH_THE_HOG = ("with the hog", "with the hog, again")


@pytest.mark.timeout(150)  # a replica of its own to start
class TestOneClientCannotStarveAnother:
    """Issue 35, item 3: one principal with every call its bounds allowed in flight (12 sessions x 16
    streamed calls, 176 admitted) took a bystander's p99 on the same replica from 18 ms to 506 ms (x27.7)."""

    async def test_a_client_at_its_whole_allowance_costs_a_bystander_at_most_3x_p99(
        self, abuse: Abuse, tmp_path: Path
    ) -> None:
        """A replica of the test's own at the default call bounds (MAX_CALLS_PER_CLIENT 64, 16 a session, a
        queue of 10 s), and a bystander process calling it straight (HAProxy's caps would meet the hog first)
        all along. Its p99 alone (the quieter of a window before the hog and one after), and with the hog
        keeping its whole allowance of streamed calls going (4 sessions x 16 analyze_data, each sent again as
        soon as it answers; the quieter of two windows): at most P99_RATIO x alone, plus FLOOR_SECONDS. None
        of the bystander's calls fails, and the hog's are served all along (any refused, having waited
        CALL_QUEUE_SECONDS for its share, says so): the replica's time is shared, not taken from the hog."""
        allowance, per_session = 64, MAX_CALLS_PER_SESSION  # the defaults
        # The stack's bounds but the calls': this replica's are the defaults.
        env = {k: v for k, v in replica_env(abuse).items() if k not in CALL_BOUNDS}
        token = abuse.tokens["hog"]
        window = 4.0
        windows: dict[str, tuple[float, float]] = {}
        hog: Counter[str] = Counter()
        refusals: list[str] = []

        async def measure(name: str) -> None:
            started = time.monotonic()
            await asyncio.sleep(window)
            windows[name] = (started, time.monotonic())

        with (
            replica_on(abuse.stack, tmp_path, "mcp-server-shared", **env) as replica,
            bystander_process(replica.url, abuse.tokens["bystander"], tmp_path / "bystander.log") as bystander,
        ):
            async with attacker_http(HOG_SOURCE, connections=2 * allowance, timeout=30) as http:
                sessions = [
                    await open_session(http, replica.url, token, name="hog") for _ in range(allowance // per_session)
                ]
                stop = asyncio.Event()

                async def keep_calling(session: RawSession) -> None:
                    while not stop.is_set():
                        params = {"name": "analyze_data", "arguments": {"num_items": HOG_ITEMS}}
                        response = await session.post("tools/call", params)
                        hog[f"HTTP {response.status_code}"] += 1
                        if response.status_code == 429:  # past its share for CALL_QUEUE_SECONDS: sent again
                            refusals.append(str(error_of(response).get("message")))
                        elif response.status_code == 200 and tool_error_text(final_message(response)) is None:
                            hog["answered"] += 1

                bystander.run()
                await asyncio.sleep(1.0)  # warm: a new replica's first calls are slower
                await measure("before")
                hogs = [asyncio.create_task(keep_calling(s)) for s in sessions for _ in range(per_session)]
                try:
                    await asyncio.sleep(1.0)  # every hog call sent and under way
                    answered = hog["answered"]
                    for name in WITH_THE_HOG:
                        await measure(name)
                    hog["answered while measured"] = hog["answered"] - answered
                finally:
                    stop.set()
                    async with asyncio.timeout(60):
                        await asyncio.gather(*hogs)
                await measure("after")
                acked, failed = await bystander.pause()
                for session in sessions:
                    await session.close()

        p99 = {}
        for name, (start, end) in windows.items():
            samples = [s for s in bystander.samples if start <= s.start < end]
            assert samples and all(s.ok for s in samples), [s.error for s in samples if not s.ok][:3]
            p99[name] = percentile([s.seconds for s in samples], 0.99)
            hog[f"bystander's calls {name}"] = len(samples)
        # Each the quieter of two windows, alone as with the hog: the machine (other processes on 2 cores) only
        # ever adds to a p99, and a burst of theirs (3.23x once, beside a failover loop) fills one window of
        # four seconds, not two; a hog that starves the bystander slows both of its windows.
        alone = min(p99["before"], p99["after"])
        with_the_hog = min(p99[name] for name in WITH_THE_HOG)
        ratio = with_the_hog / alone
        ABUSE_FIGURES.append(
            f"{'a client at its whole allowance':<44} bystander p99 {p99['before'] * 1000:.1f} / "
            f"{' and '.join(f'{p99[name] * 1000:.1f}' for name in WITH_THE_HOG)} / {p99['after'] * 1000:.1f} ms "
            f"(before / with / after): {ratio:.2f}x"
        )
        figure("the hog's calls, the bystander's", f"{dict(hog)}")
        assert failed == 0 and acked == len(bystander.samples), (acked, failed)
        # Shared, not taken from the hog: its calls were served all along, and any refused had waited their turn
        # CALL_QUEUE_SECONDS, and said so.
        assert {k for k in hog if k.startswith("HTTP")} <= {"HTTP 200", "HTTP 429"}, hog
        assert all("FAIR_SHARE_CALLS" in r and "CALL_QUEUE_SECONDS" in r for r in refusals), refusals[:3]
        assert hog["answered while measured"] > 0, hog
        assert with_the_hog <= P99_RATIO * alone + FLOOR_SECONDS, (
            f"bystander p99 {with_the_hog * 1000:.1f} ms with the hog, {alone * 1000:.1f} ms alone: "
            f"{ratio:.2f}x (at most {P99_RATIO}x + {FLOOR_SECONDS * 1000:.0f} ms)"
        )
