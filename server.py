"""A stateful FastMCP server that any replica can serve: the tools of ../CONTRACT.md.

No tool keeps state in this process. Each one works through a `Session` bound
to the caller's MCP session id (or, for sessionless clients, the handle
`create_session` gave them), backed by the store chosen once at start-up
(Redis when REDIS_URL or REDIS_SENTINELS is set, in-memory otherwise). Every result carries
`instance`, so routing is visible from the client.

The availability patterns are wired in here, each from its own module:
session handles for sessionless clients (`session_handles.py`), session
adoption (`session_adoption.py`), idempotency keys (`idempotency.py`),
graceful drain (`drain.py`), metrics at `/metrics` (`metrics.py`), and,
when MCP_AUTH is set, sessions that belong to the principal that opened them
(`auth.py`).

Run one replica with `python server.py` (settings from the environment; see
the README's table) or mount `app` in any ASGI server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from datetime import UTC, datetime
from typing import Annotated

import uvicorn
from fastmcp import Context, FastMCP
from fastmcp.exceptions import ResourceError, ToolError
from fastmcp.server.middleware import Middleware, MiddlewareContext
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS
from pydantic import Field
from starlette.middleware import Middleware as StarletteMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

import auth
import metrics
import structured_logs
from drain import BALANCER_CHECK_HEADER, Drain, DrainingServer
from idempotency import KEY_REUSED, IdempotentCalls, current_call
from resumable_streams import CheckResumption
from session_adoption import SESSION_MOVED, AdoptSessions, Ownership, RecordSessions
from session_handles import SessionHandle, create_handle, session_era_id, session_id_for
from session_store import (
    DEFAULT_EVENT_TTL_SECONDS,
    DEFAULT_OP_TTL_SECONDS,
    DEFAULT_TTL_SECONDS,
    STORE_UNAVAILABLE,
    Fenced,
    OpReused,
    Session,
    SessionStore,
    StoreUnavailable,
    is_session_id,
)

INSTANCE_ID = os.environ.get("INSTANCE_ID", "mcp-server-1")
SESSION_TTL_SECONDS = int(os.environ.get("SESSION_TTL_SECONDS", DEFAULT_TTL_SECONDS))
EVENT_TTL_SECONDS = int(os.environ.get("EVENT_TTL_SECONDS", DEFAULT_EVENT_TTL_SECONDS))
OP_TTL_SECONDS = int(os.environ.get("OP_TTL_SECONDS", DEFAULT_OP_TTL_SECONDS))
REDIS_URL = os.environ.get("REDIS_URL", "")
REDIS_SENTINELS = os.environ.get("REDIS_SENTINELS", "")
REDIS_MASTER_NAME = os.environ.get("REDIS_MASTER_NAME", "mymaster")
# The Redis ACL user replicas connect as (and, with Sentinel, the sentinels' user):
# unset means Redis's `default` user, or whatever REDIS_URL carries.
REDIS_USERNAME = os.environ.get("REDIS_USERNAME") or None
REDIS_PASSWORD = os.environ.get("REDIS_PASSWORD") or None
REDIS_SENTINEL_USERNAME = os.environ.get("REDIS_SENTINEL_USERNAME") or None
REDIS_SENTINEL_PASSWORD = os.environ.get("REDIS_SENTINEL_PASSWORD") or None
REDIS_WAIT_REPLICAS = int(os.environ.get("REDIS_WAIT_REPLICAS", "0"))
REDIS_RETRY_SECONDS = float(os.environ.get("REDIS_RETRY_SECONDS", "4"))

# Seconds analyze_data spends per item, so its progress stream is observable.
ANALYZE_STEP_SECONDS = 0.05
WATCH_POLL_SECONDS = 0.5
WATCH_MAX_SECONDS = 30
# Under HAProxy's 800 ms check timeout, so a hung Redis is answered (and
# forgiven, for a while: StoreHealth) before HAProxy counts the check failed.
HEALTH_PING_SECONDS = 0.5
# The longest note add_note keeps, in characters. The contract gives `note: str`
# and nothing more, but every note is kept in the session's hash for the
# session's life and sent back whole by list_notes: without a bound, one call
# under HAProxy's body limit stores ~1 MB.
MAX_NOTE_CHARS = 10_000

log = logging.getLogger("mcp-ha")


def sentinel_addresses(raw: str) -> list[tuple[str, int]]:
    """REDIS_SENTINELS, "host:port,host:port", as (host, port) pairs."""
    addresses = []
    for item in filter(None, (part.strip() for part in raw.split(","))):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise SystemExit(f"REDIS_SENTINELS={raw!r}: expected host:port[,host:port...], got {item!r}")
        addresses.append((host, int(port)))
    return addresses


def make_store() -> SessionStore:
    ttls = {"ttl_seconds": SESSION_TTL_SECONDS, "event_ttl_seconds": EVENT_TTL_SECONDS, "op_ttl_seconds": OP_TTL_SECONDS,
            "on_replay": metrics.count_replay}
    if REDIS_URL or REDIS_SENTINELS:
        from stores.redis_store import RedisSessionStore

        return metrics.MeteredStore(RedisSessionStore(
            None if REDIS_SENTINELS else REDIS_URL,
            sentinels=sentinel_addresses(REDIS_SENTINELS),
            master_name=REDIS_MASTER_NAME,
            wait_replicas=REDIS_WAIT_REPLICAS,
            retry_seconds=REDIS_RETRY_SECONDS,
            username=REDIS_USERNAME,
            password=REDIS_PASSWORD,
            sentinel_username=REDIS_SENTINEL_USERNAME,
            sentinel_password=REDIS_SENTINEL_PASSWORD,
            **ttls,
        ))
    from stores.memory_store import InMemorySessionStore

    return metrics.MeteredStore(InMemorySessionStore(**ttls))


store = make_store()
started_at = time.monotonic()


class StoreErrors(Middleware):
    """A store outage, a write fenced off by adoption or a reused idempotency key is a
    clear error, never a traceback."""

    async def on_call_tool(self, context: MiddlewareContext, call_next):
        try:
            return await call_next(context)
        except (ToolError, StoreUnavailable, Fenced, OpReused) as exc:
            # Raised in a tool, FastMCP has already wrapped it; the cause says why.
            cause = exc.__cause__ if isinstance(exc, ToolError) else exc
            if isinstance(cause, StoreUnavailable):
                log.warning("store unavailable during %s: %s", context.message.name, cause)
                raise ToolError(STORE_UNAVAILABLE) from cause
            if isinstance(cause, Fenced):
                # Another replica adopted the session while this call ran here: the
                # write was not applied. The next request here adopts it afresh.
                log.info("write fenced off during %s: the session has a newer owner", context.message.name)
                ownership.lost(context.fastmcp_context.session_id)
                raise ToolError(SESSION_MOVED) from cause
            if isinstance(cause, OpReused):
                raise MCPError(INVALID_PARAMS, KEY_REUSED) from cause
            raise


class Expected(logging.Filter):
    """Drops the records of a logger that carry one of these exceptions: conditions the server
    expects, whose tracebacks would only bury real bugs (and, for a client's doing, let any client
    fill the log)."""

    def __init__(self, *exceptions: type[BaseException]) -> None:
        super().__init__()
        self.exceptions = exceptions

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], self.exceptions))


# FastMCP logs a full traceback for every failed tool call: a store outage, a fenced write or a
# reused idempotency key is expected, not a bug to trace.
logging.getLogger("fastmcp.server.server").addFilter(Expected(StoreUnavailable, Fenced, OpReused))
# The MCP SDK logs a request whose client hung up before its body had arrived (or whose HTTP
# framing broke there) as an error with a traceback: the client's doing, not the server's.
logging.getLogger("mcp.server.streamable_http").addFilter(Expected(ClientDisconnect))
try:
    verifier = auth.verifier_from_env()
except auth.AuthConfigError as exc:
    raise SystemExit(str(exc)) from None
ownership = Ownership()
drain = Drain()
# Unexpected errors reach the client as "Error calling tool", without internals.
mcp = FastMCP(
    "mcp-ha-kit",
    middleware=[metrics.ToolMetrics(), StoreErrors(), IdempotentCalls(), RecordSessions(store, ownership)],
    mask_error_details=True,
    auth=verifier,
)


# Told to clients: a read-only tool changes nothing, so calling it again is always safe.
READ_ONLY = {"readOnlyHint": True}


async def session_of(ctx: Context, handle: str | None) -> Session:
    """The caller's session: its handle's, else its MCP session's (see session_handles.py)."""
    sid = await session_id_for(ctx, handle, store)
    return Session(store, sid, epoch=ownership.epoch(sid), call=current_call.get())


