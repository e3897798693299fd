"""Every fixture that starts a process lives here.

The stacks are real: redis-server, haproxy and `python -m server` replicas,
started by the same `Stack` class as `python stack.py`, on free loopback
ports, in a temporary directory. Nothing is faked.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx2
import pytest
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from fastmcp import Client
from fastmcp.server.auth.providers.jwt import RSAKeyPair
from jwt.algorithms import RSAAlgorithm

from mcp_ha.ops.check.wire import RawSession

# FastMCP's Client asks servers to run task tools as tasks once fastmcp-tasks is imported anywhere in the
# process (the kit's `tasks` extra; FastMCP's own opt-in). Imported here, every test's Client is the one a
# user of the extra has, whichever tests were collected; `tests/clients.py` has one that does not ask.
with contextlib.suppress(ImportError):
    import fastmcp_tasks  # noqa: F401
from mcp_ha.ops.stack import Service, Stack, StackConfig, free_ports, port_is_free
from mcp_ha.streams.lease import RUNNER_CHECK_SECONDS, Runs

ROOT = Path(__file__).resolve().parent.parent
# mcp_ha's modules that are not the server layer: a client, the local stack, the command.
NOT_THE_LAYER = ("cli.py", "resilient_client.py", "stack.py")


# How many inputs of each class tests/test_hostile_input.py sent, printed after the run.
HOSTILE_INPUTS: Counter[str] = Counter()


# What tests/test_abuse.py measured for each class of attack (Redis memory added, the bystander's p99 ratio),
# printed after the run.
ABUSE_FIGURES: list[str] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if ABUSE_FIGURES:
        terminalreporter.section("abuse classes: Redis memory added, bystander p99 under attack / baseline")
        for line in ABUSE_FIGURES:
            terminalreporter.write_line(line)
    if HOSTILE_INPUTS:
        terminalreporter.section("hostile inputs tried, by class")
        for kind, count in sorted(HOSTILE_INPUTS.items()):
            terminalreporter.write_line(f"{count:>6}  {kind}")
        terminalreporter.write_line(f"{sum(HOSTILE_INPUTS.values()):>6}  in all")


# The markers a test gets from the processes its fixtures start (pyproject registers them): `quick` is exactly
# the tests with none of them, so `make test-quick` cannot start a process by a fixture.
PROCESS_MARKS = frozenset({"redis", "haproxy", "node", "docker", "slow", "process"})


def starts(*marks: str) -> Callable[[Callable[..., object]], Callable[..., object]]:
    """Declares what a fixture starts (a subset of PROCESS_MARKS); every test using it, however indirectly,
    is marked so. Put it under `@pytest.fixture`, on the function itself."""
    assert set(marks) <= PROCESS_MARKS, marks

    def declare(fixture: Callable[..., object]) -> Callable[..., object]:
        fixture.starts = frozenset(marks)  # type: ignore[attr-defined]
        return fixture

    return declare


def process_marks(item: pytest.Item) -> set[str]:
    """The process markers a test has: from the fixtures it uses (the active definition of each name in its
    closure) and from its own marks, for a test that starts a process in its body."""
    marks = {m.name for m in item.iter_markers() if m.name in PROCESS_MARKS}
    definitions = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        defs = definitions.name2fixturedefs.get(name) if definitions else None
        if defs:
            marks |= getattr(defs[-1].func, "starts", frozenset())
    return marks


# `make test-long`: what `make test` leaves out, each for its duration (CI's per-file figures, docs/testing.md)
# and for a guarantee the default tier already holds end to end. By node id prefix; the reason beside each.
LONG = (
    # 70 s and 42 s: one full HA check per server shape stays by default (the demo's); these are the others.
    "tests/examples/test_servers.py::test_every_promise_holds_under_the_ha_check[jobs]",
    "tests/examples/test_servers.py::test_every_promise_holds_under_the_ha_check[cart]",
    # 57 s: a balancer killed under load; tests/test_stack.py kills either of two HAProxys by default.
    "tests/mcp_ha/ops/check/test_cli.py::test_a_balancer_killed_under_load_keeps_every_session_on_its_replica",
    # The benchmarks (45 s of set-up alone) and the failover benchmark's scenarios: figures, not guarantees the
    # default tier lacks (adoption after a kill, Sentinel, both HAProxys are held there).
    "tests/tools/test_bench.py",
    "tests/test_failover.py",
    # Timing-sensitive ratios under attack, each bound also tested by test_limits.py and test_session_store.py.
    "tests/test_abuse.py",
    # 64 s: stock clients' streamed calls killed mid-way; the demo's full HA check has every kind of client
    # complete a stream elsewhere, and test_streams.py resumes one on another replica.
    "tests/clients/test_streaming_failover.py",
    # 60 s: installing into a project of its own and a lean HA check there; the wheel's install into a fresh
    # environment, served from outside the checkout, stays by default.
    "tests/test_package.py::test_a_server_in_its_own_project_runs_as_the_stack_and_passes_the_ha_check",
)

# `make test` runs the default tier's other files on parallel workers (pytest-xdist); these compare times
# measured in one run (a cost with and without, a median against a median), so they run after, alone.
SERIAL = (
    "tests/test_scale.py",
    "tests/mcp_ha/test_subscriptions.py",
    "tests/mcp_ha/test_limits.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    wrong = []
    for item in items:
        marks = process_marks(item)
        # A quick test stays in the default tier wherever it lives: it costs nothing there.
        if marks and item.nodeid.startswith(LONG):
            item.add_marker("long")
        if item.nodeid.startswith(SERIAL):
            item.add_marker("serial")
        for name in marks - {m.name for m in item.iter_markers()}:
            item.add_marker(name)
        if not marks:
            item.add_marker("quick")
        elif item.get_closest_marker("quick"):
            wrong.append(f"{item.nodeid}: marked quick but starts {', '.join(sorted(marks))}")
    if wrong:
        raise pytest.UsageError("\n".join(wrong))


@pytest.fixture(autouse=True)
def _quick_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quick test that starts a process anyway (in its body, or by a fixture no hook sees) fails, naming
    the fix: the derived tier stays true."""
    if request.node.get_closest_marker("quick") is None:
        return

    def refuse(popen: subprocess.Popen, command: object, *args: object, **kwargs: object) -> None:
        raise AssertionError(f"{request.node.nodeid} is quick but starts {command!r}: mark it by what it starts")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


