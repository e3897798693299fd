"""The layer installs from the repository, in the checkout's layout, and serves from outside it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UV = shutil.which("uv") or str(ROOT / ".tools" / "uv" / "bin" / "uv")

pytestmark = pytest.mark.timeout(300)


def test_the_wheel_holds_the_layer_and_installs_into_a_fresh_environment(tmp_path: Path) -> None:
    built = subprocess.run(
        [UV, "build", "--wheel", "--out-dir", str(tmp_path / "dist"), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "mcp_ha/replica.py",
        "mcp_ha/_sdk.py",
        "session_store.py",
        "stores/redis_store.py",
        "resilient_client.py",
    } <= names
    assert not {n for n in names if n.startswith(("tests/", "tools/", "examples/")) or n in ("server.py", "stack.py")}

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
        "import mcp_ha, session_store; from mcp_ha import HighAvailability, Settings; "
        "ha = HighAvailability(Settings(metrics=False)); app = ha.http_app(ha.server('installed')); "
        "print(mcp_ha.__file__)"
    )
    ran = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env
    )
    assert ran.returncode == 0, ran.stderr
    assert str(venv) in ran.stdout
