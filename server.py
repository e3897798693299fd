"""The kit's demo server: the tools of the wire contract (docs/contract.md), made highly available.

No tool keeps state in this process: each works through `ha.session`, bound to
the caller's MCP session (or, for sessionless clients, the handle
`create_session` gave them) in the store the settings name. Every result
carries `instance`, so routing is visible from the client.

Run one replica with `python server.py` (settings: docs/operations.md), or
serve `app` with any ASGI server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastmcp import Context
from fastmcp.exceptions import ResourceError
from fastmcp.server.elicitation import AcceptedElicitation
from fastmcp.utilities.tasks import TaskConfig
from pydantic import AfterValidator, Field

from mcp_ha import (
    STORE_UNAVAILABLE,
    HighAvailability,
    SessionHandle,
    StoreUnavailable,
    is_session_id,
    session_era_id,
)

ha = HighAvailability.from_env()
mcp = ha.server("mcp-ha-kit")
INSTANCE_ID = ha.instance

# Seconds analyze_data spends per item, so its progress stream is observable.
ANALYZE_STEP_SECONDS = 0.05
# Items between checkpoints: a re-run redoes at most this many, and a call keeps num_items / this records.
ANALYZE_CHECKPOINT_EVERY = 10
# analyze_data runs as a durable task for a client that asks (FastMCP's default client does), which polls it
# this often at most (FastMCP's default is 5 s): its result reaches the client soon after it is ready.
ANALYZE_TASK = TaskConfig(mode="optional", poll_interval=timedelta(milliseconds=500))
WATCH_POLL_SECONDS = 0.5
WATCH_MAX_SECONDS = 30
# The longest note add_note keeps, in UTF-8 bytes (what the store keeps), and
# how many a session keeps. The contract gives `note: str` and nothing more,
# but every note is kept in the session's hash for the session's life and
# sent back whole by list_notes: without bounds, one call under HAProxy's body
# limit stores ~1 MB, and a session grows without end.
MAX_NOTE_BYTES = 10_000
MAX_NOTES = 250
started_at = time.monotonic()
log = logging.getLogger("mcp-ha")

# Told to clients: a read-only tool changes nothing, so calling it again is always safe.
READ_ONLY = {"readOnlyHint": True}


@mcp.tool
async def increment_counter(ctx: Context, session_id: SessionHandle = None) -> dict:
    """Add one to this session's counter, atomically; returns the new value."""
    session = await ha.session(ctx, session_id)
    return {"counter": await session.incr("counter"), "instance": INSTANCE_ID}


@mcp.tool(annotations=READ_ONLY)
async def get_counter(ctx: Context, session_id: SessionHandle = None) -> dict:
    """This session's counter (0 when never incremented)."""
    session = await ha.session(ctx, session_id)
    return {"counter": await session.get("counter", 0), "instance": INSTANCE_ID}


def _within_note_bytes(note: str) -> str:
    if len(note.encode()) > MAX_NOTE_BYTES:
        raise ValueError(f"the note takes {len(note.encode())} bytes of UTF-8; at most {MAX_NOTE_BYTES} are kept")
    return note


@mcp.tool
async def add_note(
    note: Annotated[
        str,
        Field(
            max_length=MAX_NOTE_BYTES,
            description=f"The note (at most {MAX_NOTE_BYTES} bytes of UTF-8; a session keeps {MAX_NOTES}).",
        ),
        AfterValidator(_within_note_bytes),
    ],
    ctx: Context,
    session_id: SessionHandle = None,
) -> dict:
    """Append a note to this session's notes, atomically."""
    session = await ha.session(ctx, session_id)
    return {"notes_count": await session.append("notes", note, max_items=MAX_NOTES), "instance": INSTANCE_ID}


@mcp.tool(annotations=READ_ONLY)
async def list_notes(ctx: Context, session_id: SessionHandle = None) -> dict:
    """This session's notes in insertion order."""
    session = await ha.session(ctx, session_id)
    return {"notes": await session.get("notes", []), "instance": INSTANCE_ID}


async def live_sessions(ctx: Context) -> int:
    # A session-era call marks its session live; a sessionless one has none to mark.
    if (sid := session_era_id(ctx)) is not None:
        await ha.store.touch(sid)
    return await ha.store.count_sessions()


@mcp.tool(annotations=READ_ONLY)
async def get_server_info(ctx: Context) -> dict:
    """Which replica answered, and how many sessions are live in the store."""
    return {"instance": INSTANCE_ID, "sessions": await live_sessions(ctx)}


@mcp.tool(annotations=READ_ONLY)
async def get_status(ctx: Context) -> dict:
    """Replica uptime, live sessions and the time, for dashboards and probes."""
    return {
        "instance": INSTANCE_ID,
        "uptime_seconds": max(time.monotonic() - started_at, 1e-6),
        "active_sessions": await live_sessions(ctx),
        "timestamp": datetime.now(UTC).isoformat(),
    }


