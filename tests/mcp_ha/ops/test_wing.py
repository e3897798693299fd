"""The ops wing (mcp_ha/ops/) is its own: the layer a server imports never imports it, and its dependencies
are an extra a server does not install."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT

from mcp_ha.ops import OPS_EXTRA

LAYER = ROOT / "mcp_ha"
WING = LAYER / "ops"


def _imports(path: Path) -> set[str]:
    """The absolute names `path` imports, relative imports resolved against its package."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            module = f"{base}.{node.module}" if node.level and node.module else (node.module or base)
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return found


def _layer_files() -> list[Path]:
    return [path for path in LAYER.rglob("*.py") if WING not in path.parents]


def test_no_module_of_the_layer_imports_the_ops_wing() -> None:
    reached = {
        str(path.relative_to(ROOT)): sorted(name for name in _imports(path) if name.startswith("mcp_ha.ops"))
        for path in _layer_files()
    }
    assert len(reached) > 20, "the layer's modules were not found"
    assert {path: names for path, names in reached.items() if names} == {}


def test_the_layer_imports_none_of_the_wings_dependencies() -> None:
    """click, rich and cryptography are the ops extra: a module of the layer importing one would fail on an
    install without it (FastMCP happens to bring click and rich today; nothing promises it will)."""
    used = {
        str(path.relative_to(ROOT)): sorted(
            name for name in _imports(path) if name.split(".")[0] in OPS_EXTRA and not name.startswith("mcp_ha")
        )
        for path in _layer_files()
    }
    assert {path: names for path, names in used.items() if names} == {}


def test_the_ops_extra_is_what_the_wing_needs_and_no_core_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("[")[0].split("=")[0].strip() for dep in project["optional-dependencies"]["ops"]}
    assert names == set(OPS_EXTRA)
    core = {dep.split(">")[0].split("[")[0].split("=")[0].strip() for dep in project["dependencies"]}
    assert core.isdisjoint(OPS_EXTRA), core & set(OPS_EXTRA)


@pytest.mark.process
def test_a_server_built_on_the_layer_loads_nothing_of_the_wing() -> None:
    """A whole server, its app wired, in a fresh interpreter: no module of mcp_ha.ops was imported."""
    probe = (
        "import sys\n"
        "from mcp_ha import HighAvailability, Settings\n"
        "ha = HighAvailability(Settings(metrics=True))\n"
        "mcp = ha.server('probe')\n"
        "ha.http_app(mcp)\n"
        "import mcp_ha.resilient_client, mcp_ha.session_store\n"
        "print(sorted(m for m in sys.modules if m.startswith('mcp_ha')))\n"
    )
    ran = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    loaded = ran.stdout.split("'")
    assert "mcp_ha.replica" in loaded, ran.stdout  # the probe did build a server
    assert not [m for m in loaded if m.startswith("mcp_ha.ops")], ran.stdout
