"""deploy/kubernetes-cluster: the kit on Kubernetes with Redis Cluster (six nodes, three primaries with a
replica each), whose scripts docker-compose.cluster.yaml runs too. Statically, what only this overlay has
(tests/test_kubernetes.py builds, validates and compares it with kubectl's kustomize alongside the
others); then its pods live, as processes on loopback, each resolving the others' names (redis-N.redis)
as in the cluster: the nodes, the Job that makes them one cluster, and a replica serving a session
through a primary's kill -9. Never run on a Kubernetes cluster."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest
from test_compose import acl_users
from test_kubernetes import KUSTOMIZATIONS, ROOT, SECRETS, build_kit, container, find, objects, pod_env, wait_for  # noqa: F401
from test_kubernetes_sentinel import cannot_run_pods, statefulset_pods, topology

from mcp_ha.ops.check.wire import CallFailed, RawSession
from mcp_ha.ops.stack import CLUSTER_NODES, REDIS_KIT_CLUSTER_ACL, REDIS_REPLICATION_ACL, http_status, redis_command

OVERLAY = KUSTOMIZATIONS["cluster"]
SCRIPTS = ("node.sh", "create.sh")


@pytest.fixture(scope="module")
def kit() -> list[dict]:
    return build_kit(OVERLAY)


@pytest.mark.quick
def test_the_overlay_is_the_kit_with_six_nodes_and_a_job_making_them_one_cluster(kit, objects):  # noqa: F811
    ids = lambda objs: {(o["kind"], o["metadata"]["name"]) for o in objs}  # noqa: E731
    assert ids(kit) - ids(objects) == {
        ("Job", "redis-cluster-create"),
        ("ConfigMap", "redis-topology"),
        ("ConfigMap", "redis-scripts"),
    }
    assert ids(objects) <= ids(kit)
    redis = find(kit, "StatefulSet", "redis")
    assert redis["spec"]["replicas"] == CLUSTER_NODES
    assert topology(kit)["REDIS_SERVERS"].split(",") == statefulset_pods(kit, "redis")
    assert find(kit, "Service", "redis")["spec"]["publishNotReadyAddresses"] is True
    assert find(kit, "ConfigMap", "redis-scripts")["data"] == {name: (OVERLAY / name).read_text() for name in SCRIPTS}
    job = find(kit, "Job", "redis-cluster-create")
    assert container(job, "create")["command"] == ["sh", "/scripts/create.sh"]
    assert container(redis)["command"] == ["sh", "/scripts/node.sh"]


@pytest.mark.quick
def test_the_replicas_reach_the_cluster_as_the_kits_user(kit):
    env = pod_env(kit, find(kit, "Deployment", "mcp-server"))
    assert env["REDIS_URL"] == "", "with REDIS_URL set too, the settings refuse two stores"
    assert env["REDIS_CLUSTER_NODES"] == topology(kit)["REDIS_SERVERS"]
    assert (env["REDIS_USERNAME"], env["REDIS_PASSWORD"]) == ("mcp", SECRETS["REDIS_PASSWORD"])


@pytest.mark.quick
def test_the_nodes_have_the_kits_cluster_acl():
    text = (OVERLAY / "node.sh").read_text()
    assert acl_users(text) == {
        "default": "~* &* +@all",
        "mcp": REDIS_KIT_CLUSTER_ACL,
        "replication": REDIS_REPLICATION_ACL,
    }


@pytest.mark.process
def test_the_scripts_are_posix_shell():
    for name in SCRIPTS:
        done = subprocess.run(["sh", "-n", str(OVERLAY / name)], capture_output=True, text=True)
        assert done.returncode == 0, (name, done.stderr)


class ClusterPods:
    """The overlay's pods as processes on 127.0.0.1, each node on a port (and a bus port) of its own, given
    through the topology, in a data directory of its own, in a mount namespace whose /etc/hosts resolves
    every pod's name to 127.0.0.1."""

    def __init__(self, kit: list[dict], tmp: Path) -> None:
        from conftest import free_ports

        self.kit, self.tmp = kit, tmp
        self.names = [address.rsplit(":", 1)[0] for address in statefulset_pods(kit, "redis")]
        ports = free_ports(2 * len(self.names) + 1)
        self.ports = dict(zip(self.names, ports, strict=False))
        self.buses = dict(zip(self.names, ports[len(self.names) :], strict=False))
        self.http_port = ports[-1]
        self.servers = ",".join(f"{name}:{self.ports[name]}" for name in self.names)
        for directory, config_map in (("scripts", "redis-scripts"), ("functions", "redis-functions")):
            (tmp / directory).mkdir()
            for name, text in find(kit, "ConfigMap", config_map)["data"].items():
                (tmp / directory / name).write_text(text)
        self.hosts = tmp / "hosts"
        self.hosts.write_text(f"127.0.0.1 localhost {' '.join(self.names)}\n")
        self.procs: dict[str, subprocess.Popen] = {}

    def _command(self, command: list[str]) -> list[str]:
        # Its own mount namespace, where /etc/hosts is the cluster's DNS; the host's is untouched.
        return ["unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(self.hosts), *command]

    def _env(self, env: dict[str, str]) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env, "REDIS_SERVERS": self.servers}

    def start_node(self, ordinal: int) -> None:
        statefulset = find(self.kit, "StatefulSet", "redis")
        name = self.names[ordinal]
        shell, path = container(statefulset)["command"]
        command = [shell, str(self.tmp / "scripts" / Path(path).name), "--bind", "127.0.0.1"]
        command += ["--cluster-port", str(self.buses[name])]
        cwd = self.tmp / name
        cwd.mkdir(mode=0o700, exist_ok=True)
        env = self._env(pod_env(self.kit, statefulset, ordinal=ordinal))
        log = open(self.tmp / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(self._command(command), cwd=cwd, env=env, stdout=log, stderr=log)

    def create(self) -> subprocess.CompletedProcess:
        """The Job's container, run to its end."""
        job = find(self.kit, "Job", "redis-cluster-create")
        shell, path = container(job, "create")["command"]
        env = self._env(pod_env(self.kit, job, "create"))
        command = self._command([shell, str(self.tmp / "scripts" / Path(path).name)])
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)

    def start_replica(self) -> str:
        env = pod_env(self.kit, find(self.kit, "Deployment", "mcp-server")) | {
            "REDIS_CLUSTER_NODES": self.servers,
            "HOST": "127.0.0.1",
            "PORT": str(self.http_port),
            "LOG_FORMAT": "text",
        }
        log = open(self.tmp / "mcp-server.log", "ab")
        self.procs["mcp-server"] = subprocess.Popen(
            self._command([sys.executable, str(ROOT / "server.py")]), env=self._env(env), stdout=log, stderr=log
        )
        url = f"http://127.0.0.1:{self.http_port}"
        wait_for(lambda: http_status(f"{url}/health") == 200, "the replica healthy", timeout=30)
        return f"{url}/mcp"

    def ask(self, name: str, *words: str) -> object:
        return redis_command("127.0.0.1", self.ports[name], *words, password=SECRETS["REDIS_ADMIN_PASSWORD"])

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        # unshare, sh and the script each exec the next: the pid is the node's (or the replica's).
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait(timeout=10)


