"""mcp_ha/ops/check/node.py: where the TypeScript SDK client runs from, and why it cannot."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import ROOT

from mcp_ha.ops.check.node import PINS, SCRIPT, node_clients_missing, prepare

pytestmark = pytest.mark.quick


def test_the_shipped_pins_name_the_sdk_the_kit_tests() -> None:
    shipped = json.loads((PINS / "package.json").read_text())["dependencies"]
    tested = json.loads((ROOT / "tests" / "clients" / "ts" / "package.json").read_text())["dependencies"]
    assert shipped == {"@modelcontextprotocol/sdk": tested["@modelcontextprotocol/sdk"]}
    lock = json.loads((PINS / "package-lock.json").read_text())
    assert lock["packages"]["node_modules/@modelcontextprotocol/sdk"]["version"] == shipped["@modelcontextprotocol/sdk"]


def test_a_folder_without_the_sdk_is_refused_by_name(tmp_path: Path) -> None:
    if shutil.which("node") is None:
        assert node_clients_missing(tmp_path) == "node is not installed"
    else:
        assert (
            node_clients_missing(tmp_path)
            == f"{tmp_path} holds no node_modules/@modelcontextprotocol/sdk (npm ci there)"
        )


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_a_given_folder_is_linked_to_never_written_into(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    given = tmp_path / "clients"
    (given / "node_modules" / "@modelcontextprotocol" / "sdk").mkdir(parents=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = prepare(given)
    assert (folder / "node_modules").resolve() == given / "node_modules"
    assert (folder / SCRIPT.name).read_bytes() == SCRIPT.read_bytes()
    assert sorted(p.name for p in given.iterdir()) == ["node_modules"]
    assert prepare(given) == folder  # the same folder, each run
