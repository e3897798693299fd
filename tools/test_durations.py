"""Per-file test durations from pytest's JUnit XML (what `.ci/run` writes for `make test` and `make test-long`).

    python -m tools.test_durations .ci/results/test.xml .ci/results/test-long.xml [--doc docs/testing.md]

prints a Markdown table (file, tier, tests, seconds; slowest first, each tier's total last) and, with
`--doc`, writes it into the document between <!-- test-durations:start --> and <!-- test-durations:end -->
(nothing else in it changes). A file's tier is the name of its XML file: `test.xml` is `make test`, and
`test-serial.xml` its second run (the files that compare times, alone after the parallel workers). Each
tier's last line is its wall-clock time: with parallel workers, less than the sum of its tests' seconds.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import click

from tools.bench import MarkdownError, write_blocks

MARKERS = "test-durations"


def test_file(classname: str) -> str:
    """`tests.mcp_ha.test_x` or `tests.test_abuse.TestClass` as the file it names: `tests/mcp_ha/test_x.py`."""
    parts = classname.split(".")
    while len(parts) > 1 and parts[-1][:1].isupper():
        parts.pop()
    return "/".join(parts) + ".py"


def durations(junit: Path) -> tuple[dict[str, tuple[int, float]], float]:
    """Each test file in `junit`: how many tests it ran (skipped ones not counted) and their seconds, setup and
    teardown included; and the run's own wall-clock time, as pytest wrote it for its test suite."""
    tree = ET.parse(junit)
    files: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for case in tree.iter("testcase"):
        entry = files[test_file(case.get("classname", ""))]
        entry[0] += case.find("skipped") is None
        entry[1] += float(case.get("time", "0"))
    wall = sum(float(suite.get("time", "0")) for suite in tree.iter("testsuite"))
    return {name: (int(count), seconds) for name, (count, seconds) in files.items()}, wall


def tier(stem: str) -> str:
    """`test` as `make test`, and `test-serial` (make test's second run) as `make test`, alone."""
    return f"`make {stem.removesuffix('-serial')}`" + (", alone" if stem.endswith("-serial") else "")


def table(runs: dict[str, dict[str, tuple[int, float]]], walls: dict[str, float]) -> str:
    rows = sorted(
        ((seconds, name, run, count) for run, files in runs.items() for name, (count, seconds) in files.items()),
        key=lambda row: (-row[0], row[1]),
    )
    lines = ["| file | tier | tests | seconds |", "|---|---|---:|---:|"]
    lines += [f"| `{name}` | {tier(run)} | {count} | {seconds:.1f} |" for seconds, name, run, count in rows]
    for run, files in runs.items():
        count, seconds = sum(c for c, _ in files.values()), sum(s for _, s in files.values())
        lines.append(f"| **all** | {tier(run)} | {count} | {seconds:.1f} |")
        lines.append(f"| **wall clock** | {tier(run)} |  | {walls[run]:.1f} |")
    return "\n".join(lines)


@click.command()
@click.argument("junit", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--doc", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="write the table here")
def main(junit: tuple[Path, ...], doc: Path | None) -> None:
    found = {path.stem: durations(path) for path in junit}
    body = table({run: files for run, (files, _) in found.items()}, {run: wall for run, (_, wall) in found.items()})
    click.echo(body)
    if doc is not None:
        try:
            write_blocks(doc, {MARKERS: body})
        except MarkdownError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)


if __name__ == "__main__":
    main()
