"""mcp_ha/ops/check/faults.py: the ready-made fault sets, the user's own templates, and a command's failure."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from mcp_ha.ops.check.faults import BALANCER_VERBS, VERBS, FaultError, Faults, local, parse_faults
from mcp_ha.ops.stack import StackConfig


def recorded_stack(tmp_path: Path, balancers: int) -> str:
    """A stack dir as `up` leaves it (its config recorded), for a stack of `balancers` HAProxys."""
    config = StackConfig.on_free_ports(tmp_path, balancers=balancers)
    (tmp_path / "state.json").write_text(json.dumps({"config": config.to_json(), "processes": {}}))
    return str(tmp_path)


def test_the_local_set_runs_the_stack_command_of_this_python_in_its_stack_dir(tmp_path: Path) -> None:
    faults = local(recorded_stack(tmp_path, 2))
    assert faults.missing(*VERBS) is None
    assert faults.command("kill", "mcp-server-2") == [
        sys.executable,
        "-m",
        "mcp_ha.ops.stack",
        "kill",
        "-s",
        "SIGKILL",
        "mcp-server-2",
    ]
    assert faults.command("pause", "mcp-server-1")[-3:] == ["-s", "SIGSTOP", "mcp-server-1"]
    assert faults.command("resume", "mcp-server-1")[-3:] == ["-s", "SIGCONT", "mcp-server-1"]
    assert faults.command("drain", "mcp-server-3")[-2:] == ["restart", "mcp-server-3"]
    assert faults.env == {"STACK_DIR": str(tmp_path)}
    # The front door: the stack's first HAProxy, while the second serves the same port.
    assert faults.command("kill-balancer", "")[-4:] == ["kill", "-s", "SIGKILL", "haproxy"]
    assert faults.command("restart-balancer", "")[-2:] == ["start", "haproxy"]


def test_a_local_stack_with_one_haproxy_has_no_balancer_to_kill(tmp_path: Path) -> None:
    faults = local(recorded_stack(tmp_path, 1))
    assert faults.missing("kill", "drain") is None
    assert "runs one HAProxy" in str(faults.missing("kill-balancer"))


def test_compose_names_its_services_and_kubectl_says_what_it_cannot_do() -> None:
    v1 = parse_faults("docker-compose")
    assert v1.command("kill", "mcp-server-1") == ["docker-compose", "kill", "-s", "SIGKILL", "mcp-server-1"]
    assert v1.command("pause", "mcp-server-1") == ["docker-compose", "pause", "mcp-server-1"]
    assert v1.command("resume", "mcp-server-1") == ["docker-compose", "unpause", "mcp-server-1"]
    assert v1.command("kill-balancer", "") == ["docker-compose", "kill", "-s", "SIGKILL", "haproxy"]
    assert v1.missing(*BALANCER_VERBS) is None
    v2 = parse_faults("docker  compose")
    assert v2.command("kill", "mcp-server-1") == ["docker", "compose", "kill", "-s", "SIGKILL", "mcp-server-1"]
    k = parse_faults("kubectl")
    assert k.command("kill", "mcp-server-7d9f") == [
        "kubectl",
        "delete",
        "pod",
        "--grace-period=0",
        "--force",
        "mcp-server-7d9f",
    ]
    assert k.missing("kill", "drain") is None
    assert k.missing("pause") == "kubectl cannot pause a pod's processes"
    assert k.command("kill-balancer", "")[-1] == "haproxy-0"
    assert k.missing("restart-balancer") == "Kubernetes starts a new pod by itself"


@pytest.mark.parametrize("text", ["kubectl -n mcp", "kubectl --namespace mcp", "kubectl --namespace=mcp"])
def test_kubectl_takes_the_namespace_the_docs_deploy_into(text: str) -> None:
    faults = parse_faults(text)
    for verb in ("kill", "drain", "kill-balancer"):
        assert faults.command(verb, "mcp-server-7d9f")[:3] == ["kubectl", "-n", "mcp"], verb


@pytest.mark.process
@pytest.mark.parametrize(
    ("has", "uses"),
    [
        ({"docker": 0, "docker-compose": 0}, ["docker", "compose"]),
        ({"docker": 1, "docker-compose": 0}, ["docker-compose"]),
    ],
)
def test_compose_uses_v2_where_the_docker_cli_has_it_else_v1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, has: dict[str, int], uses: list[str]
) -> None:
    """`docker compose version` answering says v2 is there (docker-compose 1.29, Debian's, is v1)."""
    for name, status in has.items():
        (tmp_path / name).write_text(f"#!/bin/sh\nexit {status}\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert parse_faults("compose").command("kill", "mcp-server-1")[: len(uses)] == uses


def test_the_users_own_commands_commas_in_them_included() -> None:
    faults = parse_faults(
        "kill=kubectl delete pod --grace-period=0 --force {replica}, drain=ssh host 'a,b' restart {replica}"
    )
    assert faults.name == "custom" and set(faults.commands) == {"kill", "drain"}
    assert faults.command("drain", "r1") == ["ssh", "host", "a,b", "restart", "r1"]
    assert faults.missing("pause") == "no pause command in the custom faults"
    # The replica's name is one argument, whatever it holds.
    assert faults.command("kill", "a b;rm")[-1] == "a b;rm"
    # A balancer's commands name the balancer themselves; kill= is not read into kill-balancer=.
    faults = parse_faults("kill=pkill -9 {replica},kill-balancer=ssh lb1 pkill -9 haproxy,restart-balancer=ssh lb1 x")
    assert faults.commands == {
        "kill": "pkill -9 {replica}",
        "kill-balancer": "ssh lb1 pkill -9 haproxy",
        "restart-balancer": "ssh lb1 x",
    }


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("chaos", "one of local, compose, kubectl"),
        ("explode=boom {replica}", "one of local, compose, kubectl"),
        ("kill=", "kill= has no command"),
        ("kill=kill -9 1234", "does not name {replica}"),
        ("kill=a {replica},kill=b {replica}", "kill given twice"),
    ],
)
def test_a_bad_fault_set_is_refused_with_the_reason(text: str, says: str) -> None:
    with pytest.raises(FaultError, match=None) as raised:
        parse_faults(text)
    assert says in str(raised.value)


@pytest.mark.process
async def test_a_fault_command_that_fails_says_so_with_its_output() -> None:
    command = shlex.quote(sys.executable) + " -c 'import sys; sys.exit(\"no {replica}\")'"
    faults = Faults("custom", {"kill": command})
    with pytest.raises(FaultError, match=r"kill r9: .* exited 1: no r9"):
        await faults.run("kill", "r9")
    missing = Faults("custom", {"kill": "/nonexistent/bin/kill-it {replica}"})
    with pytest.raises(FaultError, match="cannot run /nonexistent/bin/kill-it"):
        await missing.run("kill", "r9")
