"""The layer installs from the repository as one top-level name, beside a current FastMCP, and serves from anywhere."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from xml.etree import ElementTree

import pytest
from conftest import scrubbed, stack_ports, starts

ROOT = Path(__file__).resolve().parent.parent
UV = shutil.which("uv") or str(ROOT / ".tools" / "uv" / "bin" / "uv")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
@starts("slow")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run(
        [UV, "build", "--wheel", "--out-dir", str(out), str(ROOT)], capture_output=True, text=True, timeout=240
    )
    assert built.returncode == 0, built.stderr
    (found,) = out.glob("*.whl")
    return found


def _metadata(wheel: Path) -> str:
    archive = zipfile.ZipFile(wheel)
    (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
    return archive.read(name).decode()


def test_the_wheel_installs_one_top_level_name_with_its_types_and_haproxy_config(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "mcp_ha/replica.py",
        "mcp_ha/_sdk.py",
        "mcp_ha/session_store.py",
        "mcp_ha/stores/redis_store.py",
        "mcp_ha/resilient_client.py",
        "mcp_ha/ops/stack.py",
        "mcp_ha/py.typed",
        "mcp_ha/haproxy/haproxy.cfg",
        "mcp_ha/haproxy/refuse_body.lua",
        "mcp_ha/deploy/docker-compose.yaml",
        "mcp_ha/deploy/kubernetes/kustomization.yaml",
    } <= names
    assert not [n for n in names if n.endswith("secrets.env")]
    # Every file `mcp-ha deploy` writes out, where the installed kit looks for it.
    from mcp_ha.ops.deploy_files import FILES

    for path in {path for files in FILES.values() for path in files}:
        shipped = path if path.startswith(("haproxy/", "deploy/")) else f"deploy/{path}"
        assert f"mcp_ha/{shipped}" in names, path
    top = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert top == {"mcp_ha"}
    # The wheel's haproxy.cfg is the checkout's: one file for every deployment.
    assert zipfile.ZipFile(wheel).read("mcp_ha/haproxy/haproxy.cfg") == (ROOT / "haproxy" / "haproxy.cfg").read_bytes()


def _third_party_imports() -> set[str]:
    """Top-level modules the shipped code imports that are neither the standard library nor mcp_ha."""
    found = set()
    for path in (ROOT / "mcp_ha").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m not in ("mcp_ha", "__future__")}


def _requires(dist: str) -> list[str]:
    try:
        return [r for r in importlib.metadata.requires(dist) or [] if "extra ==" not in r]
    except importlib.metadata.PackageNotFoundError:
        return []


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_import_is_declared_and_every_declaration_imported(wheel: Path) -> None:
    metadata = _metadata(wheel)
    declared = {
        _normal(re.split(r"[\s\[<>=!~;]", line.split(":", 1)[1].strip(), maxsplit=1)[0])
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:")
    }
    dists = importlib.metadata.packages_distributions()
    providers = {m: {_normal(d) for d in dists.get(m, [m])} for m in _third_party_imports()}
    # A declared distribution covers what it brings directly: fastmcp is fastmcp-slim's client and server.
    covers = {d: {d} | {_normal(re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0]) for r in _requires(d)} for d in declared}
    uncovered = {m for m, by in providers.items() if not any(by & covered for covered in covers.values())}
    assert uncovered == set(), "imported by mcp_ha but not declared"
    unused = {d for d, covered in covers.items() if not any(by & covered for by in providers.values())}
    assert unused == set(), "declared but imported by nothing in mcp_ha"
    # Ranges, not pins, so a project on a newer FastMCP can install the kit; uv.lock pins what CI tests.
    fastmcp = next(line for line in metadata.splitlines() if re.match(r"Requires-Dist: fastmcp\b", line))
    assert "==" not in fastmcp and "<" in fastmcp
    # The ops wing's dependencies are an extra (its old name, stack, still installs it), never the layer's.
    assert re.search(r"^Provides-Extra: ops$", metadata, re.M) and re.search(r"^Provides-Extra: stack$", metadata, re.M)
    core = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert not [line for line in core if re.match(r"Requires-Dist: (click|rich|cryptography)\b", line)], core


def test_the_metadata_says_its_license_and_the_one_python_ci_tests(wheel: Path) -> None:
    """What an index page and a packager read: the license as an SPDX expression with its file, and the Python
    versions as classifiers, claiming only the one CI runs (README: 3.12 and 3.13 untested)."""
    lines = _metadata(wheel).splitlines()
    assert "License-Expression: MIT" in lines and "License-File: LICENSE" in lines
    versions = [line for line in lines if re.match(r"Classifier: Programming Language :: Python :: 3\.\d+$", line)]
    assert versions == [
        f"Classifier: Programming Language :: Python :: {sys.version_info.major}.{sys.version_info.minor}"
    ]
    assert "Classifier: Typing :: Typed" in lines and "Requires-Python: >=3.11" in lines
    assert "LICENSE" in {Path(n).name for n in zipfile.ZipFile(wheel).namelist()}


def test_the_wheel_installs_into_a_fresh_environment_and_serves_from_outside_the_checkout(
    wheel: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    for argv in (
        [UV, "venv", "--python", sys.executable, str(venv)],
        [UV, "pip", "install", "--python", str(venv / "bin" / "python"), str(wheel)],
    ):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env)
        assert done.returncode == 0, done.stderr
    # From a directory that is not the checkout, so only the installed copy can be imported.
    probe = (
        "import mcp_ha; from mcp_ha import HighAvailability, Settings; "
        "from mcp_ha.session_store import SessionStore; "
        "ha = HighAvailability(Settings(metrics=False)); app = ha.http_app(ha.server('installed')); "
        "print(mcp_ha.__file__)"
    )
    ran = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env
    )
    assert ran.returncode == 0, ran.stderr
    assert str(venv) in ran.stdout
    listed = subprocess.run([venv / "bin" / "mcp-ha", "--help"], capture_output=True, text=True, timeout=60, env=env)
    assert listed.returncode == 0 and {"stack", "check"} <= set(listed.stdout.split())


# The newest FastMCP when this was written: a project on it installs the kit beside it.
NEWER_FASTMCP = "fastmcp==4.2.3"

USERS_SERVER = '''
"""A user's own server, in a folder of its own: a tally per session."""
from fastmcp import Context

