"""tools/test_durations.py: per-file durations from JUnit XML, written into a document between its markers."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from tools.test_durations import main

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4" time="6.0">
<testcase classname="tests.test_abuse.TestOneClient" name="test_a" time="2.5"/>
<testcase classname="tests.test_abuse" name="test_b" time="1.0"/>
<testcase classname="tests.mcp_ha.test_streams" name="test_c" time="7.25"/>
<testcase classname="tests.mcp_ha.test_streams" name="test_d" time="0.5"><skipped message="no"/></testcase>
</testsuite></testsuites>"""


SERIAL = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="1" time="4.5">
<testcase classname="tests.test_scale" name="test_e" time="4.0"/>
</testsuite></testsuites>"""


def test_the_table_sums_each_file_slowest_first_and_goes_between_the_markers_only(tmp_path: Path) -> None:
    junit, serial = tmp_path / "test.xml", tmp_path / "test-serial.xml"
    junit.write_text(JUNIT)
    serial.write_text(SERIAL)
    doc = tmp_path / "testing.md"
    before, after = "# Testing\n\nby hand\n", "\nafter, by hand\n"
    doc.write_text(f"{before}<!-- test-durations:start -->\nold figures\n<!-- test-durations:end -->{after}")
    result = CliRunner().invoke(main, [str(junit), str(serial), "--doc", str(doc)])
    assert result.exit_code == 0, result.output
    # Parallel workers ran the first: its wall clock (the suite's time) is less than its tests' sum.
    table = [
        "| file | tier | tests | seconds |",
        "|---|---|---:|---:|",
        "| `tests/mcp_ha/test_streams.py` | `make test` | 1 | 7.8 |",
        "| `tests/test_scale.py` | `make test`, alone | 1 | 4.0 |",
        "| `tests/test_abuse.py` | `make test` | 2 | 3.5 |",
        "| **all** | `make test` | 3 | 11.2 |",
        "| **wall clock** | `make test` |  | 6.0 |",
        "| **all** | `make test`, alone | 1 | 4.0 |",
        "| **wall clock** | `make test`, alone |  | 4.5 |",
    ]
    assert result.output.splitlines() == table
    expected = before + "<!-- test-durations:start -->\n" + "\n".join(table) + "\n<!-- test-durations:end -->" + after
    assert doc.read_text() == expected


def test_a_document_without_the_markers_is_refused_and_left_alone(tmp_path: Path) -> None:
    junit = tmp_path / "test-long.xml"
    junit.write_text(JUNIT)
    doc = tmp_path / "testing.md"
    doc.write_text("# Testing\n")
    result = CliRunner().invoke(main, [str(junit), "--doc", str(doc)])
    assert result.exit_code == 2
    assert "test-durations:start" in result.output
    assert doc.read_text() == "# Testing\n"
