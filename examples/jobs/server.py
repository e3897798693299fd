"""A job runner that survives its replica: a third server shape, written only against `mcp_ha`.

    python stack.py up -d --server examples.jobs.server

A job is a record in its session's state, `job:<id>` = {"id", "name", "steps",
"done", "state"}, with `jobs`, the session's job ids, oldest first. `start_job`
creates one and runs its steps inside the call, recording each step in the
store and reporting it as progress; every other tool reads or changes the
record, through any replica. For a client that asks (FastMCP's with
fastmcp-tasks), `start_job` runs as a durable background task instead: the
client polls it through any replica, and a task whose replica dies is taken
over by another (mcp_ha/tasks.py). So:

- a cancel sent through any replica is seen by the job at its next step: the
  job reads its record from the store before every step, and each step
  commits only while the record is what the step read (`Session.apply_once`);
- a `start_job` run again under the same idempotency key (its client retried
  it, or its replica died mid-stream or mid-task and the kit ran it again
  elsewhere) creates no second job, and resumes from the last step recorded: creating
  the job and each step are apply-once blocks named by what they are, so a
  re-run gets the first run's job back, skips the steps the store already
  holds, and a step two runs both reach is applied once.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from datetime import timedelta
from typing import Annotated, Any

from fastmcp import Context
from fastmcp.exceptions import ToolError
from fastmcp.server.elicitation import AcceptedElicitation
from fastmcp.utilities.tasks import TaskConfig
from pydantic import Field

from mcp_ha import HighAvailability, Session, SessionHandle, Transaction

ha = HighAvailability.from_env()
mcp = ha.server("jobs")

# A session's jobs, finished ones included, until delete_all_jobs: the bound keeps its state to ~200 KB
# (a record with a 100-character ASCII name takes ~200 bytes), under the store's own bound on a session's state.
MAX_JOBS = 1000
RUNNING, DONE, CANCELLED = "running", "done", "cancelled"
# A job id as start_job mints it; anything else names no job, and never reaches a state key.
JOB_ID = re.compile(r"[0-9a-f]{16}")
DELETE_QUESTION = "Delete every job of this session ({count} in all)?"
# start_job as a task: polled this often at most (FastMCP's default is 5 s), so a job's end is seen soon.
JOB_TASK = TaskConfig(mode="optional", poll_interval=timedelta(milliseconds=500))

Name = Annotated[str, Field(min_length=1, max_length=100, description="What to call the job (1-100 characters).")]
Steps = Annotated[int, Field(ge=0, le=1000, description="How many steps the job takes (0-1000).")]
StepSeconds = Annotated[float, Field(ge=0, le=5, description="Seconds each step takes (0-5).")]
JobId = Annotated[str, Field(max_length=64, description="The id start_job gave the job.")]


def _mistake(message: str) -> ToolError:
    """The client's mistake, answered clearly and logged at DEBUG: at ERROR, any client could fill the log."""
    return ToolError(message, log_level=logging.DEBUG)


def _key(job_id: str) -> str:
    return f"job:{job_id}"


def _unknown(job_id: str) -> ToolError:
    return _mistake(f"This session has no job {job_id!r}; list_jobs shows those it has.")


async def _job(session: Session, job_id: str) -> dict[str, Any]:
    """The job's record now; a tool error when this session has no such job."""
    record = await session.get(_key(job_id)) if JOB_ID.fullmatch(job_id) else None
    if record is None:
        raise _unknown(job_id)
    return record