from mcp_ha import HighAvailability, SessionHandle

ha = HighAvailability.from_env()
mcp = ha.server("tally")


@mcp.tool
async def bump(ctx: Context, session_id: SessionHandle = None) -> dict:
    session = await ha.session(ctx, session_id)
    return {"tally": await session.incr("tally")}


@mcp.tool
async def tally(ctx: Context, session_id: SessionHandle = None) -> dict:
    session = await ha.session(ctx, session_id)
    return {"tally": await session.get("tally", 0)}


app = ha.http_app(mcp)

if __name__ == "__main__":
    ha.run(app)
'''

USERS_SHAPE = """
from mcp_ha.ops.check import Call, Shape

shape = Shape(write=Call("bump"), read=Call("tally"), count=lambda result: result["tally"])
"""


@pytest.mark.timeout(900)
def test_a_server_in_its_own_project_runs_as_the_stack_and_passes_the_ha_check(wheel: Path, tmp_path: Path) -> None:
    """The issue's new user: an empty folder and virtual environment, the kit installed from the repository
    beside a newer FastMCP; their server runs as the local stack, survives a rolling restart started from
    another shell, and the HA check run from their folder passes and writes JUnit XML."""
    venv, project, elsewhere = tmp_path / "venv", tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "STACK_DIR")}
    kit = f"mcp-ha-kit[ops] @ {wheel.as_uri()}"
    for argv in (
        [UV, "venv", "--python", sys.executable, str(venv)],
        [UV, "pip", "install", "--python", str(venv / "bin" / "python"), kit, NEWER_FASTMCP],
    ):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr
    (project / "tally_server.py").write_text(USERS_SERVER)
    (project / "ha_shape.py").write_text(USERS_SHAPE)
    mcp_ha = str(venv / "bin" / "mcp-ha")
    ports = stack_ports(3)
    user_env = {**env, **ports, "PATH": f"{venv / 'bin'}:{env['PATH']}"}

    def run(argv: list[str], cwd: Path, run_env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=cwd, env=run_env, capture_output=True, text=True, timeout=timeout)

    up = run([mcp_ha, "stack", "up", "-d", "--server", "tally_server"], project, user_env, 240)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        # Another shell: elsewhere, with none of the first one's variables.
        other_shell = scrubbed(PATH=user_env["PATH"])
        stack_dir = str(project / ".stack")
        replicas = ["mcp-server-1", "mcp-server-2", "mcp-server-3"]
        rolled = run([mcp_ha, "stack", "--stack-dir", stack_dir, "restart", *replicas], elsewhere, other_shell, 300)
        assert rolled.returncode == 0, rolled.stdout + rolled.stderr
        url = f"http://127.0.0.1:{ports['MCP_HTTP_PORT']}/mcp"
        report = project / "report.xml"
        # Lean: two kinds of client, one session each. The full check, every kind of client, runs on each
        # example's server shape in tests/examples/test_servers.py; here it is the user's install that is tested.
        lean = ["--clients", "plain,resilient", "--sessions", "1"]
        checked = run(
            [mcp_ha, "check", url, "--shape", "ha_shape.py", "--faults", "local", *lean, "--junit", str(report)],
            project,
            user_env,
            600,
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
        suites = ElementTree.parse(report).getroot()
        cases = suites.findall(".//testcase")
        assert cases and not suites.findall(".//failure") and not suites.findall(".//error")
        names = " ".join(case.get("name", "") for case in cases)
        assert "kill" in names and "retr" in names, names  # the resilience suite ran, not only the easy checks
    finally:
        run([mcp_ha, "stack", "down"], project, user_env, 120)
