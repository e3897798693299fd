"""`run_check`: the HA check's Python API, which `mcp-ha check` and the kit's own tests call.

    report = await run_check("http://127.0.0.1:8080/mcp", shape, faults=local(), suites=("lb",))
    report.ok, report.failures(), report.exit_code

It finds the replicas behind the URL (from the Mcp-Ha-Replica header), makes sure the shape fits the
server (a write and a read answer, and `count` reads an int), then runs each check of each suite in
turn, each bounded in time; a check that raises is a failed result, with the error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx2

from .checks import CHECK_TIMEOUT_SECONDS, SUITES, CheckFn, CheckSetupError, Context, discover
from .clients import PLAIN_CALL_TIMEOUT, ClientFactory
from .faults import Faults
from .load import error_text
from .node import NodeUnavailable, prepare
from .options import DEFAULT_DURATION, DEFAULT_SESSIONS, KINDS
from .report import FAIL, SKIP, CheckResult, Report
from .shape import Shape, ShapeError, load_shape
from .wire import CallFailed, RawSession


async def shape_fits(url: str, shape: Shape) -> None:
    """One write and two reads in a raw session; CheckSetupError when the server does not take them."""
    async with httpx2.AsyncClient(timeout=PLAIN_CALL_TIMEOUT) as http:
        session = RawSession(http, url, timeout=PLAIN_CALL_TIMEOUT, client_name="mcp-ha-check")
        try:
            await session.open()
            shape.count_of(await session.call_tool(shape.read.tool, shape.read.arguments_after(None)))
            wrote = await session.call_tool(shape.write.tool, shape.write.arguments_after(None))
            shape.count_of(await session.call_tool(shape.read.tool, shape.read.arguments_after(wrote)))
        except (CallFailed, ShapeError, httpx2.HTTPError, TimeoutError, KeyError, TypeError, ValueError) as exc:
            raise CheckSetupError(f"the shape does not fit the server at {url}: {error_text(exc)}") from exc
        finally:
            await session.close()


def planned(suites: Sequence[str] = tuple(SUITES), select: str | None = None) -> list[tuple[str, str, CheckFn]]:
    """The checks of `suites`, in order, as (suite, name, check); with `select`, only those whose
    "suite: name" holds it, case aside (pytest's -k for one word: `-k kill`, `-k "lb: sticky"`)."""
    wanted = (select or "").casefold()
    return [
        (suite, name, check)
        for suite in suites
        for name, check in SUITES[suite]
        if wanted in f"{suite}: {name}".casefold()
    ]


async def run_check(
    url: str,
    shape: Shape | str | Path,
    *,
    faults: Faults | None = None,
    suites: Sequence[str] = tuple(SUITES),
    clients: Sequence[str] = KINDS,
    sessions: int = DEFAULT_SESSIONS,
    duration: float = DEFAULT_DURATION,
    node_clients: str | Path | None = None,
    say: Callable[[str], None] | None = None,
    select: str | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> Report:
    """Run `suites` against the MCP endpoint `url`, driving `clients` (kinds from clients.KINDS),
    `sessions` sessions of each, loads of `duration` seconds. `shape` may be a Shape or its file's path.
    `select`: only the checks whose "suite: name" holds it (`planned`); `progress(done, total, check)` is
    told before each check starts. CheckSetupError (or ShapeError) when it cannot start: a URL that does
    not answer as an HA server, a shape that does not load or fit, a selection that names no check."""
    started = time.monotonic()
    if not isinstance(shape, Shape):
        shape = load_shape(shape)
    unknown = [s for s in suites if s not in SUITES] + [k for k in clients if k not in KINDS]
    if unknown:
        raise CheckSetupError(f"unknown suite or client: {', '.join(unknown)}")
    plan = planned(suites, select)
    if not plan:
        raise CheckSetupError(f"no check's name holds {select!r} (`mcp-ha check --list` names them)")
    replicas = await discover(url)
    await shape_fits(url, shape)
    report = Report(url, faults.name if faults else "none", replicas)
    kinds = list(clients)
    if "ts_sdk" in kinds:
        try:
            await asyncio.to_thread(prepare, node_clients)  # npm ci into the cache, the first time
        except NodeUnavailable as exc:
            kinds.remove("ts_sdk")
            report.results.append(CheckResult("clients", "TypeScript SDK client", "ts_sdk", SKIP, [str(exc)]))
    async with ClientFactory(url, node_clients=node_clients) as factory:
        ctx = Context(url, shape, faults, kinds, sessions, duration, factory, replicas, say or (lambda _t: None))
        for done, (suite, name, check) in enumerate(plan):
            ctx.say(f"{suite}: {name}")
            if progress is not None:
                progress(done, len(plan), f"{suite}: {name}")
            begun = time.monotonic()
            try:
                async with asyncio.timeout(CHECK_TIMEOUT_SECONDS):
                    report.results += await check(ctx)
            except Exception as exc:
                why = (
                    f"did not finish within {CHECK_TIMEOUT_SECONDS:g} s"
                    if isinstance(exc, TimeoutError)
                    else error_text(exc)
                )
                report.results.append(
                    CheckResult(suite, name, "-", FAIL, [why], seconds=round(time.monotonic() - begun, 2))
                )
    report.seconds = round(time.monotonic() - started, 1)
    return report
