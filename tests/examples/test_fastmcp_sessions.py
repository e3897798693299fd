"""examples/fastmcp_sessions.py: a server written from FastMCP's `SessionId` documentation gets the kit's store.

Two replicas against one Redis; which replica serves each call is the test's choice.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import replica_on, two_replicas
from fastmcp import Client
from fastmcp.exceptions import ToolError

from mcp_ha.handles import UNKNOWN_HANDLE
from mcp_ha.ops.stack import Stack

pytestmark = pytest.mark.timeout(120)
MODULE = "examples.fastmcp_sessions"


def test_a_fastmcp_session_lives_on_every_replica_and_ends_everywhere(redis_stack: Stack, tmp_path: Path) -> None:
    with two_replicas(redis_stack, tmp_path, module=MODULE) as (one, two):

        async def scenario() -> None:
            async with Client(one.url) as a, Client(two.url) as b:
                handle = (await a.call_tool("create_session")).data["session_id"]
                for i, client in enumerate((a, b, a, b)):
                    assert (await client.call_tool("remember", {"fact": f"f{i}", "session_id": handle})).data[
                        "facts"
                    ] == i + 1
                assert (await b.call_tool("recall", {"session_id": handle})).data["facts"] == ["f0", "f1", "f2", "f3"]
                other = (await b.call_tool("create_session")).data["session_id"]
                assert (await a.call_tool("recall", {"session_id": other})).data["facts"] == []
                await b.call_tool("end_session", {"session_id": handle})
                with pytest.raises(ToolError, match="Invalid or unknown session"):
                    await a.call_tool("recall", {"session_id": handle})
                with pytest.raises(ToolError, match="Invalid or unknown session"):
                    await a.call_tool("recall", {"session_id": "0" * 32})

        asyncio.run(scenario())


def test_concurrent_read_then_write_calls_lose_no_update(redis_stack: Stack, tmp_path: Path) -> None:
    """FastMCP's Session.set reads the whole state and writes it back: here a write that would overwrite
    another's is refused clearly instead, so every call that succeeded is in the notebook."""
    with two_replicas(redis_stack, tmp_path, module=MODULE) as (one, two):

        async def scenario() -> None:
            async with Client(one.url) as a, Client(two.url) as b:
                handle = (await a.call_tool("create_session")).data["session_id"]

                async def remember(client: Client, fact: str) -> bool:
                    try:
                        await client.call_tool("remember", {"fact": fact, "session_id": handle})
                        return True
                    except ToolError as exc:
                        assert "changed" in str(exc).lower(), exc
                        return False

                facts = [f"f{i}" for i in range(20)]
                ok = await asyncio.gather(*(remember((a, b)[i % 2], f) for i, f in enumerate(facts)))
                kept = (await a.call_tool("recall", {"session_id": handle})).data["facts"]
                assert sorted(kept) == sorted(f for f, done in zip(facts, ok, strict=True) if done)
                assert any(ok)

        asyncio.run(scenario())


def test_the_session_id_argument_is_fastmcps_and_so_is_its_description(redis_stack: Stack, tmp_path: Path) -> None:
    with replica_on(redis_stack, tmp_path, "mcp-server-1") as one:

        async def scenario() -> None:
            from fastmcp.server.sessions import SESSION_ID_DESCRIPTION

            async with Client(one.url) as client:
                tools = {t.name: t.input_schema for t in await client.list_tools()}
                for name in ("increment_counter", "end_session"):
                    assert tools[name]["properties"]["session_id"]["description"] == SESSION_ID_DESCRIPTION
                assert "session_id" in tools["end_session"]["required"]
                assert "session_id" not in tools["increment_counter"].get("required", [])
                with pytest.raises(ToolError, match=UNKNOWN_HANDLE.split(";")[0]):
                    await client.call_tool("end_session", {"session_id": "f" * 32})

        asyncio.run(scenario())
