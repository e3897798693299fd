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
handles are isolated by principal. A server written from FastMCP's
documentation (`session_id: SessionId`, `await get_session(session_id)`)
gets the kit's store behind it too: `FastMCPSessions` is the
`session_state_store` `HighAvailability.server` gives FastMCP, and it serves
FastMCP's sessions from the kit's handles, so they live on every replica.
FastMCP's `Session.set` reads the whole state and writes it back; here the
write commits only the entries that changed, only while what was read is
unchanged (else `Conflict`, never a lost update), and once per call (a
retried call replays). Anything else FastMCP keeps in that store
(`ctx.set_state`, `UserSession`) stays in this process, as FastMCP keeps it
by default.
"""

from __future__ import annotations

import copy
import logging
import uuid
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Annotated, Any, get_args

from fastmcp import Context
from fastmcp.exceptions import ToolError
from fastmcp.server.dependencies import get_http_request
from fastmcp.server.sessions import SessionId, current_principal, session_storage_key
from key_value.aio.protocols import AsyncKeyValue
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from . import _sdk
from .idempotency import current_call
from .principals import client_of, owned_by, owner
from .session_store import OWNER, Conflict, Session, SessionStore, Transaction, is_session_id

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
    return await _own_handle(handle, store)


async def end_handle(handle: str, store: SessionStore) -> None:
    """End the caller's handle: from now on it resolves on no replica (`end_session`).

    Its state is not copied anywhere and expires with the session TTL; an
    unknown, ended, expired or foreign handle gets the one unknown-handle error.
    """
    await store.end_session(await _own_handle(handle, store), holder=current_client())


async def _own_handle(handle: str, store: SessionStore) -> str:
    """`handle`, if it is one `create_session` minted for this caller and it still lives; else the tool error."""
    if not is_session_id(handle):
        raise _mistake(UNKNOWN_HANDLE)
    record = await store.session_record(handle)
    if record is None or record.get("kind") != _KIND or record.get(OWNER) != owner():
        raise _mistake(UNKNOWN_HANDLE)
    return handle


@dataclass
class _Read:
    """One session as this call saw it: first (what the tool computed from) and latest (what
    FastMCP's `Session.set` read again just before writing)."""

    first: dict[str, Any]
    latest: dict[str, Any]


@dataclass
class _Call:
    """What `FastMCPSessions` keeps for the call being served: its reads, and one `Session` per
    handle, so the call's writes are numbered on, not all named the first."""

    reads: dict[str, _Read] = field(default_factory=dict)
    sessions: dict[str, Session] = field(default_factory=dict)


_call: ContextVar[_Call | None] = ContextVar("fastmcp_sessions_call", default=None)


def _this_call() -> _Call:
    call = _call.get()
    if call is None:
        _call.set(call := _Call())
    return call


class FastMCPSessions:
    """FastMCP's `session_state_store` (py-key-value's AsyncKeyValue), serving FastMCP's `get_session` from the
    kit's handles; every other key goes to `others` (module docstring)."""

    def __init__(self, store: SessionStore, *, others: AsyncKeyValue | None = None) -> None:
        from key_value.aio.stores.memory import MemoryStore

        self.store = store
        self.others: AsyncKeyValue = others if others is not None else MemoryStore()

    async def _handle(self, key: str) -> str | None:
        """The caller's own live handle `key` names, as FastMCP keys a session; None for any other key."""
        candidate = key.rpartition(":")[2]
        if not is_session_id(candidate) or key != session_storage_key(current_principal(), candidate):
            return None
        try:
            return await _own_handle(candidate, self.store)
        except ToolError:
            return None

    async def get(self, key: str, *, collection: str | None = None) -> dict[str, Any] | None:
        handle = await self._handle(key)
        if handle is None:
            return await self.others.get(key, collection=collection)
        state = await self.store.items(handle)
        reads = _this_call().reads
        if key in reads:
            reads[key].latest = copy.deepcopy(state)
        else:
            reads[key] = _Read(copy.deepcopy(state), copy.deepcopy(state))
        return _sdk.fastmcp_session_value(state)

    async def put(self, key: str, value: Mapping[str, Any], *, collection: str | None = None, ttl: Any = None) -> None:
        handle = await self._handle(key)
        state = _sdk.fastmcp_session_state(value)
        if handle is None or state is None:
            return await self.others.put(key, value, collection=collection, ttl=ttl)
        call = _this_call()
        read = call.reads.get(key)
        if read is None:
            now = await self.store.items(handle)
            read = call.reads[key] = _Read(now, copy.deepcopy(now))
        # What this write changes: entries other calls changed meanwhile are in `latest` as they are now.
        changed = {entry for entry in read.latest.keys() | state.keys() if read.latest.get(entry) != state.get(entry)}

        async def commit(tx: Transaction) -> None:
            for entry in sorted(changed):
                # Unchanged since the call first read it, or the tool wrote from a stale value.
                if await tx.get(entry) != read.first.get(entry):
                    raise Conflict(f"{entry!r} changed since this call read it")
                if entry in state:
                    tx.set(entry, state[entry])
                else:
                    tx.delete(entry)

        session = call.sessions.get(handle)
        if session is None:
            session = call.sessions[handle] = Session(
                self.store, handle, epoch=None, call=current_call.get(), owner=owner()
            )
        await session.apply_once(commit, name="fastmcp")
        for entry in changed:
            if entry in state:
                read.first[entry] = read.latest[entry] = copy.deepcopy(state[entry])
            else:
                read.first.pop(entry, None)
                read.latest.pop(entry, None)

    async def delete(self, key: str, *, collection: str | None = None) -> bool:
        handle = await self._handle(key)
        if handle is None:
            return bool(await self.others.delete(key, collection=collection))
        return await self.store.end_session(handle, holder=current_client())

    async def ttl(self, key: str, *, collection: str | None = None) -> tuple[dict[str, Any] | None, float | None]:
        return await self.get(key, collection=collection), None

    async def get_many(self, keys: Sequence[str], *, collection: str | None = None) -> list[dict[str, Any] | None]:
        return [await self.get(key, collection=collection) for key in keys]

    async def ttl_many(
        self, keys: Sequence[str], *, collection: str | None = None
    ) -> list[tuple[dict[str, Any] | None, float | None]]:
        return [await self.ttl(key, collection=collection) for key in keys]

    async def put_many(
        self,
        keys: Sequence[str],
        values: Sequence[Mapping[str, Any]],
        *,
        collection: str | None = None,
        ttl: Any = None,
    ) -> None:
        for key, value in zip(keys, values, strict=True):
            await self.put(key, value, collection=collection, ttl=ttl)

    async def delete_many(self, keys: Sequence[str], *, collection: str | None = None) -> int:
        return sum([await self.delete(key, collection=collection) for key in keys])