def stack_config(state_dir: Path, replicas: int = 3, **options: object) -> StackConfig:
    return StackConfig.on_free_ports(state_dir, replicas=replicas, **options)


@contextlib.contextmanager
def running_stack(state_dir: Path, replicas: int = 3, **options: object) -> Iterator[Stack]:
    """A whole stack of its own on free ports, taken down afterwards however the tests went."""
    s = Stack(stack_config(state_dir, replicas, **options))
    try:
        s.up()
        yield s
    finally:
        s.down()


@pytest.fixture(scope="session")
@starts("redis", "haproxy", "slow")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The whole stack: redis, three replicas and haproxy."""
    with running_stack(tmp_path_factory.mktemp("stack")) as s:
        yield s


@pytest.fixture
def healed_stack(stack: Stack) -> Iterator[Stack]:
    """For tests that stop or pause services: everything is running again afterwards."""
    yield stack
    for name in [svc.name for svc in stack.services()]:
        if stack.state(name) == "paused":
            stack.stop(name)
        stack.start(name)
    stack.wait_healthy("haproxy")


# A replica's lease (Runs' ttl_seconds): how long after its last renewal a killed replica is taken for gone.
LEASE_SECONDS: float = Runs.__init__.__kwdefaults__["ttl_seconds"]


def rerun_bound(*, work_seconds: float, reconnect_seconds: float = 0.0) -> float:
    """How soon after a kill -9 of its replica a streamed call is answered from another one, for
    tests/mcp_ha/test_streams.py and tests/clients/test_streaming_failover.py: real-time waits no load
    stretches (the client's own wait before it resumes, alongside the dead replica's lease lapsing, then a
    runner check) plus `work_seconds`, the work left, timed in the same run (the call's start and its items
    before the kill, scaled), and half that again for the resume's own requests: load stretches the re-run
    as it stretched what was timed."""
    return max(reconnect_seconds, LEASE_SECONDS) + RUNNER_CHECK_SECONDS + 1.5 * work_seconds


@pytest.fixture(scope="session")
@starts("redis", "haproxy", "slow")
def sentinel_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Redis with Sentinel (redis-1 primary at start, redis-2, sentinel-1..3), two replicas that wait
    for a Redis replica's acknowledgement of every write, and haproxy."""
    with running_stack(
        tmp_path_factory.mktemp("sentinel"), replicas=2, redis_mode="sentinel", redis_wait_replicas=1
    ) as s:
        yield s


