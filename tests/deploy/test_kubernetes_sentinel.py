"""deploy/kubernetes-sentinel: the kit on Kubernetes with Redis Sentinel. Statically, what only this
overlay has (tests/test_kubernetes.py builds, validates and compares it with kubectl's kustomize
alongside the single-Redis kit); then its pods live, as processes on loopback: each runs its
container's command, the ConfigMap's script, with the pod's environment, and resolves the other
pods' names (redis-N.redis, sentinel-N.sentinel) as it would in the cluster. The live test needs
root and unshare, for an /etc/hosts of its own, and redis-server and redis-cli."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest
from test_compose import acl_users
from test_kubernetes import (
    KUSTOMIZATIONS,
    ROOT,
    SECRETS,
    build_kit,
    container,
    find,
    named_port,
    objects,  # noqa: F401
    pod_env,
    selects,
    wait_for,
)

from mcp_ha.ops.check.wire import RawSession
from mcp_ha.ops.stack import (
    REDIS_KIT_ACL,
    REDIS_REPLICATION_ACL,
    REDIS_SENTINEL_ACL,
    REDIS_SENTINEL_KIT_ACL,
    http_status,
    redis_command,
)

OVERLAY = KUSTOMIZATIONS["sentinel"]
SCRIPTS = ("primary.sh", "redis.sh", "sentinel.sh")


@pytest.fixture(scope="module")
def kit() -> list[dict]:
    return build_kit(OVERLAY)


def topology(kit: list[dict]) -> dict[str, str]:
    return find(kit, "ConfigMap", "redis-topology")["data"]


def statefulset_pods(kit: list[dict], name: str) -> list[str]:
    """host:port of each pod of a StatefulSet, by the names its headless Service gives them."""
    statefulset = find(kit, "StatefulSet", name)
    service = find(kit, "Service", statefulset["spec"]["serviceName"])
    port = service["spec"]["ports"][0]["port"]
    return [f"{name}-{i}.{service['metadata']['name']}:{port}" for i in range(statefulset["spec"]["replicas"])]


def script(name: str) -> str:
    return (OVERLAY / name).read_text()


# -- what the overlay is ---------------------------------------------------------------------------


@pytest.mark.quick
def test_the_overlay_is_the_kit_with_two_servers_and_three_sentinels(kit, objects):  # noqa: F811  the imported fixture
    ids = lambda objs: {(o["kind"], o["metadata"]["name"]) for o in objs}  # noqa: E731
    assert ids(kit) - ids(objects) == {
        ("StatefulSet", "sentinel"),
        ("Service", "sentinel"),
        ("PodDisruptionBudget", "sentinel"),
        ("PodDisruptionBudget", "redis"),
        ("ConfigMap", "redis-topology"),
        ("ConfigMap", "redis-scripts"),
    }
    assert ids(objects) <= ids(kit)
    assert find(kit, "StatefulSet", "redis")["spec"]["replicas"] == 2
    assert find(kit, "StatefulSet", "sentinel")["spec"]["replicas"] == 3


@pytest.mark.quick
def test_the_topology_names_every_pod_and_only_those(kit):
    """REDIS_SERVERS and REDIS_SENTINELS are the StatefulSets' pods by their stable names, on the
    ports the containers listen on, and those names resolve before the pods are ready."""
    data = topology(kit)
    assert data["REDIS_SERVERS"].split(",") == statefulset_pods(kit, "redis")
    assert data["REDIS_SENTINELS"].split(",") == statefulset_pods(kit, "sentinel")
    for name in ("redis", "sentinel"):
        service = find(kit, "Service", name)
        statefulset = find(kit, "StatefulSet", name)
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
        assert selects(
            {"matchLabels": service["spec"]["selector"]}, statefulset["spec"]["template"]["metadata"]["labels"]
        )
        port = service["spec"]["ports"][0]
        assert named_port(container(statefulset), port["targetPort"]) == port["port"]


@pytest.mark.quick
def test_the_replicas_ask_the_sentinels_as_the_kits_user(kit):
    env = pod_env(kit, find(kit, "Deployment", "mcp-server"))
    data = topology(kit)
    assert env["REDIS_URL"] == "", "with REDIS_URL set too, server.py would be given two stores"
    assert (env["REDIS_SENTINELS"], env["REDIS_MASTER_NAME"]) == (data["REDIS_SENTINELS"], data["REDIS_MASTER_NAME"])
    assert (env["REDIS_SENTINEL_USERNAME"], env["REDIS_SENTINEL_PASSWORD"]) == ("mcp", SECRETS["REDIS_PASSWORD"])
    assert (env["REDIS_USERNAME"], env["REDIS_PASSWORD"]) == ("mcp", SECRETS["REDIS_PASSWORD"])


@pytest.mark.quick
def test_each_container_runs_its_script_from_the_configmap_in_its_volume(kit):
    assert find(kit, "ConfigMap", "redis-scripts")["data"] == {name: script(name) for name in SCRIPTS}
    claims = {t["metadata"]["name"] for t in find(kit, "StatefulSet", "redis")["spec"]["volumeClaimTemplates"]}
    for name, data_volume in (("redis", claims), ("sentinel", {"data"})):
        statefulset = find(kit, "StatefulSet", name)
        c = container(statefulset)
        volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"].get("volumes", [])}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        shell, path = c["command"]
        directory, file = path.rsplit("/", 1)
        assert shell == "sh" and file == f"{name}.sh"
        assert volumes[mounts[directory]]["configMap"]["name"] == "redis-scripts"
        # The scripts write their configuration where they run: the pod's data volume.
        assert mounts[c["workingDir"]] in data_volume
        assert pod_env(kit, statefulset)["POD_NAME"] == f"{name}-0"


@pytest.mark.process
def test_the_scripts_are_posix_shell():
    for name in SCRIPTS:
        result = subprocess.run(["sh", "-n", str(OVERLAY / name)], capture_output=True, text=True)
        assert result.returncode == 0, f"{name}: {result.stderr}"


@pytest.mark.quick
def test_servers_and_sentinels_have_the_kits_acl():
    assert acl_users(script("redis.sh")) == {
        "default": "~* &* +@all",
        "mcp": REDIS_KIT_ACL,
        "sentinel": REDIS_SENTINEL_ACL,
        "replication": REDIS_REPLICATION_ACL,
    }
    assert acl_users(script("sentinel.sh")) == {"default": "~* &* +@all", "mcp": REDIS_SENTINEL_KIT_ACL}
    assert "masteruser replication\n" in script("redis.sh")
    # ../kubernetes's memory bound: full means writes refused, never live state evicted.
    assert "maxmemory 256mb\nmaxmemory-policy noeviction\n" in script("redis.sh")
    assert "sentinel auth-user $REDIS_MASTER_NAME sentinel\n" in script("sentinel.sh")


@pytest.mark.quick
def test_evictions_take_one_server_and_one_sentinel_at_a_time(kit):
    for name in ("redis", "sentinel"):
        pdb = find(kit, "PodDisruptionBudget", name)
        assert pdb["spec"]["maxUnavailable"] == 1
        for workload in (o for o in kit if o["kind"] in ("Deployment", "StatefulSet")):
            assert selects(pdb["spec"]["selector"], workload["spec"]["template"]["metadata"]["labels"]) == (
                workload["metadata"]["name"] == name
            )
    # With as many sentinels evicted as the budget allows, the others are still a majority (sentinel.sh's quorum).
    sentinels = len(topology(kit)["REDIS_SENTINELS"].split(","))
    assert sentinels - find(kit, "PodDisruptionBudget", "sentinel")["spec"]["maxUnavailable"] >= sentinels // 2 + 1
    assert 'quorum=$(( $(words "$REDIS_SENTINELS" | wc -w) / 2 + 1 ))' in script("sentinel.sh")


@pytest.mark.quick
def test_no_secret_reaches_a_script_but_through_the_environment(kit):
    for name in SCRIPTS:
        assert not any(value in script(name) for value in SECRETS.values())
    for name in ("redis", "sentinel"):
        env = container(find(kit, "StatefulSet", name))["env"]
        assert all("secretKeyRef" in var["valueFrom"] for var in env if "PASSWORD" in var["name"])


@pytest.mark.parametrize(
    "name,variable",
    [
        ("redis", "REDIS_REPLICATION_PASSWORD"),
        ("sentinel", "REDIS_ADMIN_PASSWORD"),
        ("sentinel", "REDIS_SENTINEL_AUTH_PASSWORD"),
    ],
)
@pytest.mark.process
def test_a_password_the_config_cannot_hold_stops_the_pod_by_name_without_printing_it(kit, tmp_path, name, variable):
    """The passwords written in clear: a quote or a space would make Redis refuse its file and print the line."""
    env = pod_env(kit, find(kit, "StatefulSet", name)) | {variable: 'a "pass\\word" with spaces'}
    result = subprocess.run(
        ["sh", str(OVERLAY / f"{name}.sh")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env},
        timeout=30,
    )
    assert result.returncode != 0
    assert result.stdout + result.stderr == f"{variable}: use printable ASCII without spaces, quotes or backslashes\n"
    assert not list(tmp_path.iterdir()), "nothing written"


# -- the pods, live --------------------------------------------------------------------------------


def cannot_run_pods() -> str | None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare, to give the pods an /etc/hosts of their own"
    missing = [tool for tool in ("redis-server", "redis-cli") if shutil.which(tool) is None]
    return f"{', '.join(missing)} not installed" if missing else None


class LoopbackPods:
    """The overlay's pods as processes on 127.0.0.1, each on a port of its own (given through the
    topology, as the cluster gives each pod an address of its own), in a data directory of its own,
    and in a mount namespace whose /etc/hosts resolves every pod's name to 127.0.0.1."""

    def __init__(self, kit: list[dict], tmp: Path) -> None:
        from conftest import free_ports

        self.kit, self.tmp = kit, tmp
        # pod -> its name in the cluster's DNS: redis-0 -> redis-0.redis
        self.names = {
            address.split(".")[0]: address.rsplit(":", 1)[0]
            for workload in ("redis", "sentinel")
            for address in statefulset_pods(kit, workload)
        }
        *ports, self.http_port = free_ports(len(self.names) + 1)
        self.ports = dict(zip(self.names, ports, strict=True))
        listed = lambda workload: ",".join(self.address(pod) for pod in self.names if pod.startswith(f"{workload}-"))  # noqa: E731
        self.topology = {**topology(kit), "REDIS_SERVERS": listed("redis"), "REDIS_SENTINELS": listed("sentinel")}
        for directory, config_map in (("scripts", "redis-scripts"), ("functions", "redis-functions")):
            (tmp / directory).mkdir()
            for name, text in find(kit, "ConfigMap", config_map)["data"].items():
                (tmp / directory / name).write_text(text)
        self.hosts = tmp / "hosts"
        self.hosts.write_text(f"127.0.0.1 localhost {' '.join(self.names.values())}\n")
        self.procs: dict[str, subprocess.Popen] = {}

    def _start(self, pod: str, command: list[str], env: dict[str, str], cwd: Path) -> None:
        cwd.mkdir(mode=0o700, exist_ok=True)
        # Its own mount namespace, where /etc/hosts is the cluster's DNS; the host's is untouched.
        self.procs[pod] = subprocess.Popen(
            ["unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(self.hosts), *command],
            cwd=cwd,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env},
            stdout=open(self.tmp / f"{pod}.log", "ab"),
            stderr=subprocess.STDOUT,
        )

    def start(self, pod: str) -> None:
        """A server or sentinel pod: its container's command, with /scripts where the ConfigMap is
        written here, and `--bind 127.0.0.1` as the container's args (the pod listens on its own address)."""
        workload, ordinal = pod.rsplit("-", 1)
        statefulset = find(self.kit, "StatefulSet", workload)
        shell, path = container(statefulset)["command"]
        command = [shell, str(self.tmp / "scripts" / Path(path).name), "--bind", "127.0.0.1"]
        env = pod_env(self.kit, statefulset, ordinal=int(ordinal)) | self.topology
        self._start(pod, command, env, self.tmp / pod)

    def start_replica(self) -> str:
        """An MCP replica with the Deployment's environment; its URL."""
        env = pod_env(self.kit, find(self.kit, "Deployment", "mcp-server")) | {
            "REDIS_SENTINELS": self.topology["REDIS_SENTINELS"],
            "HOST": "127.0.0.1",
            "PORT": str(self.http_port),
            "LOG_FORMAT": "text",
        }
        self._start("mcp-server-0", [sys.executable, str(ROOT / "server.py")], env, self.tmp / "mcp-server-0")
        url = f"http://127.0.0.1:{self.http_port}"
        wait_for(lambda: http_status(f"{url}/health") == 200, "the replica healthy", timeout=20)
        return f"{url}/mcp"

    def kill(self, pod: str) -> None:
        proc = self.procs.pop(pod)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def log(self, pod: str) -> str:
        return (self.tmp / f"{pod}.log").read_text(errors="replace")

    def ask(self, pod: str, *words: str) -> object:
        """A command to a server or sentinel pod, as the admin."""
        return redis_command("127.0.0.1", self.ports[pod], *words, password=SECRETS["REDIS_ADMIN_PASSWORD"])

    def primary_says(self, sentinel: str) -> str | None:
        answer = self.ask(sentinel, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.topology["REDIS_MASTER_NAME"])
        return f"{answer[0]}:{answer[1]}" if isinstance(answer, list) else None

    def address(self, pod: str) -> str:
        return f"{self.names[pod]}:{self.ports[pod]}"

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


