"""`mcp-ha check`: the HA check from the command line.

    mcp-ha check http://127.0.0.1:8080/mcp --shape ha_shape.py --faults local --junit report.xml

Exit status: 0 when every promise held, 1 when one did not (each is listed), 2 when the check could not
run (a URL that does not answer as an HA server, a shape file that does not load or fit, bad options).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.status import Status

from .faults import PRESETS, VERBS, FaultError, parse_faults
from .options import DEFAULT_DURATION, DEFAULT_SESSIONS, KINDS, SUITE_NAMES
from .shape import ShapeError, load_shape

if TYPE_CHECKING:
    from .report import Report

# Piped output would otherwise wrap the table at 80 columns.
console = Console(width=None if sys.stdout.isatty() else 200)


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


@click.command()
@click.argument("url", required=False)
@click.option(
    "--shape",
    "shape_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A Python file defining `shape = Shape(...)`: how to drive this server (mcp_ha.ops.check.Shape).",
)
@click.option(
    "--faults",
    "faults_text",
    default=None,
    metavar="SET",
    help=f"How to inject faults: {', '.join(PRESETS)} ('docker compose' or 'docker-compose' to choose; "
    "'kubectl -n NAMESPACE'), or 'verb=command,...' with {replica} in each command "
    f"(verbs: {', '.join(VERBS)}). Without it, the checks that need a fault are skipped.",
)
@click.option(
    "--suite",
    type=click.Choice([*SUITE_NAMES, "all"]),
    default="all",
    show_default=True,
    help="lb (load balancing) or resilience (faults); all runs both.",
)
@click.option(
    "--clients",
    default=",".join(KINDS),
    show_default=True,
    help="The kinds of client to drive, comma-separated.",
)
@click.option(
    "--sessions",
    type=click.IntRange(1, 20),
    default=DEFAULT_SESSIONS,
    show_default=True,
    help="Sessions of each kind of client, per check.",
)
@click.option(
    "--duration",
    type=click.FloatRange(3, 120),
    default=DEFAULT_DURATION,
    show_default=True,
    help="Seconds of load in each check under load (at least; it goes on until the deployment is whole again).",
)
@click.option(
    "--junit", "junit_path", type=click.Path(dir_okay=False, path_type=Path), help="Also write JUnit XML here."
)
@click.option(
    "--node-clients",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="A folder whose node_modules holds @modelcontextprotocol/sdk, for the ts_sdk client (default: "
    "installed with npm ci into ~/.cache/mcp-ha when node and npm are present).",
)
@click.option(
    "-k",
    "select",
    metavar="TEXT",
    default=None,
    help="Run only the checks whose 'suite: name' holds TEXT, case aside (as pytest's -k for a word).",
)
@click.option("--list", "list_only", is_flag=True, help="Name the checks that would run, and run none.")
@click.option("-v", "--verbose", is_flag=True, help="Print each check and fault as it happens.")
def check(
    url: str | None,
    shape_path: Path | None,
    faults_text: str | None,
    suite: str,
    clients: str,
    sessions: int,
    duration: float,
    junit_path: Path | None,
    node_clients: Path | None,
    select: str | None,
    list_only: bool,
    verbose: bool,
) -> None:
    """Check a deployment of an MCP server built on mcp_ha keeps its HA promises, under faults."""
    suites = list(SUITE_NAMES) if suite == "all" else [suite]
    if list_only:
        from .runner import planned

        for name in (f"{s}: {n}" for s, n, _ in planned(suites, select)):
            click.echo(name)
        return
    if url is None or shape_path is None:
        raise click.UsageError("give the URL and --shape (or --list)")
    # Retries and broken connections are the point of the run, not news: the table counts them. The
    # server's own log notifications (FastMCP's clients print them) are not the check's either.
    logging.basicConfig(level=logging.CRITICAL)
    logging.getLogger("fastmcp").setLevel(logging.CRITICAL)
    kinds = _kinds(clients)
    try:
        faults = parse_faults(faults_text) if faults_text else None
        shape = load_shape(shape_path)
    except (FaultError, ShapeError) as exc:
        _fail(str(exc))
        return
    if junit_path is not None:
        try:  # its folders made now, as pytest's --junitxml does: not found unwritable after the whole run
            junit_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            _fail(f"--junit {junit_path}: {exc.strerror or exc}")
            return

    # What drives the clients, imported once the options are read: `--help` and a bad option answer at once.
    from .checks import CheckSetupError
    from .runner import run_check

    def say(text: str) -> None:
        if verbose:
            console.print(f"[dim]{text}[/dim]", markup=True)

    try:
        with console.status(f"checking {url}") as status:
            progress = Progress(url, status if console.is_terminal else None)
            report = asyncio.run(
                run_check(
                    url,
                    shape,
                    faults=faults,
                    suites=suites,
                    clients=kinds,
                    sessions=sessions,
                    duration=duration,
                    node_clients=node_clients,
                    say=say,
                    select=select,
                    progress=progress,
                )
            )
    except (CheckSetupError, ShapeError) as exc:
        _fail(str(exc))
        return
    _show(report, junit_path)


class Progress:
    """`[n/N] suite: check`, with the time left at the pace of the checks done so far: on the spinner's
    line on a terminal, else a line of its own on stderr (a CI log)."""

    def __init__(self, url: str, spinner: Status | None) -> None:
        self.url = url
        self.spinner = spinner
        self.started = time.monotonic()

    def __call__(self, done: int, total: int, current: str) -> None:
        elapsed = time.monotonic() - self.started
        left = f", ~{elapsed / done * (total - done):.0f} s left" if done else ""
        line = f"[{done + 1}/{total}] {current}{left}"
        if self.spinner is not None:
            self.spinner.update(f"checking {self.url} {line}")
        else:
            click.echo(line, err=True)


def _kinds(clients: str) -> list[str]:
    """`--clients`: kinds of clients.KINDS, comma-separated."""
    kinds = [k.strip() for k in clients.split(",") if k.strip()]
    if unknown := [k for k in kinds if k not in KINDS]:
        raise click.BadParameter(
            f"unknown client {', '.join(unknown)}; choose from {', '.join(KINDS)}", param_hint="--clients"
        )
    return kinds


def _show(report: Report, junit_path: Path | None) -> None:
    """The summary, JUnit XML if asked for, each broken promise; exit 1 when one is."""
    from .report import summary_table, write_junit

    console.print(summary_table(report))
    if junit_path is not None:
        write_junit(report, junit_path)
        console.print(f"JUnit XML written to {junit_path}")
    if not report.ok:
        console.print("[red]promises broken:[/red]")
        for line in report.failures():
            console.print(f"  - {line}", markup=False)
        sys.exit(1)
    console.print("[green]every promise held[/green]")


if __name__ == "__main__":
    check()
