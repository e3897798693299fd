"""docker-compose.yaml run for real: the contract and failover, against its containers.

`make test-docker` (.ci/docker-stage) starts the stack with
`docker-compose -f docker-compose.yaml -f docker-compose.ci.yaml` (locally
built images, host networking on loopback ports) and runs this file with the
stack's endpoints in the environment; anywhere else (`make test`) it is
skipped. Here:

- the contract's tests (`tests/test_server.py`), collected again against the
  compose stack's HAProxy (as `tests/test_auth.py` does for its stack);
- Redis as the compose file's command sets it up: no access without a
  password, the replicas' user limited to its commands and keys;
- a session keeps its state, and its id, through `docker compose stop` of the
  replica it is pinned to (another replica adopts it), through a rolling
  `docker compose restart` of every replica under a caller that never stops,
  and through `docker compose restart` of all three at once; every call
  carries an idempotency key and is retried with it until acknowledged, and
  the counter ends at exactly the number of calls: none applied twice.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import time
import uuid
from dataclasses import dataclass

import httpx2
import pytest
from conftest import starts
from test_server import *  # noqa: F403 (the contract's tests, collected here again: against the containers)

from mcp_ha.idempotency import IDEMPOTENCY_KEY
from mcp_ha.ops.check.wire import RawSession, last_jsonrpc_message
from mcp_ha.ops.stack import redis_command

COMPOSE = shlex.split(os.environ.get("MCP_DOCKER_COMPOSE", ""))
pytestmark = [
    pytest.mark.skipif(
        not COMPOSE, reason="no compose stack: `make test-docker` runs these (it sets MCP_DOCKER_COMPOSE and the ports)"
    ),
    pytest.mark.docker,
]
REPLICA_NAMES = ["mcp-server-1", "mcp-server-2", "mcp-server-3"]
BALANCER_NAMES = ["haproxy", "haproxy-2"]


@dataclass
class ComposeConfig:
    """What the contract's tests ask of `stack.config`, for the compose stack."""

    http_port: int
    stats_port: int
    redis_port: int
    replica_ports: tuple[int, ...]
    host: str = "127.0.0.1"

    @property
    def mcp_url(self) -> str:
        return f"http://{self.host}:{self.http_port}/mcp"

    def replica_names(self) -> list[str]:
        return REPLICA_NAMES[: len(self.replica_ports)]