@mcp.tool
async def create_session() -> dict:
    """Start a session for a sessionless (2026-07-28) client: pass the session_id it
    returns to the stateful tools. Session-era clients already have one."""
    return {"session_id": await create_handle(store), "instance": INSTANCE_ID}


@mcp.tool
async def increment_counter(ctx: Context, session_id: SessionHandle = None) -> dict:
    """Add one to this session's counter, atomically; returns the new value."""
    session = await session_of(ctx, session_id)
    return {"counter": await session.incr("counter"), "instance": INSTANCE_ID}


@mcp.tool(annotations=READ_ONLY)
async def get_counter(ctx: Context, session_id: SessionHandle = None) -> dict:
    """This session's counter (0 when never incremented)."""
    session = await session_of(ctx, session_id)
    return {"counter": await session.get("counter", 0), "instance": INSTANCE_ID}


@mcp.tool
async def add_note(
    note: Annotated[str, Field(max_length=MAX_NOTE_CHARS, description=f"The note (at most {MAX_NOTE_CHARS} characters).")],
    ctx: Context,
    session_id: SessionHandle = None,
) -> dict:
    """Append a note to this session's notes, atomically."""
    session = await session_of(ctx, session_id)
    return {"notes_count": await session.append("notes", note), "instance": INSTANCE_ID}


