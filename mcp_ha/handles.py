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
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastmcp import Context
from fastmcp.exceptions import ToolError
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from pydantic import Field

from session_store import OWNER, SessionStore, is_session_id

from .principals import owned_by, owner

SESSION_ID_DESCRIPTION = (
    "Sessionless (MCP 2026-07-28) clients: the handle create_session returned, to keep state "
    "across calls. Session-era clients may leave it out: their MCP session keeps the state."
)
# The optional argument every stateful tool takes.
SessionHandle = Annotated[str | None, Field(description=SESSION_ID_DESCRIPTION)]

NO_SESSION = (
    "This tool keeps state per session, and this request has none: sessionless (2026-07-28) "
    "clients call create_session once and pass the session_id it returns to every stateful tool."
)
UNKNOWN_HANDLE = "Unknown or expired session handle; call create_session for a new one."
HANDLE_DESCRIPTION = "The handle create_session returned."

_KIND = "handle"


async def create_handle(store: SessionStore) -> str:
    """Mint a handle and record it (with the caller's principal as its owner, when authenticated: `principals.py`)."""
    handle = uuid.uuid4().hex
    await store.open_session(handle, {"kind": _KIND, **owned_by(owner())})
    return handle


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
            raise ToolError(NO_SESSION)
        return session_id
    return await _own_handle(handle, store)


async def end_handle(handle: str, store: SessionStore) -> None:
    """End the caller's handle: from now on it resolves on no replica (`end_session`).

    Its state is not copied anywhere and expires with the session TTL; an
    unknown, ended, expired or foreign handle gets the one unknown-handle error.
    """
    await store.end_session(await _own_handle(handle, store))


async def _own_handle(handle: str, store: SessionStore) -> str:
    """`handle`, if it is one `create_session` minted for this caller and it still lives; else the tool error."""
    if not is_session_id(handle):
        raise ToolError(UNKNOWN_HANDLE)
    record = await store.session_record(handle)
    if record is None or record.get("kind") != _KIND or record.get(OWNER) != owner():
        raise ToolError(UNKNOWN_HANDLE)
    return handle