@pytest.fixture(scope="session")
@starts("redis", "haproxy", "slow")
def limited_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One replica behind an HAProxy with a low rate limit (40 requests per 10 s) and two allowed Origins."""
    with running_stack(
        tmp_path_factory.mktemp("limited"),
        replicas=1,
        rate_limit=40,
        allowed_origins="http://app.example https://other.example:8443",
    ) as s:
        yield s


@pytest.fixture(scope="session")
@starts("redis")
def redis_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A lone redis-server, for the store's own tests."""
    s = Stack(stack_config(tmp_path_factory.mktemp("redis"), replicas=1))
    try:
        s.start("redis")
        yield s
    finally:
        s.down()


@contextlib.contextmanager
def running_cluster(state_dir: Path) -> Iterator[Stack]:
    """A Redis Cluster alone (redis-1..6: three primaries, a replica each), with the kit's functions, taken
    down afterwards however the tests went."""
    s = Stack(stack_config(state_dir, replicas=1, redis_mode="cluster"))
    try:
        for name in s.config.redis_names():
            s.start(name, wait=False)
        for name in s.config.redis_names():
            s.wait_healthy(name)
        s.create_cluster()
        yield s
    finally:
        s.down()


@pytest.fixture(scope="session")
@starts("redis", "slow")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A Redis Cluster the tests share; one that stops its nodes takes `own_cluster`."""
    with running_cluster(tmp_path_factory.mktemp("cluster")) as s:
        yield s


@pytest.fixture
@starts("redis", "slow")
def own_cluster(tmp_path: Path) -> Iterator[Stack]:
    """A Redis Cluster of the test's own, which it may stop nodes of."""
    with running_cluster(tmp_path / "cluster") as s:
        yield s


def slot_owner(cluster: Stack, slot: int) -> str:
    """The primary serving `slot`, as it says itself."""
    for name in cluster.cluster_primaries():
        nodes = str(cluster.redis_command(name, "CLUSTER", "NODES"))
        served = next(line for line in nodes.splitlines() if "myself" in line).split()[8:]
        if any(int(r.split("-")[0]) <= slot <= int(r.split("-")[-1]) for r in served if not r.startswith("[")):
            return name
    raise AssertionError(f"no primary serves slot {slot}")