class ComposeStack:
    """The running compose project: `docker compose` commands, container health, HAProxy's view."""

    def __init__(self) -> None:
        self.config = ComposeConfig(
            http_port=int(os.environ["MCP_DOCKER_HTTP_PORT"]),
            stats_port=int(os.environ["MCP_DOCKER_STATS_PORT"]),
            redis_port=int(os.environ["MCP_DOCKER_REDIS_PORT"]),
            replica_ports=tuple(int(p) for p in os.environ["MCP_DOCKER_REPLICA_PORTS"].split(",")),
        )

    def compose(self, *args: str, timeout: float = 120) -> str:
        done = subprocess.run([*COMPOSE, *args], capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"docker-compose {' '.join(args)}: exit {done.returncode}\n{done.stderr}"
        return done.stdout

    def health(self, service: str) -> str:
        container = self.compose("ps", "-q", service).strip()
        if not container:
            return "missing"
        done = subprocess.run(
            [
                "docker",
                "inspect",
                "-f",
                '{{if ne .State.Status "running"}}{{.State.Status}}'
                "{{else if .State.Health}}{{.State.Health.Status}}{{else}}running{{end}}",
                container,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return done.stdout.strip() or "gone"

    def haproxy_states(self) -> dict[str, str]:
        """Each replica's status in HAProxy's stats CSV (UP, DOWN, MAINT, ...)."""
        response = httpx2.get(
            f"http://127.0.0.1:{self.config.stats_port}/stats;csv",
            auth=("stats", os.environ["HAPROXY_STATS_PASSWORD"]),
            timeout=5,
        )
        response.raise_for_status()
        lines = response.text.lstrip("# ").splitlines()
        header = lines[0].split(",")
        # Not strict: a quoted value holding a comma splits into more fields; the columns read here come first.
        rows = [dict(zip(header, line.split(","), strict=False)) for line in lines[1:] if line]
        return {r["svname"]: r["status"] for r in rows if r["pxname"] == "mcp_servers" and r["svname"] in REPLICA_NAMES}

    def wait_in_service(self, *services: str, timeout: float = 90) -> None:
        """Each service's container healthy and HAProxy sending it traffic (UP)."""
        deadline = time.monotonic() + timeout
        while True:
            health = {s: self.health(s) for s in services}
            try:
                states = self.haproxy_states()
            except httpx2.HTTPError as e:
                states = {"stats": repr(e)}
            if all(h == "healthy" for h in health.values()) and all(states.get(s) == "UP" for s in services):
                return
            assert time.monotonic() < deadline, f"not back in service within {timeout} s: {health}, HAProxy: {states}"
            time.sleep(0.5)


@pytest.fixture(scope="session")
@starts("docker")
def compose_stack() -> ComposeStack:
    return ComposeStack()


@pytest.fixture
def stack(compose_stack: ComposeStack) -> ComposeStack:
    """For the contract's tests (`mcp_url`, `test_health_names_the_replica`): the compose stack."""
    return compose_stack


@pytest.fixture
def healed(compose_stack: ComposeStack):
    """For the tests that stop replicas: every replica running and in service afterwards."""
    yield compose_stack
    compose_stack.compose("start", *REPLICA_NAMES)
    compose_stack.wait_in_service(*REPLICA_NAMES)


def test_haproxy_knows_every_replica_up(compose_stack: ComposeStack) -> None:
    assert compose_stack.haproxy_states() == {name: "UP" for name in REPLICA_NAMES}


def test_redis_wants_a_password_and_limits_the_kits_user(compose_stack: ComposeStack) -> None:
    def reply(*words: str, **auth: str) -> object:
        return redis_command(compose_stack.config.host, compose_stack.config.redis_port, *words, **auth)

    assert str(reply("PING")).startswith("NOAUTH")
    kit = {"user": "mcp", "password": os.environ["REDIS_PASSWORD"]}
    assert reply("PING", **kit) == "PONG"
    assert str(reply("KEYS", "*", **kit)).startswith("NOPERM")
    assert str(reply("SET", "not-mcp", "x", **kit)).startswith("NOPERM")
    assert reply("CONFIG", "GET", "appendonly", password=os.environ["REDIS_ADMIN_PASSWORD"]) == ["appendonly", "yes"]


class Caller:
    """Increments on one session through HAProxy, each with its own idempotency key, retried with the same key
    until acknowledged (as ResilientClient does): the counter must end at exactly the number of calls."""

    def __init__(self, http: httpx2.AsyncClient, url: str) -> None:
        self.session = RawSession(http, url)
        self.calls = 0
        self.retries = 0
        self.instances: list[str] = []

    async def increment(self, deadline_s: float = 30) -> dict:
        key = uuid.uuid4().hex
        params = {"name": "increment_counter", "arguments": {}, "_meta": {IDEMPOTENCY_KEY: key}}
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                response = await self.session.post("tools/call", params)
                if response.status_code == 200:
                    message = last_jsonrpc_message(response)
                    result = message.get("result") or {}
                    if result and not result.get("isError"):
                        self.calls += 1
                        answer = result["structuredContent"]
                        self.instances.append(answer["instance"])
                        return answer
                problem = (response.status_code, response.text[:200])
            except httpx2.HTTPError as e:
                problem = repr(e)
            assert time.monotonic() < deadline, f"call not acknowledged within {deadline_s} s: {problem}"
            self.retries += 1
            await asyncio.sleep(0.2)


@pytest.fixture
def both_haproxys(compose_stack: ComposeStack):
    """For the tests that kill an HAProxy: both running again afterwards."""
    yield compose_stack
    compose_stack.compose("start", *BALANCER_NAMES)
    compose_stack.wait_in_service(*REPLICA_NAMES)


async def test_every_session_keeps_its_replica_through_a_kill_of_either_haproxy(
    compose_stack: ComposeStack, both_haproxys
) -> None:
    """The two HAProxys share one port and their session table: with either one killed (SIGKILL), every
    session's next calls reach the replica it was on, over new connections to the one left."""
    clients = [httpx2.AsyncClient(timeout=30) for _ in range(8)]
    try:
        callers = [Caller(http, compose_stack.config.mcp_url) for http in clients]
        for caller in callers:
            await caller.session.initialize()
            await caller.increment()
        replicas = [caller.instances[-1] for caller in callers]
        assert len(set(replicas)) >= 2, replicas
        for balancer in BALANCER_NAMES:
            await asyncio.to_thread(compose_stack.compose, "kill", "-s", "SIGKILL", balancer)
            for caller in callers:
                await caller.increment()
            assert [caller.instances[-1] for caller in callers] == replicas, f"after killing {balancer}"
            await asyncio.to_thread(compose_stack.compose, "start", balancer)
            await asyncio.to_thread(compose_stack.wait_in_service, *REPLICA_NAMES)
        for caller in callers:
            assert (await caller.session.call("get_counter"))["counter"] == caller.calls == 3
    finally:
        for http in clients:
            await http.aclose()


async def test_session_survives_docker_compose_stop_of_its_replica(
    compose_stack: ComposeStack, healed, http: httpx2.AsyncClient
) -> None:
    caller = Caller(http, compose_stack.config.mcp_url)
    await caller.session.initialize()
    for expected in (1, 2, 3):
        answer = await caller.increment()
        assert answer["counter"] == expected
    pinned = answer["instance"]
    await asyncio.to_thread(compose_stack.compose, "stop", pinned)
    assert compose_stack.health(pinned) in ("exited", "missing", "gone")
    for expected in (4, 5, 6):
        answer = await caller.increment()
        assert answer["counter"] == expected, "the session's state carried over"
        assert answer["instance"] != pinned
    # The same session id all along (a 404 would have failed a call), its state in Redis.
    assert (await caller.session.call("get_counter"))["counter"] == caller.calls == 6


# Three restarts one after the other, each bounded by its own waits (a drain, a start, HAProxy's
# check): on a loaded machine they need more than the suite's 120 s together.
@pytest.mark.timeout(400)
async def test_session_survives_a_rolling_docker_compose_restart(
    compose_stack: ComposeStack, healed, http: httpx2.AsyncClient
) -> None:
    caller = Caller(http, compose_stack.config.mcp_url)
    await caller.session.initialize()
    await caller.increment()
    stop = asyncio.Event()

    async def keep_calling() -> None:
        while not stop.is_set():
            await caller.increment()
            await asyncio.sleep(0.05)

    load = asyncio.create_task(keep_calling())
    try:
        for name in REPLICA_NAMES:
            await asyncio.to_thread(compose_stack.compose, "restart", name)
            await asyncio.to_thread(compose_stack.wait_in_service, name)
            assert not load.done(), load.exception()
    finally:
        stop.set()
        await load
    final = (await caller.session.call("get_counter"))["counter"]
    assert final == caller.calls, f"{caller.calls} calls acknowledged, counter {final}"
    assert caller.calls >= 10
    # Served by more than one replica: the session moved as its replica restarted.
    assert len(set(caller.instances)) >= 2, caller.instances


async def test_session_survives_docker_compose_restart_of_every_replica_at_once(
    compose_stack: ComposeStack, healed, http: httpx2.AsyncClient
) -> None:
    caller = Caller(http, compose_stack.config.mcp_url)
    await caller.session.initialize()
    for _ in range(3):
        await caller.increment()
    await asyncio.to_thread(compose_stack.compose, "restart", *REPLICA_NAMES)
    # While they start, HAProxy has nothing to send to: the caller retries (same key) until one answers.
    answer = await caller.increment(deadline_s=60)
    assert answer["counter"] == 4
    await asyncio.to_thread(compose_stack.wait_in_service, *REPLICA_NAMES)
    assert (await caller.session.call("get_counter"))["counter"] == caller.calls == 4