SENTINELS = ["sentinel-0", "sentinel-1", "sentinel-2"]


@pytest.mark.skipif(cannot_run_pods() is not None, reason=str(cannot_run_pods()))
@pytest.mark.timeout(180)
@pytest.mark.redis
@pytest.mark.slow
async def test_pods_start_around_the_primary_of_now_and_the_replicas_follow(kit, tmp_path):
    """A new install, a kill -9 of the primary, and each kind of pod restarted after the failover,
    with the sentinels up and with every sentinel down: a restarted server never comes back as a
    second primary, a restarted sentinel watches the primary of now, and a replica serving one
    session throughout keeps all of its state."""
    pods = LoopbackPods(kit, tmp_path)
    redis_0, redis_1 = pods.address("redis-0"), pods.address("redis-1")

    def role(pod: str) -> list | None:
        answer = pods.ask(pod, "ROLE")
        return answer if isinstance(answer, list) else None

    def replicates_from(pod: str, primary: str) -> bool:
        r = role(pod)
        return r is not None and r[0] == "slave" and f"{r[1]}:{r[2]}" == primary and r[3] == "connected"

    def caught_up(offset: int) -> bool:
        """The primary's replica has acknowledged everything up to `offset`: ROLE is [master, offset,
        [[host, port, acknowledged offset]]]. Up to it, not equal to the primary's offset of now: the
        replica's lease renewals write every 0.25 s, the replica acknowledges once a second."""
        r = role("redis-0")
        return r is not None and len(r[2]) == 1 and int(r[2][0][2]) >= offset

    def sentinels_agree(primary: str, among: list[str] = SENTINELS) -> bool:
        return all(pods.primary_says(s) == primary for s in among)

    def sentinels_know_the_replica(replica: str) -> bool:
        """Each sentinel lists it (they learn replicas from the primary's INFO, every 10 s): a sentinel
        that does not know it would abort a failover it leads (no good replica)."""
        answers = [pods.ask(s, "SENTINEL", "REPLICAS", pods.topology["REDIS_MASTER_NAME"]) for s in SENTINELS]
        return all(
            isinstance(a, list) and [dict(zip(r[::2], r[1::2], strict=True))["name"] for r in a] == [replica]
            for a in answers
        )

    def sentinels_know_each_other() -> bool:
        answers = [pods.ask(s, "SENTINEL", "SENTINELS", pods.topology["REDIS_MASTER_NAME"]) for s in SENTINELS]
        return all(isinstance(a, list) and len(a) == len(SENTINELS) - 1 for a in answers)

    try:
        # A new install: nothing answers the first pods, so redis-0 is the primary.
        for pod in ["redis-0", "redis-1", *SENTINELS]:
            pods.start(pod)
        wait_for(lambda: replicates_from("redis-1", redis_0), "redis-1 replicating from redis-0")
        wait_for(
            lambda: sentinels_agree(redis_0) and sentinels_know_each_other() and sentinels_know_the_replica(redis_1),
            "three sentinels on redis-0, knowing redis-1",
            timeout=30,
        )
        assert role("redis-0")[0] == "master"

        async with httpx2.AsyncClient(timeout=30) as http:
            session = RawSession(http, pods.start_replica())
            await session.initialize()
            for n in range(1, 6):
                assert (await session.call("increment_counter"))["counter"] == n
            await session.call("add_note", {"note": "before the failover"})
            # Everything acknowledged is on the replica before its primary dies (no WAIT here: the
            # overlay keeps REDIS_WAIT_REPLICAS at its default, 0).
            written = role("redis-0")[1]
            wait_for(lambda: caught_up(written), "redis-1 caught up")

            pods.kill("redis-0")
            wait_for(lambda: sentinels_agree(redis_1), "the sentinels failing over to redis-1", timeout=30)
            wait_for(lambda: role("redis-1")[0] == "master", "redis-1 promoted")
            assert (await session.call("increment_counter"))["counter"] == 6

            # redis-0 back, the sentinels up: it asks them, and is redis-1's replica from its first answer.
            pods.start("redis-0")
            wait_for(lambda: role("redis-0") is not None, "redis-0 answering")
            assert role("redis-0")[0] == "slave", "redis-0 came back as a second primary"
            assert f"the primary is {redis_1}, says the sentinel" in pods.log("redis-0")
            wait_for(lambda: replicates_from("redis-0", redis_1), "redis-0 replicating from redis-1")

            # A sentinel back: it watches redis-1 from the start, and the others know it once, not twice.
            pods.kill("sentinel-0")
            pods.start("sentinel-0")
            wait_for(lambda: pods.primary_says("sentinel-0"), "sentinel-0 answering")
            assert pods.primary_says("sentinel-0") == redis_1
            assert f"the primary is {redis_1}, says the sentinel" in pods.log("sentinel-0")
            wait_for(sentinels_know_each_other, "three sentinels again, and no more")
            assert pods.ask("sentinel-0", "SENTINEL", "CKQUORUM", pods.topology["REDIS_MASTER_NAME"]).startswith("OK")

            # Every sentinel down: a restarted server asks the other server instead.
            for sentinel in SENTINELS:
                pods.kill(sentinel)
            pods.kill("redis-0")
            pods.start("redis-0")
            wait_for(lambda: role("redis-0") is not None, "redis-0 answering again")
            assert role("redis-0")[0] == "slave"
            assert f"no sentinel answered; {redis_1} says it is the primary" in pods.log("redis-0")
            wait_for(lambda: replicates_from("redis-0", redis_1), "redis-0 replicating from redis-1 again")
            # ...and so do sentinels that all start with no other sentinel up.
            for sentinel in SENTINELS:
                pods.start(sentinel)
            wait_for(lambda: sentinels_agree(redis_1) and sentinels_know_each_other(), "three sentinels on redis-1")

            # The replica served the session throughout, and lost nothing acknowledged.
            assert (await session.call("increment_counter"))["counter"] == 7
            assert (await session.call("list_notes"))["notes"] == ["before the failover"]
    finally:
        pods.stop_all()
