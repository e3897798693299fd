"""The whole stack on a Redis Cluster (`--redis cluster`: three primaries, a replica each), under faults.

The replicas reach the cluster by REDIS_CLUSTER_NODES and wait for a Redis replica's acknowledgement of
every write (REDIS_WAIT_REPLICAS=1). The failover benchmark's clients (mcp_ha/ops/check) run under load while
a primary is killed (its replica is promoted) and while slots move between primaries.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from conftest import free_ports, running_stack, starts

from mcp_ha.ops.check.wire import RawSession
from mcp_ha.ops.stack import Stack, redis_command
from mcp_ha.stores.redis_store import CLUSTER_LIBRARY
from tools import failover_bench as bench

SESSIONS = 5
DURATION = 4.0


@pytest.fixture(scope="module")
@starts("redis", "haproxy", "slow")
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
    """The cluster promotes the primary's replica; every write waited for it (REDIS_WAIT_REPLICAS=1), so no
    acknowledged increment is lost or applied twice. The promotion takes 2.4 to 2.8 s here
    (cluster-node-timeout 1 s, then an election), inside a plain client's own timeout (5 s): no call fails.
    The stock SDK clients, which the bench drives with --stock, are measured in the failover benchmark."""
    report = await bench.run_scenario(cluster_stack, "redis-kill", sessions=SESSIONS, duration=DURATION)
    for c in report.clients:
        assert (c.failed, c.lost, c.duplicated, c.unreadable) == (0, 0, 0, 0), (c.kind, c.errors)
    await asyncio.to_thread(cluster_stack.wait_healthy, "haproxy")


@pytest.mark.timeout(300)
async def test_moving_slots_under_load_fails_no_call(cluster_stack: Stack) -> None:
    report = await bench.run_scenario(cluster_stack, "redis-move", sessions=SESSIONS, duration=DURATION)
    assert bench.check_targets(report) == []
    for c in report.clients:
        assert (c.failed, c.lost, c.duplicated) == (0, 0, 0), (c.kind, c.errors)


def start_like_redis_1(stack: Stack, directory: Path) -> tuple[subprocess.Popen, int]:
    """A new cluster node, configured as redis-1 is (its users, cluster mode) on free ports, in
    `directory`: a node the cluster does not know yet."""
    port, bus = free_ports(2)
    _, text = stack.service("redis-1").config_file  # type: ignore[misc]
    text = re.sub(r"(?m)^port \d+$", f"port {port}", text)
    text = re.sub(r"(?m)^cluster-port \d+$", f"cluster-port {bus}", text)
    text = re.sub(r"(?m)^dir .*$", f"dir {directory}", text)
    (directory / "redis.conf").write_text(text)
    node = subprocess.Popen(
        ["redis-server", str(directory / "redis.conf")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return node, port


@pytest.mark.timeout(300)
async def test_a_primary_added_later_serves_sessions_without_a_replica_restart(
    cluster_stack: Stack, tmp_path: Path
) -> None:
    """A seventh node and its replica, added the standard way (redis-cli --cluster add-node, which copies
    the kit's functions to it) and given a share of the slots with their keys: the replicas follow the slot map
    as they run, and every session's state is whole, on the new primary too."""
    c = cluster_stack.config
    pids = {name: cluster_stack.pid(name) for name in c.replica_names()}
    (tmp_path / "primary").mkdir()
    (tmp_path / "replica").mkdir()
    node, port = await asyncio.to_thread(start_like_redis_1, cluster_stack, tmp_path / "primary")
    # Its replica too: the replicas wait for one to have each write (REDIS_WAIT_REPLICAS=1).
    second, second_port = await asyncio.to_thread(start_like_redis_1, cluster_stack, tmp_path / "replica")
    first = f"{c.host}:{c.cluster_ports[0]}"

    def cli(*words: str) -> str:
        done = subprocess.run(
            ["redis-cli", "--cluster", *words], env=c.redis_cli_env, capture_output=True, text=True, timeout=240
        )
        assert done.returncode == 0, (done.stdout[-1500:], done.stderr[-1500:])
        return done.stdout

    def ask(*words: str, at: int = port) -> object:
        return redis_command(c.host, at, *words, password=c.redis_admin_password)

    try:
        wait = time.monotonic() + 10
        while ask("PING") != "PONG" or ask("PING", at=second_port) != "PONG":
            assert time.monotonic() < wait, "the new nodes never answered"
            await asyncio.sleep(0.1)
        async with httpx2.AsyncClient(timeout=10) as http:
            sessions = [RawSession(http, c.mcp_url) for _ in range(64)]
            for session in sessions:
                await session.initialize()
                assert (await session.call("increment_counter"))["counter"] == 1
            await asyncio.to_thread(cli, "add-node", f"{c.host}:{port}", first)
            assert CLUSTER_LIBRARY in str(ask("FUNCTION", "LIST")), "the kit's functions were not copied"
            new_id = str(ask("CLUSTER", "MYID"))
            # Known to every node by gossip, and knowing the slots served (a second or so), before slots
            # can be given to it.
            wait = time.monotonic() + 20
            while "cluster_state:ok" not in str(ask("CLUSTER", "INFO")) or not all(
                f"{new_id} " in str(cluster_stack.redis_command(name, "CLUSTER", "NODES"))
                and "handshake" not in str(cluster_stack.redis_command(name, "CLUSTER", "NODES"))
                for name in cluster_stack.cluster_primaries()
            ):
                assert time.monotonic() < wait, "the new node never became known to the cluster"
                await asyncio.sleep(0.2)
            await asyncio.to_thread(
                cli, "add-node", f"{c.host}:{second_port}", first, "--cluster-slave", "--cluster-master-id", new_id
            )
            wait = time.monotonic() + 20
            while "master_link_status:up" not in str(ask("INFO", "replication", at=second_port)):
                assert time.monotonic() < wait, "the new primary's replica never caught up"
                await asyncio.sleep(0.2)
            await asyncio.to_thread(
                cli,
                "reshard",
                first,
                "--cluster-from",
                "all",
                "--cluster-to",
                new_id,
                "--cluster-slots",
                "2048",
                "--cluster-yes",
            )
            for session in sessions:
                assert (await session.call("increment_counter"))["counter"] == 2
            held = ask("KEYS", "mcp:session:*")
            assert isinstance(held, list) and held, "no session's state moved to the new primary"
        assert {name: cluster_stack.pid(name) for name in c.replica_names()} == pids, "a replica restarted"
    finally:
        for proc in (node, second):
            proc.kill()
            proc.wait(timeout=10)
