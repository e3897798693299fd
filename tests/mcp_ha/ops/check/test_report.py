"""mcp_ha/ops/check/report.py: the verdict, the summary table and the JUnit XML."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from rich.console import Console

from mcp_ha.ops.check.load import Figures
from mcp_ha.ops.check.report import FAIL, PASS, SKIP, CheckResult, Report, summary_table, write_junit

pytestmark = pytest.mark.quick


def figures(**changes: object) -> Figures:
    base = {
        "kind": "plain",
        "sessions": 2,
        "calls": 40,
        "failed": 0,
        "overran": 0,
        "longest_call_s": 0.21,
        "acknowledged": 40,
        "final": 40,
        "lost": 0,
        "doubled": 0,
        "unreadable": 0,
        "errors": [],
    }
    return Figures(**{**base, **changes})  # type: ignore[arg-type]


def report(*results: CheckResult) -> Report:
    return Report("http://127.0.0.1:8080/mcp", "local", ["mcp-server-1", "mcp-server-2"], list(results), 12.5)


PASSED = CheckResult("resilience", "kill -9 under load", "plain", PASS, [], figures(), "kill mcp-server-1", 8.0)
SKIPPED = CheckResult("resilience", "pause under load", "ts_sdk", SKIP, ["kubectl cannot pause a pod's processes"])
FAILED = CheckResult(
    "resilience",
    "drain under load",
    "python_sdk",
    FAIL,
    ["2 call(s) started failed: HTTP 503", "1 acknowledged effect(s) lost (count 39, acknowledged 40)"],
    figures(kind="python_sdk", failed=2, lost=1, final=39),
    "",
    9.0,
)


def test_every_promise_held_exits_0_a_skip_is_no_failure() -> None:
    assert report(PASSED, SKIPPED).exit_code == 0 and report(PASSED, SKIPPED).failures() == []


def test_a_broken_promise_exits_1_and_is_listed() -> None:
    broken = report(PASSED, FAILED)
    assert broken.exit_code == 1 and not broken.ok
    assert broken.failures() == [
        "resilience: drain under load [python_sdk]: 2 call(s) started failed: HTTP 503",
        "resilience: drain under load [python_sdk]: 1 acknowledged effect(s) lost (count 39, acknowledged 40)",
    ]


def test_the_summary_has_a_line_per_check_and_client() -> None:
    console = Console(width=250, record=True)
    console.print(summary_table(report(PASSED, SKIPPED, FAILED)))
    text = console.export_text()
    line = next(row for row in text.splitlines() if "kill -9 under load" in row)
    assert "plain" in line and "0 failed / 40" in line and "0.21 s" in line and "lost 0, doubled 0" in line
    assert "PASS" in line and "kill mcp-server-1" in line
    assert "SKIP" in next(row for row in text.splitlines() if "pause under load" in row)
    failed = next(row for row in text.splitlines() if "drain under load" in row)
    assert "FAIL" in failed and "2 failed / 40" in failed and "lost 1" in failed


def test_junit_xml_has_a_suite_per_suite_and_a_case_per_check_and_client(tmp_path: Path) -> None:
    path = tmp_path / "report.xml"
    health = CheckResult("lb", "health", "-", PASS, [], None, "GET /health: 200")
    write_junit(report(health, PASSED, SKIPPED, FAILED), path)
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    assert set(suites) == {"lb", "resilience"}
    resilience = suites["resilience"]
    assert (resilience.get("tests"), resilience.get("failures"), resilience.get("skipped")) == ("3", "1", "1")
    cases = {c.get("name"): c for c in resilience.iter("testcase")}
    assert set(cases) == {"kill -9 under load [plain]", "pause under load [ts_sdk]", "drain under load [python_sdk]"}
    failure = cases["drain under load [python_sdk]"].find("failure")
    assert failure is not None and failure.get("message") == "2 call(s) started failed: HTTP 503"
    assert "acknowledged effect(s) lost" in (failure.text or "")
    skipped = cases["pause under load [ts_sdk]"].find("skipped")
    assert skipped is not None and "cannot pause" in (skipped.get("message") or "")
    assert cases["kill -9 under load [plain]"].find("failure") is None
    assert "longest 0.21 s" in (cases["kill -9 under load [plain]"].findtext("system-out") or "")
