"""stack.py: the compose-like verbs, on a stack of its own so the other tests are not disturbed."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import pytest
from conftest import free_ports, running_stack, scrubbed, stack_config, stack_ports, starts
from fastmcp import Client

from mcp_ha.ops import stack as stack_module
from mcp_ha.ops.check.wire import RawSession
from mcp_ha.ops.stack import LOWEST_PORT, Stack, StackConfig, StackError, port_is_free

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
@starts("redis", "haproxy", "slow")
def own_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("own-stack"), replicas=2) as s:
        yield s


@pytest.mark.quick
def test_ports_are_handed_out_once_and_outside_the_ephemeral_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outgoing connection's source port comes from the ephemeral range, so a port handed out there could
    be taken before its server binds it; and callers at once (threads here, test workers alike: each call
    opens the notes afresh) never get the same port."""
    monkeypatch.setattr(stack_module, "PORTS_NOTED", tmp_path / "ports")
    with ThreadPoolExecutor(4) as pool:
        handed = [port for batch in pool.map(lambda _: free_ports(6), range(40)) for port in batch]
    low, high = (int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert len(set(handed)) == len(handed) == 240
    assert all(LOWEST_PORT <= port < low or high < port for port in handed)


def cli(stack: Stack, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python stack.py ARGS` against the given stack's state directory."""
    return subprocess.run(
        [sys.executable, str(ROOT / "stack.py"), *args],
        env={**os.environ, "STACK_DIR": str(stack.config.state_dir), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def ps_json(stack: Stack) -> dict[str, dict]:
    result = cli(stack, "ps", "--json")
    assert result.returncode == 0, result.stderr
    return {row["name"]: row for row in json.loads(result.stdout)}


def test_ps_json_lists_every_service_with_pid_address_and_state(own_stack: Stack) -> None:
    rows = ps_json(own_stack)
    assert list(rows) == ["redis", "mcp-server-1", "mcp-server-2", "haproxy"]
    for row in rows.values():
        assert row["state"] == "running"
        assert row["pid"] == own_stack.pid(row["name"])
        host, port = row["address"].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=2):
            pass


def test_ps_prints_the_endpoints_the_https_url_and_its_certificate(own_stack: Stack) -> None:
    result = cli(own_stack, "ps")  # piped, at the default width: no line broken inside a path or a password
    assert result.returncode == 0, result.stderr
    c = own_stack.config
    for shown in (c.mcp_url, c.mcp_https_url, str(c.tls_cert), c.stats_password):
        assert shown in result.stdout, shown
    # Each said on one line, as printed: a script greps the URL and its certificate together.
    assert any(c.mcp_https_url in line and str(c.tls_cert) in line for line in result.stdout.splitlines())


def test_stop_and_start_behave_like_compose(own_stack: Stack) -> None:
    assert cli(own_stack, "stop", "mcp-server-2").returncode == 0
    assert ps_json(own_stack)["mcp-server-2"]["state"] == "stopped"
    assert ps_json(own_stack)["mcp-server-2"]["pid"] is None
    assert cli(own_stack, "start", "mcp-server-2").returncode == 0
    assert ps_json(own_stack)["mcp-server-2"]["state"] == "running"
    own_stack.wait_healthy("haproxy")
    assert own_stack.backends_up() == {"mcp-server-1", "mcp-server-2"}


async def sticky_sessions(stack: Stack, stats_port: int) -> int:
    """The sessions in one HAProxy's table (its Prometheus exporter, the stats port's /metrics)."""
    auth = (stack.config.stats_user, stack.config.stats_password)
    async with httpx2.AsyncClient(auth=auth, timeout=5) as http:
        text = (await http.get(f"http://127.0.0.1:{stats_port}/metrics", params={"scope": "sticktable"})).text
    found = re.search(r'^haproxy_sticktable_used\{name="mcp_servers",[^}]*\} (\d+)$', text, re.M)
    assert found, text[:500]
    return int(found.group(1))


@pytest.mark.redis
@pytest.mark.haproxy
@pytest.mark.slow
async def test_two_haproxys_share_the_front_door_and_either_can_die(tmp_path: Path) -> None:
    """The demo's front door: haproxy and haproxy-2 on one port, each with its own stats. Sessions opened
    over connections the kernel spreads over both keep their replicas with either killed; the one started
    again takes the table back from the other, so the other can die next."""
    with running_stack(tmp_path / "pair", balancers=2) as pair:
        rows = ps_json(pair)
        assert [rows[n]["address"] for n in ("haproxy", "haproxy-2")] == [f"127.0.0.1:{pair.config.http_port}"] * 2
        assert all(pair.healthy(n) for n in ("haproxy", "haproxy-2"))
        clients = [httpx2.AsyncClient(timeout=10) for _ in range(12)]
        try:
            sessions = [RawSession(http, pair.config.mcp_url) for http in clients]
            for session in sessions:
                await session.initialize()
            replicas = [(await s.call("increment_counter"))["instance"] for s in sessions]
            assert len(set(replicas)) > 1, replicas
            # The second HAProxy to start finds the first's peer port already open, but the first tried the
            # second's before it listened and tries again only 5 s later (HAProxy's peer reconnect): what each
            # learnt meanwhile reaches the other then. Waited for until each session is in both tables.
            for _ in range(100):  # 20 s at most
                tables = [await sticky_sessions(pair, port) for port in pair.config.stats_ports]
                if min(tables) >= len(sessions):
                    break
                await asyncio.sleep(0.2)
            else:
                raise AssertionError(f"sessions in each HAProxy's table: {tables}, not {len(sessions)}")
            for name in ("haproxy", "haproxy-2"):
                assert cli(pair, "kill", name).returncode == 0
                # A fresh connection each: the kernel gives it to the HAProxy left.
                for http in clients:
                    await http.aclose()
                clients[:] = [httpx2.AsyncClient(timeout=10) for _ in sessions]
                for session, http in zip(sessions, clients, strict=True):
                    session.http = http
                after = [(await s.call("increment_counter"))["instance"] for s in sessions]
                assert after == replicas, f"with {name} killed"
                assert cli(pair, "start", name).returncode == 0
                pair.wait_healthy(name)
            assert [(await s.call("get_counter"))["counter"] for s in sessions] == [3] * len(sessions)
        finally:
            for http in clients:
                await http.aclose()


def test_kill_with_a_signal_pauses_and_kills(own_stack: Stack) -> None:
    pid = own_stack.pid("mcp-server-1")
    assert cli(own_stack, "kill", "-s", "SIGSTOP", "mcp-server-1").returncode == 0
    assert ps_json(own_stack)["mcp-server-1"]["state"] == "paused"
    assert cli(own_stack, "kill", "-s", "CONT", "mcp-server-1").returncode == 0
    assert ps_json(own_stack)["mcp-server-1"]["state"] == "running"
    assert cli(own_stack, "kill", "mcp-server-1").returncode == 0  # SIGKILL by default
    assert ps_json(own_stack)["mcp-server-1"]["state"] == "exited"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert cli(own_stack, "start", "mcp-server-1").returncode == 0
    own_stack.wait_healthy("haproxy")


def test_restart_gives_a_new_healthy_process(own_stack: Stack) -> None:
    before = own_stack.pid("mcp-server-1")
    result = cli(own_stack, "restart", "mcp-server-1")
    assert result.returncode == 0, result.stdout + result.stderr
    after = own_stack.pid("mcp-server-1")
    assert after and after != before
    assert own_stack.healthy("mcp-server-1")


def test_logs_prints_a_services_output(own_stack: Stack) -> None:
    result = cli(own_stack, "logs", "mcp-server-1")
    assert result.returncode == 0
    assert "Uvicorn running" in result.stdout or "Application startup complete" in result.stdout


def test_unknown_service_is_a_clear_error(own_stack: Stack) -> None:
    result = cli(own_stack, "stop", "mcp-server-7")
    assert result.returncode == 1
    assert "no service named 'mcp-server-7'" in result.stderr


@pytest.mark.process
def test_a_taken_port_is_reported_clearly(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        env = {"STACK_DIR": str(tmp_path), "REDIS_PORT": str(port)}
        result = subprocess.run(
            [sys.executable, str(ROOT / "stack.py"), "up", "-d"],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1
    assert f"port {port} on 127.0.0.1 is already in use, so redis cannot start" in result.stderr


@pytest.mark.process
def test_a_missing_binary_is_reported_clearly(tmp_path: Path) -> None:
    http, stats, redis, replica = free_ports(4)
    env = {
        "STACK_DIR": str(tmp_path),
        "PATH": "/nonexistent",
        "MCP_HTTP_PORT": str(http),
        "MCP_STATS_PORT": str(stats),
        "REDIS_PORT": str(redis),
        "MCP_BASE_PORT": str(replica),
        "MCP_REPLICAS": "1",
    }
    result = subprocess.run(
        [sys.executable, str(ROOT / "stack.py"), "up", "-d"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "redis-server not found" in result.stderr and "apt-get install redis-server" in result.stderr


@pytest.mark.redis
@pytest.mark.haproxy
@pytest.mark.slow
def test_down_leaves_no_process_behind(tmp_path: Path) -> None:
    s = Stack(stack_config(tmp_path, replicas=1))
    s.up()
    pids = [s.pid(svc.name) for svc in s.services()]
    assert all(pids)
    s.down()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not s.state_file.exists()


@pytest.mark.process
def test_a_recycled_pid_is_never_signalled(tmp_path: Path) -> None:
    """A recorded pid that now belongs to another process is treated as exited."""
    s = Stack(stack_config(tmp_path, replicas=1))
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        s._write(
            {
                "config": s.config.to_json(),
                "processes": {"redis": {"pid": bystander.pid, "start_ticks": "0", "argv": ["redis-server"]}},
            }
        )
        assert s.pid("redis") is None
        assert s.state("redis") == "exited"
        s.stop("redis")
        assert bystander.poll() is None  # still alive: not ours to stop
    finally:
        bystander.send_signal(signal.SIGKILL)
        bystander.wait()


def test_a_sentinel_stack_has_a_primary_a_replica_and_three_sentinels(sentinel_stack: Stack) -> None:
    rows = ps_json(sentinel_stack)
    assert list(rows) == [
        "redis-1",
        "redis-2",
        "sentinel-1",
        "sentinel-2",
        "sentinel-3",
        "mcp-server-1",
        "mcp-server-2",
        "haproxy",
    ]
    assert all(row["state"] == "running" for row in rows.values())
    assert sentinel_stack.redis_primary() in ("redis-1", "redis-2")
    for name in ("mcp-server-1", "mcp-server-2"):
        env = sentinel_stack.service(name).env
        assert "REDIS_URL" not in env and env["REDIS_SENTINELS"] == sentinel_stack.config.sentinels
        assert env["REDIS_WAIT_REPLICAS"] == "1"


def test_every_redis_server_of_a_stack_has_a_memory_bound_and_evicts_nothing(
    own_stack: Stack, sentinel_stack: Stack
) -> None:
    for stack, names in ((own_stack, ["redis"]), (sentinel_stack, ["redis-1", "redis-2"])):
        for name in names:
            assert stack.redis_command(name, "CONFIG", "GET", "maxmemory") == ["maxmemory", str(256 * 1024 * 1024)]
            assert stack.redis_command(name, "CONFIG", "GET", "maxmemory-policy") == ["maxmemory-policy", "noeviction"]


@pytest.mark.timeout(60)
@pytest.mark.redis
def test_a_full_redis_refuses_writes_and_keeps_every_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """REDIS_MAXMEMORY, read by stack.py: at the bound a write gets OOM, and nothing written before is evicted."""
    monkeypatch.setenv("REDIS_MAXMEMORY", "4mb")
    monkeypatch.setenv("STACK_DIR", str(tmp_path))
    (redis_port,) = free_ports(1)
    monkeypatch.setenv("REDIS_PORT", str(redis_port))
    stack = Stack(StackConfig.from_env())
    try:
        stack.start("redis")
        value = "x" * 100_000
        written, refusal = 0, None
        for i in range(200):  # 20 MB at most: far past the bound
            reply = stack.redis_command("redis", "SET", f"mcp:fill:{i}", value)
            if isinstance(reply, Exception):
                refusal = str(reply)
                break
            written += 1
        assert refusal is not None and refusal.startswith("OOM"), refusal
        assert written > 0
        assert stack.redis_command("redis", "DBSIZE") == written
        assert stack.redis_info("redis", "stats")["evicted_keys"] == "0"
        # Reads and deletes still work, and free room for writes again.
        assert stack.redis_command("redis", "STRLEN", "mcp:fill:0") == len(value)
        assert stack.redis_command("redis", "DEL", "mcp:fill:0") == 1
        assert stack.redis_command("redis", "SET", "mcp:fill:again", "1") == "OK"
    finally:
        stack.down()


@pytest.mark.parametrize("size", ["lots", "256 mb", "-1", "0", "1tb"])
def test_a_memory_bound_redis_cannot_read_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: str
) -> None:
    monkeypatch.setenv("STACK_DIR", str(tmp_path))
    monkeypatch.setenv("REDIS_MAXMEMORY", size)
    with pytest.raises(StackError, match=r"^REDIS_MAXMEMORY="):
        StackConfig.from_env()


def test_up_refuses_to_switch_a_running_stack_to_another_redis_mode(sentinel_stack: Stack) -> None:
    result = cli(sentinel_stack, "up", "-d", "--redis", "single")
    assert result.returncode != 0
    assert "is up with --redis sentinel" in result.stderr and "stack.py down" in result.stderr
    assert all(row["state"] == "running" for row in ps_json(sentinel_stack).values())


def test_a_stack_dir_from_before_redis_had_passwords_is_refused_clearly(tmp_path: Path) -> None:
    stack = Stack(stack_config(tmp_path, replicas=1, redis_mode="sentinel"))
    conf = tmp_path / "redis-1" / "redis.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text(f"bind 127.0.0.1\nport {stack.config.redis_port}\n")
    with pytest.raises(StackError, match=r"from before Redis had passwords.*stack\.py down"):
        stack.start("redis-1")
    assert stack.pid("redis-1") is None


@pytest.mark.timeout(180)
@pytest.mark.redis
@pytest.mark.haproxy
@pytest.mark.slow
def test_a_sentinel_stack_comes_back_up_around_the_primary_it_went_down_with(tmp_path: Path) -> None:
    """After a failover, down then up starts the server Sentinel last chose as the primary, the other as its
    replica. (Which one that is, is Sentinel's: on a loaded machine it has been seen to fail over a second time,
    back to redis-1, a second after the first; down records whichever it is.)"""
    stack = Stack(stack_config(tmp_path, replicas=1, redis_mode="sentinel", redis_wait_replicas=1))
    try:
        stack.up()
        assert stack.redis_primary() == "redis-1"
        stack.signal("redis-1", signal.SIGKILL)
        deadline = time.monotonic() + 30
        while stack.redis_primary() != "redis-2" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stack.redis_primary() == "redis-2"
        stack.start("redis-1")
        stack.down()
        went_down_with = (tmp_path / "redis-primary").read_text().strip()
        assert went_down_with in ("redis-1", "redis-2")
        stack.up()
        assert stack.redis_primary() == went_down_with
        other = "redis-1" if went_down_with == "redis-2" else "redis-2"
        replication = stack.redis_info(other, "replication")
        assert replication["role"] == "slave" and replication["master_link_status"] == "up"
        assert replication["master_port"] == str(stack.service(went_down_with).port)
    finally:
        stack.down()


# A user's own server, in a folder of their own (not the kit's checkout): its tool shows what the replica got.
JOBS_SERVER = """\
import os

from mcp_ha import HighAvailability

ha = HighAvailability.from_env()
mcp = ha.server("jobs")


@mcp.tool
def jobs_max() -> dict:
    return {"jobs_max": os.environ.get("JOBS_MAX"), "instance": os.environ["INSTANCE_ID"]}


app = ha.http_app(mcp)

if __name__ == "__main__":
    ha.run(app)
"""
MCP_HA = Path(sys.executable).parent / "mcp-ha"


def proc_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode()
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


@pytest.fixture(scope="module")
@starts("redis", "haproxy", "slow")
def user_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`up -d --server jobs_server` run in the user's project folder, with JOBS_MAX=5 in its shell and the kit's
    checkout nowhere on PYTHONPATH; the stack dir is the default, the project's .stack."""
    project = tmp_path_factory.mktemp("jobs-project")
    (project / "jobs_server.py").write_text(JOBS_SERVER)
    shell = {k: v for k, v in os.environ.items() if k not in ("STACK_DIR", "PYTHONPATH")}
    result = subprocess.run(
        [sys.executable, "-m", "mcp_ha.ops.stack", "up", "-d", "--server", "jobs_server"],
        cwd=project,
        env={**shell, **stack_ports(2), "JOBS_MAX": "5"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    stack = Stack.load(state_dir=project / ".stack")
    try:
        assert result.returncode == 0, result.stdout + result.stderr
        yield stack
    finally:
        stack.down()


async def jobs_max(stack: Stack, name: str) -> dict:
    """The replica's own answer, straight from its port."""
    async with Client(f"http://127.0.0.1:{stack.service(name).port}/mcp", mode="legacy", timeout=30) as client:
        return (await client.call_tool("jobs_max", {})).structured_content


def test_a_users_server_runs_from_its_project_with_the_interpreter_and_environment_of_up(
    user_stack: Stack, tmp_path: Path
) -> None:
    project = user_stack.config.project
    assert project == user_stack.config.state_dir.parent
    ps = subprocess.run(
        [sys.executable, "-m", "mcp_ha.ops.stack", "--stack-dir", str(user_stack.config.state_dir), "ps", "--json"],
        cwd=tmp_path,
        env=scrubbed(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ps.returncode == 0, ps.stderr
    rows = {row["name"]: row for row in json.loads(ps.stdout)}
    for name in ("mcp-server-1", "mcp-server-2"):
        assert rows[name]["state"] == "running"
        assert (rows[name]["module"], rows[name]["project"]) == ("jobs_server", str(project))
        pid = user_stack.pid(name)
        assert pid is not None
        assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:3] == [
            sys.executable.encode(),
            b"-m",
            b"jobs_server",
        ]
        assert Path(f"/proc/{pid}/cwd").resolve() == project
        environ = proc_environ(pid)
        assert environ["JOBS_MAX"] == "5"
        pythonpath = environ["PYTHONPATH"].split(os.pathsep)
        assert pythonpath[0] == str(project)
        assert not [entry for entry in pythonpath if Path(entry).resolve().is_relative_to(ROOT)], pythonpath
    assert (rows["redis"]["module"], rows["haproxy"]["project"]) == (None, None)


@pytest.mark.timeout(240)
async def test_a_replica_restarted_from_another_shell_gets_what_it_had_at_up(user_stack: Stack, tmp_path: Path) -> None:
    """Another folder and an environment with neither JOBS_MAX nor the project: a rolling restart by STACK_DIR
    through `mcp-ha stack`, then stop and start by --stack-dir."""
    state_dir = str(user_stack.config.state_dir)
    replicas = user_stack.config.replica_names()
    before = {name: user_stack.pid(name) for name in replicas}

    def elsewhere(*args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(args, cwd=tmp_path, env=scrubbed(**env), capture_output=True, text=True, timeout=150)

    restarted = elsewhere(str(MCP_HA), "stack", "restart", *replicas, STACK_DIR=state_dir)
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    for name in replicas:
        assert user_stack.pid(name) not in (None, before[name])
        assert await jobs_max(user_stack, name) == {"jobs_max": "5", "instance": name}
    for verb in ("stop", "start"):
        result = elsewhere(sys.executable, "-m", "mcp_ha.ops.stack", "--stack-dir", state_dir, verb, "mcp-server-2")
        assert result.returncode == 0, result.stdout + result.stderr
    assert await jobs_max(user_stack, "mcp-server-2") == {"jobs_max": "5", "instance": "mcp-server-2"}
    assert proc_environ(user_stack.pid("mcp-server-2") or 0)["PYTHONPATH"].split(os.pathsep)[0] == str(
        user_stack.config.project
    )
    user_stack.wait_healthy("haproxy")
    async with Client(user_stack.config.mcp_url, mode="legacy", timeout=30) as client:
        assert (await client.call_tool("jobs_max", {})).structured_content["jobs_max"] == "5"


@pytest.mark.process
def test_a_verb_that_finds_no_stack_says_how_to_name_one(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(MCP_HA), "stack", "restart", "mcp-server-1"],
        cwd=tmp_path,
        env=scrubbed(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: no stack is up in {tmp_path / '.stack'}")
    assert "--stack-dir" in result.stderr and "STACK_DIR" in result.stderr


@pytest.mark.process
def test_ps_with_no_stack_up_shows_nothing_and_makes_nothing(tmp_path: Path) -> None:
    """As `docker compose ps` with nothing up: no table of services never started, no password minted for
    none, nothing written; `--stack-dir` taken after the verb as before it."""
    for args, shown in ((["ps"], ""), (["ps", "--json"], "[]\n")):
        result = subprocess.run(
            [str(MCP_HA), "stack", *args, "--stack-dir", str(tmp_path / "stack")],
            cwd=tmp_path,
            env=scrubbed(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (result.returncode, result.stdout) == (0, shown), result.stderr
        assert result.stderr == f"(no stack is up in {tmp_path / 'stack'})\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.process
@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"MCP_HTTP_PORT": "70000"}, "MCP_HTTP_PORT='70000': expected 1-65535"),
        ({"SESSION_TTL_SECONDS": "-5"}, "SESSION_TTL_SECONDS='-5': expected 1 or more"),
        # Read by the replicas, not the stack: checked as they check it, before anything starts.
        ({"ABANDONED_CALL_SECONDS": "nan"}, "ABANDONED_CALL_SECONDS='nan': expected a finite number"),
        ({"LOG_FORMAT": "xml"}, "LOG_FORMAT='xml': expected one of json, text"),
    ],
)
def test_up_refuses_a_setting_that_cannot_work_by_its_name_and_starts_nothing(
    tmp_path: Path, env: dict[str, str], says: str
) -> None:
    result = subprocess.run(
        [str(MCP_HA), "stack", "up", "-d"],
        cwd=tmp_path,
        env=scrubbed(STACK_DIR=str(tmp_path / "stack"), **env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode, result.stderr) == (1, f"error: {says}\n")
    assert not (tmp_path / "stack" / "state.json").exists()


@pytest.mark.parametrize("command", [[str(MCP_HA), "stack"], [sys.executable, str(ROOT / "stack.py")]])
@pytest.mark.parametrize(
    "verb",
    [
        ["up", "-d"],
        ["down"],
        ["ps"],
        ["logs"],
        ["stop", "redis"],
        ["start", "redis"],
        ["restart", "redis"],
        ["kill", "redis"],
    ],
)
@pytest.mark.process
def test_every_verb_reports_a_stack_error_as_one_line_through_either_command(
    tmp_path: Path, command: list[str], verb: list[str]
) -> None:
    result = subprocess.run(
        [*command, *verb],
        cwd=tmp_path,
        env={**os.environ, "STACK_DIR": str(tmp_path), "MCP_REPLICAS": "12"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr == "error: MCP_REPLICAS=12: between 1 and 9 replicas are supported\n"


@pytest.mark.timeout(180)
@pytest.mark.redis
@pytest.mark.slow
def test_a_failed_up_stops_what_it_started_and_shows_only_its_own_log(tmp_path: Path) -> None:
    """The module is in no project: the replicas die at once, after Redis is up. An earlier run's log lines
    (here written by hand) are no part of the error. Run from elsewhere with --project: the stack dir is the
    project's .stack."""
    project = tmp_path / "project"
    state_dir = project / ".stack"
    (state_dir / "logs").mkdir(parents=True)
    earlier = "a line an earlier run of this service wrote"
    for name in ("redis", "mcp-server-1", "mcp-server-2", "haproxy"):
        (state_dir / "logs" / f"{name}.log").write_text(f"{earlier}\n" * 30)
    ports = stack_ports(2)
    result = subprocess.run(
        [str(MCP_HA), "stack", "up", "-d", "--server", "no_such_jobs_server", "--project", str(project)],
        cwd=tmp_path,
        env={**{k: v for k, v in os.environ.items() if k != "STACK_DIR"}, **ports},
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert result.returncode == 1
    assert result.stderr.startswith(
        "error: mcp-server-1 exited while starting: ModuleNotFoundError: No module named 'no_such_jobs_server' "
        f"(not in {project.resolve()}: run from your project folder, or pass --project)"
    ), result.stderr
    assert earlier not in result.stdout + result.stderr
    assert not (state_dir / "state.json").exists()
    base = int(ports["MCP_BASE_PORT"])
    for port in (int(ports["REDIS_PORT"]), base, base + 1):
        assert port_is_free("127.0.0.1", port), port
    # Redis did start, and was stopped: its log holds this run's lines after the earlier ones.
    assert (state_dir / "logs" / "redis.log").read_text().count("\n") > 30


@pytest.mark.timeout(180)
@pytest.mark.redis
@pytest.mark.haproxy
@pytest.mark.slow
def test_an_up_that_fails_at_haproxy_stops_redis_and_the_replicas(tmp_path: Path) -> None:
    ports = stack_ports(1)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", int(ports["MCP_HTTP_PORT"])))
        squatter.listen()
        result = subprocess.run(
            [sys.executable, str(ROOT / "stack.py"), "up", "-d"],
            cwd=ROOT,
            env={**os.environ, **ports, "STACK_DIR": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=150,
        )
    assert result.returncode == 1
    assert f"port {ports['MCP_HTTP_PORT']} on 127.0.0.1 is already in use, so haproxy cannot start" in result.stderr
    assert (tmp_path / "logs" / "mcp-server-1.log").stat().st_size > 0  # it had started
    for port in (int(ports["REDIS_PORT"]), int(ports["MCP_BASE_PORT"])):
        assert port_is_free("127.0.0.1", port), port
    assert not (tmp_path / "state.json").exists()
