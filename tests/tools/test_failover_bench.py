"""The failover benchmark's `--markdown FILE`, run as a user runs it: one short scenario on a stack of its own.

The scenarios themselves are held to their targets in tests/test_failover.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import ROOT

START, END = "<!-- failover:start -->", "<!-- failover:end -->"
BEFORE = "# Failover\r\n\nBy hand \u2014 kept as is.\n\n".encode()
AFTER = b"\n\n<!-- bench:start -->\nanother tool's figures\n<!-- bench:end -->\n"


def refused(*args: str) -> subprocess.CompletedProcess:
    """`run_failover_bench`, run in this process, for what it refuses before anything starts."""
    from tools.failover_bench import main

    done = CliRunner().invoke(main, list(args))
    return subprocess.CompletedProcess(args, done.exit_code, done.stdout, done.stderr)


def run_failover_bench(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.failover_bench", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.timeout(150)
@pytest.mark.process
def test_markdown_replaces_only_what_lies_between_the_markers(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_bytes(BEFORE + f"{START}\nfigures of an older run\n{END}".encode() + AFTER)
    done = run_failover_bench(
        "--scenario",
        "kill",
        "--own-stack",
        "--sessions",
        "1",
        "--duration",
        "3",
        "--fault-at",
        "1",
        "--markdown",
        str(doc),
        timeout=140,
    )
    # A missed target is the exit status's business (tests/test_failover.py); the figures are written either way.
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    data = doc.read_bytes()
    assert data.startswith(BEFORE + START.encode()) and data.endswith(END.encode() + AFTER)
    inside = data[len(BEFORE) + len(START) : len(data) - len(END) - len(AFTER)].decode()
    assert "older run" not in inside
    lines = inside.split("\n")
    provenance = next(line for line in lines if line.startswith("Measured "))
    assert f"nproc {len(os.sched_getaffinity(0))}" in provenance and f"Python {sys.version.split()[0]}" in provenance
    assert "`python -m tools.failover_bench --scenario kill --own-stack --sessions 1 --duration 3" in provenance
    header = next(line for line in lines if line.startswith("| scenario |"))
    assert "| client |" in header and "| marked down s |" in header and header.endswith("| targets |")
    rows = [line for line in lines if line.startswith("| kill |") or line.startswith("|  |  | ")]
    assert [row.split(" | ")[2] for row in rows[:3]] == ["plain", "resilient", "sessionless"], inside
    assert ("Every target met." in lines) == (done.returncode == 0), inside


@pytest.mark.quick
@pytest.mark.parametrize(
    "text", ["no markers\n", f"{START}\n", f"{END}\n{START}\n", "<!-- bench:start -->\n<!-- bench:end -->\n"]
)
def test_a_markdown_file_without_its_markers_is_refused_before_anything_runs(tmp_path: Path, text: str) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(text)
    done = refused("--scenario", "kill", "--own-stack", "--markdown", str(doc))
    assert done.returncode == 2, done.stdout + done.stderr
    assert START in done.stderr and END in done.stderr and str(doc) in done.stderr.replace("\n", "")
    assert "Traceback" not in done.stderr and "starting a stack" not in done.stdout
    assert doc.read_text() == text
