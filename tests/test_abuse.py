"""The abuse suite (issue 17): each class of attack, bounded to seconds, against a stack of its own.

`abuse_stack` (tests/conftest.py): Redis, two replicas with static-token authentication and a few bounds set
low (ABUSE_BOUNDS), HAProxy in front. Each test runs one class of attack from a loopback address of its own
(127.0.0.2 and up, so HAProxy's per-address caps meet the attacker, not the bystander) and asserts:

- the bound holds (the attack is answered as the bound says: a status, a JSON-RPC or tool error, Redis
  memory added within a figure);
- every replica stays in rotation (HAProxy's stats, polled through the attack, then each replica's /health,
  under the pid it had);
- a bystander session, calling increment_counter through HAProxy from 127.0.0.1 in a process of its own
  (so the attacker's client cannot slow it), keeps its p99 under attack within P99_RATIO its own p99
  measured just before the attack in the same test (ratios only, never absolute times);
- nothing acknowledged is lost: the bystander's counter equals the increments it was told succeeded.

Every attack loop is bounded in count and in time. The figures (memory added, p99 ratios) are printed at
the end of the run (conftest.ABUSE_FIGURES).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import queue
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
from conftest import ABUSE_BOUNDS, ABUSE_FIGURES, ROOT, replica_on

from mcp_ha.check.wire import ACCEPT, PROTOCOL, RawSession, final_message, last_jsonrpc_message
from mcp_ha.stack import Stack, http_status

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
MiB = 1 << 20

# The bystander, in a process of its own: opens a session through HAProxy, then on "run" calls
# increment_counter every BYSTANDER_PERIOD until "pause". Each call is one line on stdout:
# {"t": start (time.monotonic, the system's clock, comparable across processes), "s": seconds, "ok": bool,
# "e": what failed}; "pause" answers {"paused": acked, "failed": n} once its call in flight is answered.
BYSTANDER = r"""
import asyncio, json, sys, threading, time
import httpx2
from mcp_ha.check.wire import CallFailed, RawSession

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
                result = await attack()
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
        assert ratio <= P99_RATIO, (
            f"bystander p99 {attack_p99 * 1000:.1f} ms under attack, {baseline_p99 * 1000:.1f} ms before: "
            f"{ratio:.2f}x (at most {P99_RATIO}x)"
        )
        if memory_bound is not None:
            assert memory_added <= memory_bound, f"{name}: Redis grew by {memory_added} bytes (at most {memory_bound})"
        return result


@pytest.fixture(scope="module")
def abuse(
    abuse_stack: Stack, abuse_tokens: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Abuse]:
    log = tmp_path_factory.mktemp("bystander") / "bystander.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                BYSTANDER,
                abuse_stack.config.mcp_url,
                abuse_tokens["bystander"],
                str(BYSTANDER_PERIOD),
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        try:
            bystander = Bystander(proc, log)
            pids = {name: abuse_stack.pid(name) for name in abuse_stack.config.replica_names()}
            yield Abuse(abuse_stack, abuse_tokens, bystander, pids)
        finally:
            if proc.stdin:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


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
            deadline = time.monotonic() + 20
            # 1 MiB of 20 KB notes is 53: 80 is past it whichever way the state is counted.
            for _ in range(80):
                assert time.monotonic() < deadline, "the state bound was not reached in time"
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
    append at the cap costs at most 3x the append on an empty session (p50s); a list_notes answer over
    MAX_EVENT_BYTES, asked for again and again, is not kept in Redis."""
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

            sessions = [await open_session(http, abuse.url, token) for _ in range(3)]
            deadline = time.monotonic() + 40
            for n in range(1, MAX_NOTES + 1):
                for s in sessions:
                    assert time.monotonic() < deadline, f"{n} notes per session took too long"
                    t = time.perf_counter()
                    message = await call(s, "add_note", {"note": note})
                    elapsed = time.perf_counter() - t
                    assert tool_error_text(message) is None, (n, message)
                    assert message["result"]["structuredContent"]["notes_count"] == n
                    if n <= 10:
                        early.append(elapsed)
                    elif n > MAX_NOTES - 10:
                        late.append(elapsed)
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
        # A change for the watch to report: until it has something to stream, its answer is JSON-to-be.
        await asyncio.sleep(0.2)
        await session.call("increment_counter")
        async with asyncio.timeout(10):
            event_id = await first
        yield event_id, task
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
                deadline = time.monotonic() + 20
                refusal = None
                for i in range(len(sessions) * 25):
                    assert time.monotonic() < deadline, "Redis never refused a write"
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