@mcp.tool(task=JOB_TASK)
async def start_job(
    name: Name,
    ctx: Context,
    steps: Steps = 10,
    step_seconds: StepSeconds = 0.1,
    session_id: SessionHandle = None,
) -> dict:
    """Create a job in this session and run it within the call (or as a background task, for a client
    that asks for one): each step takes `step_seconds`, is recorded in the session and reported as
    progress; a cancel_job from any replica stops it at its next step. The job's final record. Sent
    again with the same idempotency key, it creates no second job and carries on from the last step
    recorded."""
    session = await ha.session(ctx, session_id)

    async def create(tx: Transaction) -> dict:
        jobs = await tx.get("jobs", [])
        if len(jobs) >= MAX_JOBS:
            raise _mistake(f"This session holds {MAX_JOBS} jobs, the most it may; delete_all_jobs makes room.")
        job_id = secrets.token_hex(8)
        record = {"id": job_id, "name": name, "steps": steps, "done": 0, "state": RUNNING if steps else DONE}
        tx.set(_key(job_id), record)
        tx.append("jobs", job_id)
        return record

    # A re-run of this call gets the first run's job back here, instead of creating another.
    job_id = (await session.apply_once(create, name="create"))["id"]
    for _ in range(steps + 1):  # each pass records a step, and the last finds the job ended
        # Read afresh before every step: a cancel from any replica, or the steps a first run recorded.
        record = await session.get(_key(job_id))
        if record is None:
            raise _mistake(f"Job {job_id} was deleted (delete_all_jobs) while it ran; it stopped.")
        if record["state"] != RUNNING:
            break
        await asyncio.sleep(step_seconds)
        step = record["done"] + 1

        async def advance(tx: Transaction, step: int = step) -> dict | None:
            # Checked again at the commit: a cancel or a delete during the sleep wins over the step.
            current = await tx.get(_key(job_id))
            if current is None or current["state"] != RUNNING:
                return current
            current = {**current, "done": step, "state": DONE if step == steps else RUNNING}
            tx.set(_key(job_id), current)
            return current

        # Named by its job and step, so two runs of this call that both reach it apply it once.
        advanced = await session.apply_once(advance, name=f"step:{job_id}:{step}")
        if advanced is not None and advanced["done"] == step:
            await ctx.report_progress(step, steps, f"step {step}/{steps}")
    return {"job": record, "instance": ha.instance}


@mcp.tool(annotations={"readOnlyHint": True})
async def job_status(job_id: JobId, ctx: Context, session_id: SessionHandle = None) -> dict:
    """One job of this session as the store has it now: its steps, how many are done, and its state
    (running, done or cancelled)."""
    session = await ha.session(ctx, session_id)
    return {"job": await _job(session, job_id), "instance": ha.instance}


@mcp.tool(annotations={"readOnlyHint": True})
async def list_jobs(ctx: Context, session_id: SessionHandle = None) -> dict:
    """Every job of this session, oldest first, and how many there are."""
    session = await ha.session(ctx, session_id)
    state = await session.items()  # one consistent read: the list and its records agree
    jobs = [state[_key(job_id)] for job_id in state.get("jobs", [])]
    return {"jobs": jobs, "count": len(jobs), "instance": ha.instance}


@mcp.tool
async def cancel_job(job_id: JobId, ctx: Context, session_id: SessionHandle = None) -> dict:
    """Cancel a running job of this session, wherever it runs: it stops at its next step. The job's
    record after; a job already done or cancelled is left as it is."""
    session = await ha.session(ctx, session_id)
    if not JOB_ID.fullmatch(job_id):
        raise _unknown(job_id)

    async def cancel(tx: Transaction) -> dict:
        record = await tx.get(_key(job_id))
        if record is None:
            raise _unknown(job_id)
        if record["state"] == RUNNING:
            record = {**record, "state": CANCELLED}
            tx.set(_key(job_id), record)
        return record

    return {"job": await session.apply_once(cancel), "instance": ha.instance}


@mcp.tool
async def delete_all_jobs(ctx: Context, session_id: SessionHandle = None) -> dict:
    """Delete every job of this session, once the user confirms (asked on the session's stream for
    session-era clients, in a second leg that may reach any replica for 2026-07-28 ones). A running job
    stops at its next step. How many were deleted (0 when declined)."""
    session = await ha.session(ctx, session_id)
    count = len(await session.get("jobs", []))
    if count == 0:
        return {"deleted": 0, "instance": ha.instance}  # nothing to ask about
    # One call for every client; asked once per call, however often the call is re-run.
    answer = await ha.elicit(ctx, DELETE_QUESTION.format(count=count), bool, name="confirm")
    confirmed = isinstance(answer, AcceptedElicitation) and answer.data is True
    if not confirmed:
        return {"deleted": 0, "instance": ha.instance}

    async def delete(tx: Transaction) -> int:
        # Every job there is at the commit, those started since the question included.
        jobs = await tx.get("jobs", [])
        for job_id in jobs:
            tx.delete(_key(job_id))
        tx.delete("jobs")
        return len(jobs)

    return {"deleted": await session.apply_once(delete), "instance": ha.instance}


app = ha.http_app(mcp)

if __name__ == "__main__":
    ha.run(app)
