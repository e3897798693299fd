"""The performance benchmark (tools/bench.py), run as a user runs it: `--quick --own-stack --json`.

Only generous ratio bounds, never absolute times: this machine is shared and
noisy, and the benchmark's own targets are for the full run (see the README).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from stack import free_ports


def run_bench(*args: str, env: dict[str, str] | None = None, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.bench", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


START, END = "<!-- bench:start -->", "<!-- bench:end -->"
# Around the markers: what --markdown must leave byte for byte (CRLF, a BOM-less UTF-8 dash, no final newline).
BEFORE = "# Benchmarks\r\n\nWritten by hand \u2014 kept as is.\n\n".encode()
AFTER = b"\n\nMore by hand: | a | b |\r\n<!-- bench:start? not a marker -->"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One quick run, with every output asked for."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    chart = out.with_suffix(".png")
    doc = out.with_suffix(".md")
    doc.write_bytes(BEFORE + f"{START}\nfigures of an older run\n{END}".encode() + AFTER)
    done = run_bench("--quick", "--own-stack", "--json", str(out), "--chart", str(chart), "--markdown", str(doc))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert chart.stat().st_size > 10_000
    return {"report": json.loads(out.read_text()), "doc": doc.read_bytes(), "doc_path": doc}


@pytest.fixture(scope="module")
def report(run: dict) -> dict:
    return run["report"]


def sane(stats: dict) -> None:
    assert stats["calls"] > 0 and stats["ok"] == stats["calls"] and stats["errors"] == 0, stats
    assert 0 < stats["p50_ms"] <= stats["p95_ms"] <= stats["p99_ms"], stats


@pytest.mark.timeout(180)
def test_every_section_is_there_with_sane_values(report: dict) -> None:
    assert report["ok"] and report["errors"] == []
    setups = report["throughput"]["setups"]
    assert set(setups) == {"haproxy", "direct", "floor"}
    for stats in setups.values():
        sane(stats)
        assert stats["calls_per_s"] > 0
    # Through HAProxy, the sessions are spread over the replicas; directly, one replica answers.
    assert len(setups["haproxy"]["instances"]) >= 2
    assert list(setups["direct"]["instances"]) == ["mcp-server-1"]
    assert set(report["throughput"]["ratios"]) >= {"haproxy_vs_floor_throughput", "haproxy_vs_direct_throughput"}
    sane(report["proxy_hop"]["haproxy"])
    sane(report["proxy_hop"]["direct"])
    assert report["proxy_hop"]["hop_p50_ms"] is not None
    levels = [lv["sessions_in_store"] for lv in report["scale"]["levels"]]
    assert levels == [0, 10_000, 100_000, 0]
    for lv in report["scale"]["levels"]:
        sane(lv)
    memory = report["memory"]
    # Bytes are not timings: the budget is asserted as it stands.
    assert 0 < memory["resident"] <= 288
    assert memory["memory_usage_per_key"]["events"] > 0 and memory["memory_usage_per_key"]["op_keys"] == 4
    assert 0 < memory["used_memory_at_rest_per_session"] < memory["used_memory_delta_per_session"]
    durability = report["durability"]
    sane(durability["no_wait"])
    sane(durability["wait_1"])
    assert durability["throughput_ratio"] is not None and durability["share_of_call_p50"] is not None
    assert len(report["targets"]) == 4 and all(isinstance(t["holds"], bool) for t in report["targets"])


@pytest.mark.timeout(180)
def test_ratios_within_generous_bounds(report: dict) -> None:
    ratios = report["throughput"]["ratios"]
    assert (
        ratios["haproxy_vs_floor_throughput"] >= 0.10
    )  # the target is 0.5; quick runs here give ~0.25, so 0.2 would be flaky
    assert ratios["haproxy_vs_direct_throughput"] >= 0.3
    scale = report["scale"]["p50_ratio_to_0"]
    assert scale["100000"] <= 3 and scale["100000"] / scale["10000"] <= 3


def test_an_unreachable_compare_url_exits_non_zero_with_a_plain_message() -> None:
    (port,) = free_ports(1)
    done = run_bench("--quick", "--compare", f"http://127.0.0.1:{port}/mcp", timeout=60)
    assert done.returncode == 2
    assert f"could not open a session at http://127.0.0.1:{port}/mcp" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_non_loopback_compare_url_is_refused() -> None:
    done = run_bench("--quick", "--compare", "http://192.0.2.1/mcp", timeout=60)
    assert done.returncode == 2 and "only runs against loopback" in done.stderr


def test_a_stack_that_is_not_up_exits_non_zero_with_a_plain_message(tmp_path: Path) -> None:
    http, stats, redis, replica = free_ports(4)
    env = {
        "STACK_DIR": str(tmp_path),
        "MCP_HTTP_PORT": str(http),
        "MCP_STATS_PORT": str(stats),
        "REDIS_PORT": str(redis),
        "MCP_BASE_PORT": str(replica),
        "MCP_REPLICAS": "1",
    }
    done = run_bench("--quick", env=env, timeout=60)
    assert done.returncode == 2
    assert "is not up and healthy" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.timeout(120)
def test_a_tool_that_errors_exits_non_zero_before_anything_is_measured() -> None:
    done = run_bench("--quick", "--own-stack", "--mix", "no_such_tool", timeout=110)
    assert done.returncode == 2
    assert "the tool 'no_such_tool' fails" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.timeout(180)
def test_markdown_replaces_only_what_lies_between_the_markers(run: dict) -> None:
    doc: bytes = run["doc"]
    assert doc.startswith(BEFORE + START.encode()) and doc.endswith(END.encode() + AFTER)
    inside = doc[len(BEFORE) + len(START) : len(doc) - len(END) - len(AFTER)].decode()
    assert "older run" not in inside
    lines = inside.split("\n")
    provenance = next(line for line in lines if line.startswith("Measured "))
    assert f"nproc {len(os.sched_getaffinity(0))}" in provenance and f"Python {sys.version.split()[0]}" in provenance
    assert f"`python -m tools.bench --quick --own-stack --json {run['doc_path'].with_suffix('.json')}" in provenance
    assert "| setup | calls | errors | calls/s | p50 ms | p95 ms | p99 ms | answered by |" in lines
    setups = run["report"]["throughput"]["setups"]
    for name, stats in setups.items():
        assert any(line.startswith(f"| {name} | {stats['calls']} | 0 | ") for line in lines), (name, inside)
    resident = run["report"]["memory"]["resident"]
    assert any(
        line.startswith("| resident: mcp:session:\\<id> ") and line.endswith(f"| {resident:.0f} |") for line in lines
    ), inside
    targets = [line for line in lines[lines.index("| target | value | holds |") + 2 :] if line]
    assert len(targets) == 4 and all(line.endswith(("| holds |", "| missed |")) for line in targets), inside


@pytest.mark.quick
@pytest.mark.parametrize(
    "text", ["no markers at all\n", f"{START}\nonly the start\n", f"{END}\n{START}\n", f"{START}\n{START}\n{END}\n"]
)
def test_a_markdown_file_without_its_markers_is_refused_before_anything_runs(tmp_path: Path, text: str) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(text)
    done = run_bench("--quick", "--own-stack", "--markdown", str(doc), timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert START in done.stderr and END in done.stderr and str(doc) in done.stderr.replace("\n", "")
    assert "Traceback" not in done.stderr and "starting a stack" not in done.stdout
    assert doc.read_text() == text


@pytest.mark.quick
def test_a_chart_without_matplotlib_says_what_to_install() -> None:
    hidden = "import sys; sys.modules['matplotlib'] = None; from tools.bench import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", hidden, "--quick", "--own-stack", "--chart", "out.png"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "matplotlib" in done.stderr and "uv sync --group bench" in done.stderr
    assert "Traceback" not in done.stderr and "starting a stack" not in done.stdout
