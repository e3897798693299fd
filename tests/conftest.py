"""Every fixture that starts a process lives here.

The stacks are real: redis-server, haproxy and `python server.py` replicas,
started by the same `Stack` class as `python stack.py`, on free loopback
ports, in a temporary directory. Nothing is faked.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx2
import pytest
from fastmcp import Client

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mcp_http import RawSession  # noqa: E402
from stack import Stack, StackConfig, free_ports  # noqa: E402,F401 (free_ports: for the tests)


# How many inputs of each class tests/test_hostile_input.py sent, printed after the run.
HOSTILE_INPUTS: Counter[str] = Counter()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if HOSTILE_INPUTS:
        terminalreporter.section("hostile inputs tried, by class")
        for kind, count in sorted(HOSTILE_INPUTS.items()):
            terminalreporter.write_line(f"{count:>6}  {kind}")
        terminalreporter.write_line(f"{sum(HOSTILE_INPUTS.values()):>6}  in all")


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


@pytest.fixture(scope="session")
def sentinel_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Redis with Sentinel (redis-1 primary at start, redis-2, sentinel-1..3), two replicas that wait
    for a Redis replica's acknowledgement of every write, and haproxy."""
    with running_stack(tmp_path_factory.mktemp("sentinel"), replicas=2, redis_mode="sentinel",
                       redis_wait_replicas=1) as s:
        yield s


@pytest.fixture(scope="session")
def limited_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One replica behind an HAProxy with a low rate limit (40 requests per 10 s) and two allowed Origins."""
    with running_stack(tmp_path_factory.mktemp("limited"), replicas=1, rate_limit=40,
                       allowed_origins="http://app.example https://other.example:8443") as s:
        yield s


@pytest.fixture(scope="session")
def redis_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A lone redis-server, for the store's own tests."""
    s = Stack(stack_config(tmp_path_factory.mktemp("redis"), replicas=1))
    try:
        s.start("redis")
        yield s
    finally:
        s.down()


@pytest.fixture
def mcp_url(stack: Stack) -> str:
    return stack.config.mcp_url


@pytest.fixture
async def client(mcp_url: str) -> AsyncIterator[Client]:
    """A FastMCP client in session (2025-11-25) mode, through HAProxy."""
    async with Client(mcp_url, mode="legacy", timeout=30) as c:
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
