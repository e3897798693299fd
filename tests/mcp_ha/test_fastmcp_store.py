"""fastmcp_store.py: FastMCP's own `Session`, over the kit's handles, writes once per call and
loses no update."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from mcp_ha.fastmcp_store import FastMCPSessions
from mcp_ha.handles import create_handle
from mcp_ha.idempotency import current_call
from mcp_ha.session_store import Conflict
from mcp_ha.stores.memory_store import InMemorySessionStore


def _fastmcp_session(store: InMemorySessionStore, handle: str) -> Any:
    """FastMCP's own Session for `handle`, over the store `ha.server` gives FastMCP."""
    from fastmcp import FastMCP
    from fastmcp.server.sessions import Session as FastMCPSession

    state_store = FastMCP("probe", session_state_store=FastMCPSessions(store))._state_store
    return FastMCPSession(store=state_store, principal=None, session_id=handle, public_id=handle)


@pytest.mark.quick
def test_every_fastmcp_session_write_of_a_keyed_call_applies_and_a_retry_replays_them() -> None:
    store = InMemorySessionStore()

    async def call(key: str, writes: Callable[[Any], Awaitable[None]], handle: str) -> None:
        token = current_call.set((key, "digest"))
        try:
            await writes(_fastmcp_session(store, handle))
        finally:
            current_call.reset(token)

    async def writes(session: Any) -> None:
        await session.set("a", 1)
        await session.set("b", 2)
        await session.delete("a")
        await session.set("n", (await session.get("n", 0)) + 1)

    async def scenario() -> dict:
        handle = await create_handle(store)
        await asyncio.create_task(call("call-1", writes, handle))
        # The same call again (a retry): every write replays, none applies twice.
        await asyncio.create_task(call("call-1", writes, handle))
        return await store.items(handle)

    assert asyncio.run(scenario()) == {"b": 2, "n": 1}


@pytest.mark.quick
def test_a_fastmcp_session_write_conflicts_only_on_what_another_call_changed() -> None:
    store = InMemorySessionStore()

    async def scenario() -> None:
        handle = await create_handle(store)
        read, written = asyncio.Event(), asyncio.Event()

        async def slow(entry: str) -> None:
            session = _fastmcp_session(store, handle)
            value = await session.get(entry, 0)
            read.set()
            await written.wait()
            await session.set(entry, value + 1)

        async def other(entry: str) -> None:
            await read.wait()
            await _fastmcp_session(store, handle).set(entry, 10)
            written.set()

        # Another call changed another entry meanwhile: no conflict, both kept.
        await asyncio.gather(asyncio.create_task(slow("a")), asyncio.create_task(other("b")))
        assert await store.items(handle) == {"a": 1, "b": 10}
        read.clear(), written.clear()
        # Another call changed the entry this one read, then wrote from: refused, its write kept.
        with pytest.raises(Conflict):
            await asyncio.gather(asyncio.create_task(slow("a")), asyncio.create_task(other("a")))
        assert await store.items(handle) == {"a": 10, "b": 10}

    asyncio.run(scenario())
