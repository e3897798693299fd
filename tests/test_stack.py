"""stack.py: the compose-like verbs, on a stack of its own so the other tests are not disturbed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import free_ports, running_stack, stack_config

from mcp_ha.stack import Stack, StackConfig, StackError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("own-stack"), replicas=2) as s:
        yield s


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
    result = cli(own_stack, "ps", env={"COLUMNS": "400"})
    assert result.returncode == 0, result.stderr
    c = own_stack.config
    for shown in (c.mcp_url, c.mcp_https_url, str(c.tls_cert), c.stats_password):
        assert shown in result.stdout, shown


def test_stop_and_start_behave_like_compose(own_stack: Stack) -> None:
    assert cli(own_stack, "stop", "mcp-server-2").returncode == 0
    assert ps_json(own_stack)["mcp-server-2"]["state"] == "stopped"
    assert ps_json(own_stack)["mcp-server-2"]["pid"] is None
    assert cli(own_stack, "start", "mcp-server-2").returncode == 0
    assert ps_json(own_stack)["mcp-server-2"]["state"] == "running"
    own_stack.wait_healthy("haproxy")
    assert own_stack.backends_up() == {"mcp-server-1", "mcp-server-2"}


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
