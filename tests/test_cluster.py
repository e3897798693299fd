"""The whole stack on a Redis Cluster (`--redis cluster`: three primaries, a replica each), under faults.

The replicas reach the cluster by REDIS_CLUSTER_NODES and wait for a Redis replica's acknowledgement of
every write (REDIS_WAIT_REPLICAS=1). The failover benchmark's clients (mcp_ha/check) run under load while
a primary is killed (its replica is promoted) and while slots move between primaries.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx2
import pytest
from conftest import running_stack

from mcp_ha.check.wire import RawSession
from mcp_ha.stack import Stack
from tools import failover_bench as bench

SESSIONS = 5
DURATION = 4.0


@pytest.fixture(scope="module")
def cluster_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(
        tmp_path_factory.mktemp("cluster-stack"), redis_mode="cluster", redis_wait_replicas=1, balancers=2
    ) as s:
        yield s


def keys_per_primary(stack: Stack, pattern: str) -> dict[str, int]:
    return {
        name: len(stack.redis_command(name, "KEYS", pattern) or [])  # type: ignore[arg-type]
        for name in stack.cluster_primaries()
    }


async def test_sessions_spread_over_every_primary(cluster_stack: Stack) -> None:
    primaries = cluster_stack.cluster_primaries()
    assert len(primaries) == 3 and sum(primaries.values()) == bench.CLUSTER_SLOTS, primaries
    async with httpx2.AsyncClient(timeout=10) as http:
        sessions = [RawSession(http, cluster_stack.config.mcp_url) for _ in range(24)]
        for session in sessions:
            await session.initialize()
            assert (await session.call("increment_counter"))["counter"] == 1
        for session in sessions:
            assert (await session.call("increment_counter"))["counter"] == 2
    held = keys_per_primary(cluster_stack, "mcp:session:*")
    assert sum(held.values()) >= 24 and all(held.values()), held


@pytest.mark.timeout(180)
async def test_kill_9_of_a_primary_under_load_loses_no_acknowledged_increment(cluster_stack: Stack) -> None:
    """The cluster promotes the primary's replica; every write waited for it (REDIS_WAIT_REPLICAS=1)."""
    report = await bench.run_scenario(cluster_stack, "redis-kill", sessions=SESSIONS, duration=DURATION)
    assert bench.check_targets(report) == []
    for c in report.clients:
        assert (c.lost, c.duplicated, c.unreadable) == (0, 0, 0), c
    assert report.resilient.failed == 0
    await asyncio.to_thread(cluster_stack.wait_healthy, "haproxy")


@pytest.mark.timeout(300)
async def test_moving_slots_under_load_fails_no_call(cluster_stack: Stack) -> None:
    report = await bench.run_scenario(cluster_stack, "redis-move", sessions=SESSIONS, duration=DURATION)
    assert bench.check_targets(report) == []
    for c in report.clients:
        assert (c.failed, c.lost, c.duplicated) == (0, 0, 0), (c.kind, c.errors)