@mcp.tool(task=ANALYZE_TASK)
async def analyze_data(
    num_items: Annotated[int, Field(ge=0, le=1000, description="How many items to analyse (0-1000).")],
    ctx: Context,
    session_id: SessionHandle = None,
) -> dict:
    """A multi-step job that streams log and progress notifications as it goes; a background task for a
    client that asks for one (its progress is the task's status message)."""
    session = await ha.session(ctx, session_id)  # before the work: a call without a session fails fast
    # Run again after its replica died, it carries on from its latest checkpoint, not from item 1.
    resumed = await session.resume()
    done, total_score = resumed.checkpoint or (0, 0.0)
    again = f" (resumed after item {done})" if resumed.rerun else ""
    await ctx.info(f"Starting analysis of {num_items} items on {INSTANCE_ID}{again}")
    for item in range(done + 1, num_items + 1):
        await asyncio.sleep(ANALYZE_STEP_SECONDS)
        total_score += 1.5 * item
        await ctx.debug(f"Processed item {item}/{num_items}: score so far {total_score}")
        await ctx.report_progress(item, num_items, f"item {item}/{num_items}")
        if item % ANALYZE_CHECKPOINT_EVERY == 0:
            await session.checkpoint([item, total_score])
    await session.set("analysis_result", {"total_score": total_score, "items_processed": num_items})
    await ctx.info(f"Analysis complete: {num_items} items, total score {total_score}")
    return {"items_processed": num_items, "total_score": total_score, "instance": INSTANCE_ID}


RESET_QUESTION = "Reset this session's counter (now {counter}) to 0?"


@mcp.tool
async def reset_counter(ctx: Context, session_id: SessionHandle = None) -> dict:
    """Set this session's counter back to 0, once the user confirms: by elicitation on the session's stream
    (session-era clients), or as a multi-round-trip request whose second leg may reach any replica (2026-07-28)."""
    session = await ha.session(ctx, session_id)
    counter = await session.get("counter", 0)
    # One call for both generations (mcp_ha/elicitation.py); a re-run of the call does not ask again.
    answer = await ha.elicit(ctx, RESET_QUESTION.format(counter=counter), bool, name="confirm")
    confirmed = isinstance(answer, AcceptedElicitation) and answer.data is True
    if confirmed:
        await session.set("counter", 0)
    return {"reset": confirmed, "was": counter, "counter": 0 if confirmed else counter, "instance": INSTANCE_ID}


@mcp.tool(annotations=READ_ONLY)
async def watch_counter(duration_seconds: int, ctx: Context, session_id: SessionHandle = None) -> dict:
    """Poll this session's counter for up to 30 s and report every change seen."""
    duration = max(0, min(duration_seconds, WATCH_MAX_SECONDS))
    session = await ha.session(ctx, session_id)
    last = await session.get("counter", 0)
    changes: list[dict] = []
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        await asyncio.sleep(min(WATCH_POLL_SECONDS, max(deadline - time.monotonic(), 0)))
        current = await session.get("counter", 0)
        if current != last:
            at = datetime.now(UTC).isoformat()
            changes.append({"from": last, "to": current, "at": at})
            await ctx.info(f"Counter changed from {last} to {current}")
            last = current
    return {"changes": changes, "total_changes": len(changes), "instance": INSTANCE_ID}


@mcp.tool
async def resume_session(old_session_id: str, ctx: Context, session_id: SessionHandle = None) -> dict:
    """Copy a previous session's (or handle's) state into this one (after a reconnect)."""
    session = await ha.session(ctx, session_id)
    if old_session_id == session.id:
        return {"status": "same_session", "keys_copied": 0, "instance": INSTANCE_ID}
    # An id nobody minted, or another principal's session, copies nothing (Session.copy_from).
    copied = await session.copy_from(old_session_id)
    log.info("resumed %d entries from a previous session", copied)
    return {"status": "resumed", "keys_copied": copied, "instance": INSTANCE_ID}


@mcp.resource("resource://session/{session_id}/summary", mime_type="application/json")
async def session_summary(session_id: str) -> dict:
    """A JSON snapshot of one session's state."""
    if not is_session_id(session_id):
        # The client's mistake, not the server's: FastMCP logs a ResourceError with its traceback at
        # the error's level, and at ERROR any client could fill the logs with them.
        raise ResourceError("Unknown session", log_level=logging.DEBUG)
    try:
        # Another principal's session reads like one that never was.
        state = await ha.state_of(session_id)
    except StoreUnavailable as exc:
        raise ResourceError(STORE_UNAVAILABLE) from exc
    return {
        "session_id": session_id,
        "counter": state.get("counter", 0),
        "notes": state.get("notes", []),
        "analysis_result": state.get("analysis_result"),
        "instance": INSTANCE_ID,
    }


app = ha.http_app(mcp)

if __name__ == "__main__":
    ha.run(app)
