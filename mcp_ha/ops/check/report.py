"""What the HA check found: one result per check and client, a summary for people (a rich table), JUnit
XML for CI, and the exit status (0 every promise held, 1 one did not; 2 is the command's, for a run
that could not start)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table

from .load import Figures

PASS, FAIL, SKIP = "pass", "fail", "skip"
# The suites, named as the reference kit's test files: test_lb.py and test_resilience.py.


@dataclass
class CheckResult:
    """One check for one kind of client (`client` "-" when no client kind is involved)."""

    suite: str
    check: str
    client: str
    status: str
    reasons: list[str] = field(default_factory=list)  # why it failed, or was skipped
    figures: Figures | None = None
    note: str = ""  # what was done: the replica faulted, the replicas seen
    seconds: float = 0.0

    @property
    def title(self) -> str:
        return f"{self.check} [{self.client}]"


@dataclass
class Report:
    url: str
    faults: str
    replicas: list[str]
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(r.status != FAIL for r in self.results)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def failures(self) -> list[str]:
        """Each broken promise as a sentence: the check, the client, why."""
        return [f"{r.suite}: {r.title}: {reason}" for r in self.results if r.status == FAIL for reason in r.reasons]


def _figures_cells(f: Figures | None) -> tuple[str, str, str]:
    if f is None:
        return "", "", ""
    effects = "" if f.final is None and f.unreadable == 0 else f"lost {f.lost}, doubled {f.doubled}"
    if f.unreadable:
        effects += f", {f.unreadable} unread"
    return f"{f.failed} failed / {f.calls}", f"{f.longest_call_s:.2f} s", effects


def summary_table(report: Report) -> Table:
    """One line per check and client: calls failed, the longest call, effects lost or doubled, the verdict."""
    table = Table(
        title=f"HA check of {report.url} ({len(report.replicas)} replicas seen: {', '.join(report.replicas)}; "
        f"faults: {report.faults}; {report.seconds:.0f} s)",
        title_justify="left",
    )
    for column in ("suite", "check", "client", "calls", "longest", "effects", "", "note"):
        table.add_column(column)
    colour = {PASS: "green", FAIL: "red", SKIP: "yellow"}
    for r in report.results:
        calls, longest, effects = _figures_cells(r.figures)
        note = r.note if r.status == PASS else "; ".join(r.reasons)
        table.add_row(
            r.suite, r.check, r.client, calls, longest, effects, f"[{colour[r.status]}]{r.status.upper()}[/]", note
        )
    return table


def junit_xml(report: Report) -> ET.ElementTree:
    """A testsuite per suite, a testcase per check and client; a failure or skipped element says why."""
    root = ET.Element("testsuites", name="mcp-ha check", time=f"{report.seconds:.2f}")
    for suite in dict.fromkeys(r.suite for r in report.results):
        results = [r for r in report.results if r.suite == suite]
        element = ET.SubElement(
            root,
            "testsuite",
            name=suite,
            tests=str(len(results)),
            failures=str(sum(r.status == FAIL for r in results)),
            skipped=str(sum(r.status == SKIP for r in results)),
            errors="0",
            time=f"{sum(r.seconds for r in results):.2f}",
        )
        for r in results:
            case = ET.SubElement(
                element, "testcase", classname=f"mcp-ha.{suite}", name=r.title, time=f"{r.seconds:.2f}"
            )
            if r.status == FAIL:
                ET.SubElement(case, "failure", message=r.reasons[0] if r.reasons else "failed").text = "\n".join(
                    r.reasons
                )
            elif r.status == SKIP:
                ET.SubElement(case, "skipped", message="; ".join(r.reasons))
            calls, longest, effects = _figures_cells(r.figures)
            out = "; ".join(part for part in (calls, f"longest {longest}" if longest else "", effects, r.note) if part)
            if out:
                ET.SubElement(case, "system-out").text = out
    ET.indent(root)
    return ET.ElementTree(root)


def write_junit(report: Report, path: str | Path) -> None:
    junit_xml(report).write(path, encoding="utf-8", xml_declaration=True)
