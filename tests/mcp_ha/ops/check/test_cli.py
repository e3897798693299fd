"""mcp_ha/ops/check/cli.py: `mcp-ha check`, run as a user runs it: exit 0 when every promise holds, 1 when
one does not, 2 when the check cannot run (bad options, a shape file that does not load, a URL that
does not answer)."""

from __future__ import annotations

import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import ROOT, running_stack, starts

from mcp_ha.ops.check.cli import check
from mcp_ha.ops.cli import main
from mcp_ha.ops.stack import Stack

MCP_HA = Path(sys.executable).parent / "mcp-ha"
LYING_SHAPE = """
from mcp_ha.ops.check import Call, Shape

# Claims one write more than the server holds: every session looks as if a write was applied twice.
shape = Shape(write=Call("increment_counter"), read=Call("get_counter"), count=lambda r: r["counter"] + 1)
"""


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.quick
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--shape", "nowhere.py"], "nowhere.py: no such file"),
        (["--shape", "ha_shape.py", "--faults", "chaos"], "one of local, compose, kubectl"),
        (["--shape", "ha_shape.py", "--clients", "plain,telnet"], "unknown client telnet"),
        (["--shape", "ha_shape.py", "--suite", "speed"], "'speed' is not one of"),
    ],
)
def test_bad_options_exit_2_with_a_plain_message(args: list[str], says: str) -> None:
    result = CliRunner().invoke(check, ["http://127.0.0.1:9/mcp", *args], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output


@pytest.mark.quick
def test_an_unreachable_url_exits_2_with_a_plain_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    url = f"http://127.0.0.1:{closed_port()}/mcp"
    result = CliRunner().invoke(check, [url, "--shape", "ha_shape.py"], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert f"error: {url} does not answer" in result.output and "Traceback" not in result.output


@pytest.mark.quick
def test_a_junit_path_that_cannot_be_written_exits_2_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    (tmp_path / "a-file").write_text("")
    junit = tmp_path / "a-file" / "report.xml"
    result = CliRunner().invoke(check, ["http://127.0.0.1:9/mcp", "--shape", "ha_shape.py", "--junit", str(junit)])
    assert result.exit_code == 2, result.output
    assert f"error: --junit {junit}:" in result.output and "Traceback" not in result.output


@pytest.mark.slow
def test_ctrl_c_exits_130_not_1_like_a_broken_promise() -> None:
    """Interrupted mid-run (its first request taken by a server that never answers), the check exits 130 as a
    shell, pytest or docker compose does: a CI job tells a run stopped by hand from a broken promise (1).

    Started as a shell starts it: with SIGINT's default action. A pytest-xdist worker ignores SIGINT, and a
    child inherits that, so Python would install no KeyboardInterrupt at all."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        argv = [str(MCP_HA), "check", f"http://127.0.0.1:{server.getsockname()[1]}/mcp", "--shape", "ha_shape.py"]
        default_sigint = (
            f"import os, signal; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv({argv[0]!r}, {argv!r})"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", default_sigint],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            server.settimeout(60)
            connection, _ = server.accept()  # the check has begun: its first request is here, unanswered
            with connection:
                proc.send_signal(signal.SIGINT)
                out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 130, (out, err)
    assert "Aborted!" in err and "Traceback" not in out + err


@pytest.mark.process
@pytest.mark.parametrize(
    "code",
    [
        "from mcp_ha.ops.cli import main\ntry:\n    main(['check', '--help'])\nexcept SystemExit:\n    pass",
        "from mcp_ha.ops.check import Call, Shape",  # what a shape file imports
    ],
)
def test_help_and_a_shape_file_load_nothing_that_drives_a_client(code: str) -> None:
    """`mcp-ha check --help` took 5.9 s importing FastMCP's and the SDK's clients it never used there."""
    heavy = "print(sorted({m.split('.')[0] for m in sys.modules} & {'fastmcp', 'mcp', 'httpx2', 'redis'}))"
    done = subprocess.run(
        [sys.executable, "-c", f"import sys\n{code}\n{heavy}"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


@pytest.mark.quick
def test_list_names_the_checks_k_selects_and_neither_needs_a_deployment() -> None:
    from mcp_ha.ops.check.checks import SUITES

    every = CliRunner().invoke(check, ["--list"])
    assert every.exit_code == 0 and every.output.splitlines() == [
        f"{suite}: {name}" for suite, checks in SUITES.items() for name, _ in checks
    ]
    kills = CliRunner().invoke(check, ["--list", "-k", "KILL -9", "--suite", "resilience"])
    assert kills.output.splitlines() == ["resilience: kill -9 between calls", "resilience: kill -9 under load"]


@pytest.mark.quick
def test_a_selection_that_names_no_check_exits_2_before_touching_the_deployment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(ROOT)
    url = f"http://127.0.0.1:{closed_port()}/mcp"  # nothing answers there: it is never asked
    result = CliRunner().invoke(check, [url, "--shape", "ha_shape.py", "-k", "no such check"])
    assert result.exit_code == 2 and "no check's name holds 'no such check'" in result.output, result.output
    assert CliRunner().invoke(check, ["--shape", "ha_shape.py"]).exit_code == 2  # no URL, no --list


def test_the_suites_the_command_offers_are_the_suites_there_are() -> None:
    from mcp_ha.ops.check.checks import SUITES
    from mcp_ha.ops.check.options import SUITE_NAMES

    assert tuple(SUITES) == SUITE_NAMES


def test_the_version_is_the_installed_packages() -> None:
    result = CliRunner().invoke(main, ["--version"], prog_name="mcp-ha")
    assert result.exit_code == 0 and result.output == f"mcp-ha {importlib.metadata.version('mcp-ha-kit')}\n"


@pytest.fixture(scope="module")
@starts("redis", "haproxy", "slow")
def demo_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("check-cli")) as s:
        yield s


def mcp_ha(stack: Stack, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "STACK_DIR": str(stack.config.state_dir)}
    return subprocess.run(
        [str(MCP_HA), "check", stack.config.mcp_url, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )


@pytest.mark.timeout(300)
def test_the_command_checks_a_local_stack_and_writes_junit(demo_stack: Stack, tmp_path: Path) -> None:
    junit = tmp_path / "reports" / "check" / "report.xml"  # its folders made, as pytest's --junitxml does
    done = mcp_ha(
        demo_stack,
        "--shape",
        "ha_shape.py",
        "--faults",
        "local",
        "--suite",
        "lb",
        "--clients",
        "plain,fastmcp_legacy",
        "--junit",
        str(junit),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every promise held" in done.stdout and "replica gone" in done.stdout
    # Piped, its progress is a line per check on stderr, with the time left from the second on.
    progress = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert progress[0] == "[1/4] lb: health" and progress[-1].startswith("[4/4] lb: replica gone, ~"), progress
    [suite] = ET.parse(junit).getroot().iter("testsuite")
    assert suite.get("name") == "lb" and suite.get("failures") == "0" and suite.get("skipped") == "0"
    cases = {c.get("name") for c in suite.iter("testcase")}
    assert cases == {
        "health [-]",
        "sticky [plain]",
        "sticky [fastmcp_legacy]",
        "spread [plain]",
        "replica gone [plain]",
    }
    assert [demo_stack.state(n) for n in demo_stack.config.replica_names()] == ["running"] * 3


@pytest.mark.timeout(300)
def test_a_broken_promise_exits_1_and_is_named(demo_stack: Stack, tmp_path: Path) -> None:
    shape = tmp_path / "lying_shape.py"
    shape.write_text(LYING_SHAPE)
    junit = tmp_path / "report.xml"
    done = mcp_ha(demo_stack, "--shape", str(shape), "--suite", "lb", "--clients", "plain", "--junit", str(junit))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "promises broken" in done.stdout and "sticky [plain]" in done.stdout
    assert "applied twice" in done.stdout
    failures = [c for c in ET.parse(junit).getroot().iter("testcase") if c.find("failure") is not None]
    assert [c.get("name") for c in failures] == ["sticky [plain]"]
    # Without faults, the check that needs one is skipped, not failed.
    skipped = [c for c in ET.parse(junit).getroot().iter("testcase") if c.find("skipped") is not None]
    assert [c.get("name") for c in skipped] == ["replica gone [plain]"]


@pytest.mark.timeout(300)
def test_a_task_killed_mid_run_is_checked_with_the_task_client_alone(demo_stack: Stack, tmp_path: Path) -> None:
    """The demo's analyze_data runs as a task for FastMCP's tasks client: the replica running it is killed and
    the client's call completes. A run with no kind that resumes streams has no streamed-call result at all."""
    pytest.importorskip("fastmcp_tasks", reason="the task client needs the kit's tasks extra")
    junit = tmp_path / "report.xml"
    args = ["--shape", "ha_shape.py", "--faults", "local", "--suite", "resilience", "--clients", "fastmcp_tasks"]
    done = mcp_ha(demo_stack, *args, "--junit", str(junit))
    assert done.returncode == 0, done.stdout + done.stderr
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert "task killed mid-run [fastmcp_tasks]" in cases, sorted(cases)
    assert not any(name.startswith("streamed call") for name in cases), sorted(cases)
    assert "taken over by mcp-server-" in done.stdout
    assert [demo_stack.state(n) for n in demo_stack.config.replica_names()] == ["running"] * 3


@pytest.mark.timeout(300)
@pytest.mark.redis
@pytest.mark.haproxy
@pytest.mark.slow
def test_a_balancer_killed_under_load_keeps_every_session_on_its_replica(tmp_path: Path) -> None:
    """One of the two HAProxys killed mid-load: the raw client loses at most its call in flight and no session
    moves; the Python SDK's client, which never works again after a dropped connection, is noted, not failed."""
    junit = tmp_path / "report.xml"
    args = ["--shape", "ha_shape.py", "--faults", "local", "--suite", "resilience", "--clients", "plain,python_sdk"]
    with running_stack(tmp_path / "pair", balancers=2) as pair:
        done = mcp_ha(pair, *args, "--junit", str(junit))
        states = [pair.state(n) for n in pair.config.balancer_names()]
    assert done.returncode == 0, done.stdout + done.stderr
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    for kind in ("plain", "python_sdk"):
        case = cases[f"balancer killed under load [{kind}]"]
        assert case.find("failure") is None and case.find("skipped") is None, ET.tostring(case)
    assert states == ["running"] * 2
