"""FastMCP's session storage, served from the kit's handles, so FastMCP's sessions live on every replica.

A server written from FastMCP's documentation (`session_id: SessionId`,
`await get_session(session_id)`) gets the kit's store behind it: `FastMCPSessions` is the
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
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from fastmcp.exceptions import ToolError
from fastmcp.server.sessions import current_principal, session_storage_key
from key_value.aio.protocols import AsyncKeyValue

from . import _sdk
from .handles import current_client, own_handle
from .idempotency import current_call
from .principals import owner
from .session_store import Conflict, Session, SessionStore, Transaction, is_session_id


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
            return await own_handle(candidate, self.store)
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