def primary_of_slot(pods: ClusterPods, slot: int) -> str:
    """The pod serving `slot` as its primary, as the node on it says."""
    for name in pods.names:
        answer = pods.ask(name, "CLUSTER", "SLOTS")
        if not isinstance(answer, list):
            continue
        for start, end, primary, *_ in answer:
            if int(start) <= slot <= int(end):
                return next(n for n in pods.names if pods.ports[n] == int(primary[1]))
    raise AssertionError(f"no node names the primary of slot {slot}")


@pytest.mark.skipif(cannot_run_pods() is not None, reason=str(cannot_run_pods()))
@pytest.mark.timeout(180)
@pytest.mark.redis
@pytest.mark.haproxy
@pytest.mark.slow
async def test_the_pods_make_one_cluster_and_a_session_outlives_its_primary(kit, tmp_path):
    """A new install: six nodes, the Job making them a cluster (and, run again, leaving it as it is), the
    kit's functions on every primary; then a replica serving a session while the primary of its slot is
    killed -9: its replica takes over, and the session's state is whole."""
    from redis.crc import key_slot

    from mcp_ha.stores.redis_store import CLUSTER_LIBRARY

    pods = ClusterPods(kit, tmp_path)
    try:
        for ordinal in range(len(pods.names)):
            pods.start_node(ordinal)
        for name in pods.names:
            wait_for(lambda name=name: pods.ask(name, "PING") == "PONG", f"{name} answering")
        created = await asyncio.to_thread(pods.create)
        assert created.returncode == 0, created.stdout[-1500:] + created.stderr[-1500:]
        roles = {name: pods.ask(name, "ROLE") for name in pods.names}
        primaries = [name for name, role in roles.items() if isinstance(role, list) and role[0] == "master"]
        assert len(primaries) == 3, roles
        for name in primaries:
            wait_for(
                lambda name=name: CLUSTER_LIBRARY in str(pods.ask(name, "FUNCTION", "LIST")),
                f"the kit's functions on {name}",
            )
        again = await asyncio.to_thread(pods.create)
        assert again.returncode == 0 and "Performing hash slots allocation" not in again.stdout, again.stdout[-800:]
        url = await asyncio.to_thread(pods.start_replica)
        async with httpx2.AsyncClient(timeout=30) as http:
            session = RawSession(http, url)
            await session.initialize()
            for n in range(1, 4):
                assert (await session.call("increment_counter"))["counter"] == n
            primary = primary_of_slot(pods, key_slot(f"{{{session.session_id}}}".encode()))
            # Its replica has every write (asynchronous replication: an acknowledged one could be lost
            # otherwise, which REDIS_WAIT_REPLICAS=1 prevents, docs/deploy.md).
            offset = lambda name: int(  # noqa: E731
                next(
                    line
                    for line in str(pods.ask(name, "INFO", "replication")).splitlines()
                    if line.startswith(("master_repl_offset", "slave_repl_offset"))
                ).split(":")[1]
            )
            replica = next(
                n for n in pods.names if n != primary and str(pods.ask(n, "ROLE")).count(str(pods.ports[primary]))
            )
            wait_for(lambda: offset(replica) >= offset(primary), "the replica caught up")
            pods.kill(primary)
            wait_for(lambda: (pods.ask(replica, "ROLE") or [""])[0] == "master", "the replica promoted", timeout=30)
            # Spoken to directly, not through HAProxy, a call carries no idempotency key, so the store does
            # not retry its write: one that meets a connection to the dead node is refused, and its client
            # told to try again (bounded: 3 tries). Not applied twice: the counter says so.
            for attempt in range(3):
                try:
                    counter = (await session.call_tool("increment_counter"))["counter"]
                    break
                except CallFailed as exc:
                    assert "try again" in str(exc) and attempt < 2, exc
                    await asyncio.sleep(1)
            assert counter == 4
            assert (await session.call("get_counter"))["counter"] == 4
    finally:
        pods.stop_all()