def move_slot(cluster: Stack, slot: int, source: str, target: str) -> None:
    """Move one slot, keys and all, from primary `source` to `target`: the admin's commands, in the order
    redis-cli --cluster reshard sends them."""
    ids = {name: str(cluster.redis_command(name, "CLUSTER", "MYID")) for name in (source, target)}
    assert cluster.redis_command(target, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", ids[source]) == "OK"
    assert cluster.redis_command(source, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", ids[target]) == "OK"
    port, password = str(cluster.service(target).port), cluster.config.redis_admin_password
    for _ in range(100):  # bounded: 100 keys a round
        keys = cluster.redis_command(source, "CLUSTER", "GETKEYSINSLOT", str(slot), "100")
        assert isinstance(keys, list), keys
        if not keys:
            break
        moved = cluster.redis_command(
            source, "MIGRATE", cluster.config.host, port, "", "0", "5000", "AUTH2", "default", password, "KEYS", *keys
        )
        assert moved == "OK", moved
    for name in (target, source):
        assert cluster.redis_command(name, "CLUSTER", "SETSLOT", str(slot), "NODE", ids[target]) == "OK"


class ReplicaEnvStack(Stack):
    """A Stack whose replicas get `replica_env` on top of what stack.py gives them: bounds set low for a test."""

    def __init__(self, config: StackConfig, replica_env: dict[str, str]) -> None:
        super().__init__(config)
        self.replica_env = replica_env

    def services(self) -> list[Service]:
        names = set(self.config.replica_names())
        return [
            replace(svc, env={**svc.env, **self.replica_env}) if svc.name in names else svc
            for svc in super().services()
        ]


# The bounds tests/test_abuse.py's stack runs with where the defaults would take minutes to reach.
ABUSE_BOUNDS = {
    "MAX_SESSIONS_PER_CLIENT": "50",
    "SESSION_IDLE_SECONDS": "2",
    "MAX_REPLAYS": "24",
    # Above what the notes-until-Redis-is-full test writes (Redis refuses first there), below 50 x 256 KiB.
    "MAX_CLIENT_BYTES": str(8 << 20),
    # Each write through HAProxy keeps an op record (charged ~260 B) this long, counted in its client's bytes:
    # the bystander's ~100 writes a second would pass MAX_CLIENT_BYTES within the module at the default 600.
    "OP_TTL_SECONDS": "60",
    "MAX_CALLS_PER_CLIENT": "16",
    # Past those, refused at once: the attacks measure the bounds themselves (test_limits.py tests the queue).
    "CALL_QUEUE_SECONDS": "0",
    # Shares as large as the bounds: what one client may have is what they say (TestOneClientCannotStarveAnother
    # tests the share, at its default).
    "FAIR_SHARE_CALLS": "1024",
    "MAX_LISTEN_STREAMS_PER_CLIENT": "16",
    "ABANDONED_CALL_SECONDS": "2",
}
# Its principals (static tokens): the bystander, and one per kind of attacker.
ABUSE_PRINCIPALS = (
    "bystander",
    "attacker",
    "flooder",
    "other",
    "idler",
    "replayer",
    "filler",
    "h2c",
    "caller",
    "rereader",
    "poller",
    "listener",
    "writer",
    "opener",
    "gateway",
    "tasker",
    "hog",
)


@pytest.fixture(scope="module")
def abuse_tokens() -> dict[str, str]:
    return {name: secrets.token_urlsafe(24) for name in ABUSE_PRINCIPALS}


@pytest.fixture(scope="module")
@starts("redis", "haproxy", "slow")
def abuse_stack(tmp_path_factory: pytest.TempPathFactory, abuse_tokens: dict[str, str]) -> Iterator[Stack]:
    """Redis, two replicas and HAProxy for the abuse suite: static-token authentication for ABUSE_PRINCIPALS,
    and the replicas started with ABUSE_BOUNDS."""
    tokens = ",".join(f"{name}:{token}" for name, token in abuse_tokens.items())
    config = stack_config(
        tmp_path_factory.mktemp("abuse"), replicas=2, auth={"MCP_AUTH": "static", "MCP_AUTH_TOKENS": tokens}
    )
    s = ReplicaEnvStack(config, ABUSE_BOUNDS)
    try:
        s.up()
        yield s
    finally:
        s.down()


@dataclass
class Replica:
    """One replica process started by `replica_on` (no balancer in front): where it serves, and its process."""

    url: str
    port: int
    proc: subprocess.Popen
    log: Path


@contextlib.contextmanager
def replica_on(redis: Stack, tmp_path: Path, name: str, *, module: str = "server", **env: str) -> Iterator[Replica]:
    """`python -m <module>` against the Redis of `redis`, on a free port, with `env` on top; stopped afterwards.

    For tests that choose which replica serves what themselves, or give replicas different settings.
    """
    (port,) = free_ports(1)
    full_env = {
        **os.environ,
        "INSTANCE_ID": name,
        "HOST": "127.0.0.1",
        "PORT": str(port),
        "METRICS": "off",
        "REDIS_URL": redis.config.redis_url,
        "REDIS_USERNAME": redis.config.redis_user,
        "REDIS_PASSWORD": redis.config.redis_password,
        "LOG_FORMAT": "text",
        **env,
    }
    log_path = tmp_path / f"{name}-{port}.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", module], cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        yield Replica(f"http://127.0.0.1:{port}/mcp", port, proc, log_path)
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def two_replicas(
    redis: Stack, tmp_path: Path, *, module: str = "server", **env: str
) -> Iterator[tuple[Replica, Replica]]:
    """`replica_on` twice, mcp-server-1 and -2, sharing one request-state key ring as every deployment gives them."""
    env = {"REQUEST_STATE_KEYS": secrets.token_hex(32), **env}
    with (
        replica_on(redis, tmp_path, "mcp-server-1", module=module, **env) as one,
        replica_on(redis, tmp_path, "mcp-server-2", module=module, **env) as two,
    ):
        yield one, two


@pytest.fixture
def mcp_url(stack: Stack) -> str:
    return stack.config.mcp_url


# Makes a FastMCP client in session (2025-11-25) mode, through HAProxy, with the `bearer` token.
Connect = Callable[..., Client]


@pytest.fixture
def bearer() -> str | None:
    """The token clients send; none here. tests/mcp_ha/test_auth.py overrides it, with `stack`."""
    return None


@pytest.fixture
def connect(mcp_url: str, bearer: str | None) -> Connect:
    def connect(**options: object) -> Client:
        return Client(mcp_url, mode="legacy", auth=bearer, **options)

    return connect


@pytest.fixture
async def client(connect: Connect) -> AsyncIterator[Client]:
    """A FastMCP client in session (2025-11-25) mode, through HAProxy."""
    async with connect(timeout=30) as c:
        yield c


@pytest.fixture
async def http() -> AsyncIterator[httpx2.AsyncClient]:
    async with httpx2.AsyncClient(timeout=30, limits=httpx2.Limits(max_connections=300)) as c:
        yield c


@pytest.fixture
async def raw(http: httpx2.AsyncClient, mcp_url: str) -> RawSession:
    """An initialized session over plain HTTP, through HAProxy."""
    session = RawSession(http, mcp_url)
    await session.initialize()
    return session


@pytest.fixture(scope="session")
def auth_tokens() -> dict[str, str]:
    """Two principals' static tokens, fresh for each test run."""
    return {name: secrets.token_urlsafe(24) for name in ("alice", "bob")}


@pytest.fixture(scope="session")
@starts("redis", "haproxy", "slow")
def auth_stack(tmp_path_factory: pytest.TempPathFactory, auth_tokens: dict[str, str]) -> Iterator[Stack]:
    """The whole stack with static-token authentication on (`mcp_ha/auth.py`): principals alice and bob."""
    tokens = ",".join(f"{name}:{token}" for name, token in auth_tokens.items())
    with running_stack(tmp_path_factory.mktemp("auth"), auth={"MCP_AUTH": "static", "MCP_AUTH_TOKENS": tokens}) as s:
        yield s


JWT_KID = "tests-key"


@pytest.fixture(scope="session")
def jwt_keys() -> RSAKeyPair:
    return RSAKeyPair.generate()


@pytest.fixture(scope="session")
def jwks_url(jwt_keys: RSAKeyPair) -> Iterator[str]:
    """A JWKS endpoint publishing `jwt_keys`' public key, on a free loopback port, in a thread of the tests."""
    key = json.loads(RSAAlgorithm.to_jwk(load_pem_public_key(jwt_keys.public_key.encode())))
    body = json.dumps({"keys": [{**key, "kid": JWT_KID, "use": "sig", "alg": "RS256"}]}).encode()

    class JWKS(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/jwks.json" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    (port,) = free_ports(1)
    server = ThreadingHTTPServer(("127.0.0.1", port), JWKS)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/jwks.json"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


JWT_ISSUER, JWT_AUDIENCE = "https://issuer.tests.invalid", "mcp-ha-kit-tests"


@pytest.fixture(scope="session")
@starts("redis", "haproxy", "slow")
def jwt_stack(tmp_path_factory: pytest.TempPathFactory, jwks_url: str) -> Iterator[Stack]:
    """One replica and HAProxy, verifying JWTs against `jwks_url` for JWT_ISSUER and JWT_AUDIENCE."""
    settings = {
        "MCP_AUTH": "jwt",
        "MCP_AUTH_JWKS_URL": jwks_url,
        "MCP_AUTH_ISSUER": JWT_ISSUER,
        "MCP_AUTH_AUDIENCE": JWT_AUDIENCE,
    }
    with running_stack(tmp_path_factory.mktemp("jwt"), replicas=1, auth=settings) as s:
        yield s


class _RecordHeaders(BaseHTTPRequestHandler):
    """Answers 200 to everything (HAProxy's health checks included), keeping each request's path and headers."""

    seen: list[dict[str, str]]

    def do_GET(self) -> None:
        self.seen.append({":path": self.path, **{k.lower(): v for k, v in self.headers.items()}})
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
@starts("haproxy")
def header_probe(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], list]]:
    """The stack's haproxy.cfg and TLS certificate in front of a server that records what reaches it:
    (HAProxy's addresses, each request that reached the server: its path as ":path", its headers)."""
    handler = type("Recorder", (_RecordHeaders,), {"seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    http_port, https_port, stats_port = free_ports(3)
    env = {
        **stack.service("haproxy").env,
        "HAPROXY_BIND": f"127.0.0.1:{http_port}",
        "HAPROXY_TLS_BIND": f"127.0.0.1:{https_port}",
        "HAPROXY_STATS_BIND": f"127.0.0.1:{stats_port}",
    }
    env = {k: v for k, v in env.items() if not k.startswith("MCP_SERVER_")}
    env["MCP_SERVER_1"] = f"127.0.0.1:{server.server_address[1]}"
    log = open(tmp_path_factory.mktemp("header-probe") / "haproxy.log", "wb")
    proc = subprocess.Popen(
        ["haproxy", "-db", "-f", str(ROOT / "haproxy" / "haproxy.cfg")],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # Up once HAProxy has seen two good checks (rise 2, 0.5 s apart).
        deadline = time.monotonic() + 15
        while len(handler.seen) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        time.sleep(0.3)
        assert proc.poll() is None and len(handler.seen) >= 2, "haproxy did not start or check the probe"
        yield {"http": f"http://127.0.0.1:{http_port}", "https": f"https://127.0.0.1:{https_port}"}, handler.seen
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
        server.shutdown()
        server.server_close()


def stack_ports(replicas: int) -> dict[str, str]:
    """Environment variables that put the stack `up` starts on free ports; the replicas' are consecutive."""
    for _ in range(50):
        http, https, stats, redis, base = free_ports(5)
        replica_ports = set(range(base, base + replicas))
        others = {http, https, stats, redis}
        if not replica_ports & others and all(port_is_free("127.0.0.1", port) for port in replica_ports):
            return {
                "MCP_HTTP_PORT": str(http),
                "MCP_HTTPS_PORT": str(https),
                "MCP_STATS_PORT": str(stats),
                "REDIS_PORT": str(redis),
                "MCP_BASE_PORT": str(base),
                "MCP_REPLICAS": str(replicas),
                # One HAProxy: a second needs free ports of its own, and these tests are not about the pair.
                "MCP_BALANCERS": "1",
                "MCP_PEER_BASE_PORT": str(free_ports(1)[0]),
            }
    raise AssertionError("no run of free ports for the replicas")


def scrubbed(**env: str) -> dict[str, str]:
    """Another shell's environment: none of the user's variables, no PYTHONPATH."""
    return {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"), **env}


# The bounds tests/mcp_ha/test_tasks.py's stack runs with, low enough to reach.
TASK_BOUNDS = {"MAX_TASKS_PER_CLIENT": "3", "MAX_TASK_RESULT_BYTES": "4096", "TASK_TTL_SECONDS": "120"}


@pytest.fixture(scope="module")
@starts("redis", "haproxy", "slow")
def tasks_stack(tmp_path_factory: pytest.TempPathFactory, auth_tokens: dict[str, str]) -> Iterator[Stack]:
    """Redis, two replicas of tests/mcp_ha/tasks_server.py and HAProxy, for durable tasks: static-token
    authentication for alice and bob, TASK_BOUNDS, and each task body's start and end logged to the stack
    dir's runs.log."""
    state_dir = tmp_path_factory.mktemp("tasks")
    tokens = ",".join(f"{name}:{token}" for name, token in auth_tokens.items())
    config = stack_config(
        state_dir,
        replicas=2,
        server="tests.mcp_ha.tasks_server",
        auth={"MCP_AUTH": "static", "MCP_AUTH_TOKENS": tokens},
    )
    s = ReplicaEnvStack(config, {**TASK_BOUNDS, "RUNS_LOG": str(state_dir / "runs.log")})
    try:
        s.up()
        yield s
    finally:
        s.down()
