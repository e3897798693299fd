"""Pattern: per-session state for both MCP generations.

Session-era clients (MCP 2025-11-25 and earlier) open a session with
`initialize` and send its `mcp-session-id` on every request, so a tool can key
state by that id. Sessionless clients (2026-07-28) send no such header: every
request stands alone and may land on any replica, and FastMCP hands the tool a
fresh random `ctx.session_id` each time, so state keyed by it is silently new
on every call.

The convention the ecosystem settled on (FastMCP's `SessionId`) is an explicit
handle: a `create_session` tool mints one, and stateful tools take it as a
`session_id` argument. Here:

- a handle is minted like a session id (32 random lowercase hex) and recorded
  in the same store, under the same keys, as session-era state, so everything
  built for sessions (TTL, counting, `resume_session`, the summary resource)
  works for handles unchanged;
- `session_id_for` picks the id whose state a call works on: the handle when
  one is passed (it must be one `create_session` minted, still live, and, once
  requests are authenticated, minted for the same principal), else the
  session-era session id, else it refuses with a tool error that says what to
  do. It never falls back to state that would be fresh on every call;
- an unknown, expired or foreign handle gets one and the same answer, so a
  caller learns nothing about handles that are not theirs.

It is FastMCP's convention, not a second one beside it: the tools are
`create_session` and `end_session`, the argument is annotated with
FastMCP's `SessionId` marker (so FastMCP gives it its own description), and
handles are isolated by principal.
A server written from FastMCP's documentation (`session_id: SessionId`,
`await get_session(session_id)`) gets the kit's handles behind it too
(`fastmcp_store.py`).
"""

from __future__ import annotations

import logging
import uuid
from typing import Annotated, get_args

from fastmcp import Context
from fastmcp.exceptions import ToolError
from fastmcp.server.dependencies import get_http_request
from fastmcp.server.sessions import SessionId
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from .principals import client_of, owned_by, owner
from .session_store import OWNER, SessionStore, is_session_id

# FastMCP's own marker, taken from its public `SessionId`: FastMCP describes an argument carrying it.
_SESSION_ID_MARKER = get_args(SessionId)[1]
# The optional argument every stateful tool takes: FastMCP's `SessionId`, optional because
# session-era clients have their MCP session instead.
SessionHandle = Annotated[str | None, _SESSION_ID_MARKER]

NO_SESSION = (
    "This tool keeps state per session, and this request has none: sessionless (2026-07-28) "
    "clients call create_session once and pass the session_id it returns to every stateful tool."
)
UNKNOWN_HANDLE = "Unknown or expired session handle; call create_session for a new one."

_KIND = "handle"


def _mistake(message: str) -> ToolError:
    """The client's mistake, answered clearly and logged at DEBUG: at ERROR, any client could fill the log."""
    return ToolError(message, log_level=logging.DEBUG)


async def create_handle(store: SessionStore) -> str:
    """Mint a handle and record it (with the caller's principal as its owner, when authenticated: `principals.py`)."""
    handle = uuid.uuid4().hex
    # Counted against the caller's sessions (MAX_SESSIONS_PER_CLIENT): past it, a tool error (errors.py).
    await store.open_session(handle, {"kind": _KIND, **owned_by(owner())}, holder=current_client())
    return handle


def current_client() -> str | None:
    """Who the current request counts against (`principals.client_of`); None when not over HTTP."""
    try:
        return client_of(get_http_request().scope)
    except RuntimeError:
        return None


def session_era_id(ctx: Context) -> str | None:
    """The caller's MCP session id on a session-era request; None on a sessionless one.

    Decided by the negotiated protocol, never by a header alone: a sessionless
    request that carries a forged `mcp-session-id` gets no session from it.
    """
    request = ctx.request_context
    if request is None or request.protocol_version not in HANDSHAKE_PROTOCOL_VERSIONS:
        return None
    return ctx.session_id


async def session_id_for(ctx: Context, handle: str | None, store: SessionStore) -> str:
    """The id whose state this call works on; a clear tool error when there is none."""
    if handle is None:
        session_id = session_era_id(ctx)
        if session_id is None:
            raise _mistake(NO_SESSION)
        return session_id
    return await own_handle(handle, store)


async def end_handle(handle: str, store: SessionStore) -> None:
    """End the caller's handle: from now on it resolves on no replica (`end_session`).

    Its state is not copied anywhere and expires with the session TTL; an
    unknown, ended, expired or foreign handle gets the one unknown-handle error.
    """
    await store.end_session(await own_handle(handle, store), holder=current_client())


async def own_handle(handle: str, store: SessionStore) -> str:
    """`handle`, if it is one `create_session` minted for this caller and it still lives; else the tool error."""
    if not is_session_id(handle):
        raise _mistake(UNKNOWN_HANDLE)
    record = await store.session_record(handle)
    if record is None or record.get("kind") != _KIND or record.get(OWNER) != owner():
        raise _mistake(UNKNOWN_HANDLE)
    return handle
