"""A server for tests/mcp_ha/test_tasks.py: task tools that count their writes and log each run.

Run by the `tasks_stack` fixture as `python -m tests.mcp_ha.tasks_server`. Every start and end of a task
body is a line in $RUNS_LOG ("<event> <instance> <task id>"), so a test sees which replica ran what, and
how often.
"""

from __future__ import annotations

import asyncio
import os
import time
from datetime import timedelta
from pathlib import Path

from fastmcp import Context
from fastmcp.server.elicitation import AcceptedElicitation
from fastmcp.utilities.tasks import TaskConfig

from mcp_ha import HighAvailability, SessionHandle

ha = HighAvailability.from_env()
mcp = ha.server("tasks-test")
RUNS_LOG = Path(os.environ.get("RUNS_LOG", os.devnull))
# Polled every 200 ms by FastMCP's client instead of every 5 s: the tests time what they see.
QUICK = TaskConfig(mode="optional", poll_interval=timedelta(milliseconds=200))


def _log(event: str, ctx: Context) -> None:
    with RUNS_LOG.open("a") as log:
        log.write(f"{event} {ha.instance} {ctx.task_id} {time.time():.3f}\n")


@mcp.tool(task=QUICK)
async def job(steps: int, step_seconds: float, ctx: Context, session_id: SessionHandle = None) -> dict:
    """Counts `steps` in the session's "steps", one every `step_seconds`, reporting each."""
    session = await ha.session(ctx, session_id)
    _log("START", ctx)
    # To the client inline; as a task, to the server's log (a task has no session to send it on).
    await ctx.info(f"counting {steps} steps on {ha.instance}")
    counted = 0
    for step in range(1, steps + 1):
        await asyncio.sleep(step_seconds)
        counted = await session.incr("steps")
        await ctx.report_progress(step, steps, f"step {step}/{steps} on {ha.instance}")
    _log("END", ctx)
    return {"steps": steps, "counted": counted, "instance": ha.instance}


@mcp.tool(task=QUICK)
async def confirmed_job(steps: int, step_seconds: float, ctx: Context, session_id: SessionHandle = None) -> dict:
    """`job`, once the user says yes (asked through `ha.elicit`: in a task, its input request)."""
    _log("ASKING", ctx)
    answer = await ha.elicit(ctx, f"Count {steps} steps?", bool, name="go")
    if not (isinstance(answer, AcceptedElicitation) and answer.data is True):
        return {"steps": steps, "counted": 0, "instance": ha.instance}
    return await job(steps, step_seconds, ctx, session_id)


@mcp.tool
async def count(ctx: Context, session_id: SessionHandle = None) -> dict:
    session = await ha.session(ctx, session_id)
    return {"steps": await session.get("steps", 0)}


@mcp.tool(task=QUICK)
async def sized(size: int) -> str:
    """A result of `size` characters."""
    return "x" * size


app = ha.http_app(mcp)

if __name__ == "__main__":
    ha.run(app)