@mcp.tool(annotations=READ_ONLY)
async def list_notes(ctx: Context, session_id: SessionHandle = None) -> dict:
    """This session's notes in insertion order."""
    session = await session_of(ctx, session_id)
    return {"notes": await session.get("notes", []), "instance": INSTANCE_ID}


async def live_sessions(ctx: Context) -> int:
    # A session-era call marks its session live; a sessionless one has none to mark.
    if (sid := session_era_id(ctx)) is not None:
        await Session(store, sid).touch()
    return await store.count_sessions()


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


@mcp.tool
async def analyze_data(
    num_items: Annotated[int, Field(ge=0, le=1000, description="How many items to analyse (0-1000).")],
    ctx: Context,
    session_id: SessionHandle = None,
) -> dict:
    """A multi-step job that streams log and progress notifications as it goes."""
    session = await session_of(ctx, session_id)  # before the work: a call without a session fails fast
    await ctx.info(f"Starting analysis of {num_items} items on {INSTANCE_ID}")
    total_score = 0.0
    for item in range(1, num_items + 1):
        await asyncio.sleep(ANALYZE_STEP_SECONDS)
        total_score += 1.5 * item
        await ctx.debug(f"Processed item {item}/{num_items}: score so far {total_score}")
        await ctx.report_progress(item, num_items)
    await session.set("analysis_result", {"total_score": total_score, "items_processed": num_items})
    await ctx.info(f"Analysis complete: {num_items} items, total score {total_score}")
    return {"items_processed": num_items, "total_score": total_score, "instance": INSTANCE_ID}


@mcp.tool(annotations=READ_ONLY)
async def watch_counter(duration_seconds: int, ctx: Context, session_id: SessionHandle = None) -> dict:
    """Poll this session's counter for up to 30 s and report every change seen."""
    duration = max(0, min(duration_seconds, WATCH_MAX_SECONDS))
    session = await session_of(ctx, session_id)
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
    session = await session_of(ctx, session_id)
    if old_session_id == session.id:
        return {"status": "same_session", "keys_copied": 0, "instance": INSTANCE_ID}
    # An id this kit could not have minted is answered like an unknown session,
    # without going near the store: it is data, never a pattern. Another
    # principal's session is answered the same way.
    copied = 0
    if is_session_id(old_session_id) and await store.owner(old_session_id) == auth.owner():
        copied = await session.copy_from(old_session_id)
    log.info("resumed %d entries from a previous session", copied)
    if copied:
        metrics.SESSIONS_RESUMED.inc()
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
        state = await Session(store, session_id).items() if await store.owner(session_id) == auth.owner() else {}
    except StoreUnavailable as exc:
        raise ResourceError(STORE_UNAVAILABLE) from exc
    return {
        "session_id": session_id,
        "counter": state.get("counter", 0),
        "notes": state.get("notes", []),
        "analysis_result": state.get("analysis_result"),
        "instance": INSTANCE_ID,
    }


class StoreHealth:
    """Whether this replica can serve, as far as its store goes; and what it does when it cannot.

    Calls retry the store for up to REDIS_RETRY_SECONDS from the start of an
    outage (long enough for a Sentinel failover), so a replica that cannot
    reach Redis for a moment still serves; failing /health at once would take
    every replica out of HAProxy together and turn a short failover into 503s
    for everyone. Once Redis has been gone longer, the replica sheds new
    requests with a 503 that says why (HAProxy tries another replica), and
    fails /health only when the calls it already took have answered: HAProxy
    cuts whatever is still open on a replica it takes out (drain.py has the
    same reason to do things in this order).
    """

    def __init__(self, *, grace_seconds: float) -> None:
        self.grace_seconds = grace_seconds
        self.unreachable_since: float | None = None
        self.reached = False

    async def check(self) -> bool:
        try:
            reachable = await asyncio.wait_for(store.ping(), HEALTH_PING_SECONDS)
        except TimeoutError:
            reachable = False
        now = time.monotonic()
        if reachable:
            self.unreachable_since = None
            self.reached = True
            drain.shed(None)
            return True
        if self.unreachable_since is None:
            self.unreachable_since = now
        # The grace rides out a failover of a store that worked. A replica that has never reached
        # its store has nothing to ride out: healthy, it would be sent traffic (compose's
        # service_healthy, HAProxy) for the grace's length, only to fail every call.
        if self.reached and now - self.unreachable_since < self.grace_seconds:
            return True
        drain.shed(STORE_GONE)
        return drain.in_flight > 0


STORE_GONE = JSONResponse(
    {"jsonrpc": "2.0", "id": None, "error": {"code": -32000, "message": STORE_UNAVAILABLE}},
    status_code=503,
    headers={"retry-after": "1"},
)
store_health = StoreHealth(grace_seconds=REDIS_RETRY_SECONDS if (REDIS_URL or REDIS_SENTINELS) else 0.0)


@mcp.custom_route("/health", methods=["GET"])
async def health(request: Request) -> JSONResponse:
    if not drain.health_checked(balancer=request.headers.get(BALANCER_CHECK_HEADER)):
        return JSONResponse({"status": "draining", "instance": INSTANCE_ID}, status_code=503)
    if await store_health.check():
        return JSONResponse({"status": "ok", "instance": INSTANCE_ID})
    return JSONResponse({"status": "degraded", "instance": INSTANCE_ID, "store": "unreachable"}, status_code=503)


mcp.custom_route("/metrics", methods=["GET"])(metrics.endpoint)


app = mcp.http_app(
    path="/mcp",
    middleware=[
        # Outermost first: a bad Last-Event-ID is answered before any replica
        # takes the session up just to serve it.
        StarletteMiddleware(CheckResumption, store=store, path="/mcp"),
        StarletteMiddleware(AdoptSessions, store=store, ownership=ownership, path="/mcp"),
    ],
    # A replica forgets an idle session's transport when the store forgets its
    # state; if the session comes back sooner, adoption serves it again.
    session_idle_timeout=SESSION_TTL_SECONDS,
)
metrics.watch_sessions(app, "/mcp")
app = drain.middleware(app, path="/mcp")


if __name__ == "__main__":
    log_config = structured_logs.configure(
        log_format=os.environ.get("LOG_FORMAT", "json").lower(),
        instance=INSTANCE_ID,
        level=os.environ.get("LOG_LEVEL", "INFO").upper(),
    )
    config = uvicorn.Config(
        structured_logs.RequestIds(app),
        log_config=log_config,
        host=os.environ.get("HOST", "127.0.0.1"),
        port=int(os.environ.get("PORT", "8000")),
        loop="uvloop",
        http="httptools",
        log_level=os.environ.get("LOG_LEVEL", "info").lower(),
        # After the drain, whatever is still open (GET streams) gets this long.
        timeout_graceful_shutdown=2,
    )
    DrainingServer(config, drain).run()
