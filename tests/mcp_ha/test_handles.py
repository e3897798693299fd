"""Both MCP generations through HAProxy: session-era clients keep state by their
session, sessionless (2026-07-28) clients by the handle create_session gives them."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid

import httpx2
import pytest
from fastmcp import Client
from fastmcp.exceptions import ToolError

from mcp_ha.handles import NO_SESSION, UNKNOWN_HANDLE
from mcp_ha.idempotency import IDEMPOTENCY_KEY
from mcp_ha.ops.check.wire import ACCEPT, RawSession, last_jsonrpc_message
from mcp_ha.ops.stack import Stack

MODERN = "2026-07-28"
# Well formed and minted by nobody; fixed, so parallel workers collect the same test ids.
UNKNOWN = "5f0c3e1a9b7d4e2f8a6c1b3d5e7f9a0b"
META = {
    "io.modelcontextprotocol/protocolVersion": MODERN,
    "io.modelcontextprotocol/clientInfo": {"name": "tests", "version": "1"},
    "io.modelcontextprotocol/clientCapabilities": {},
}


@pytest.fixture
async def sessionless(mcp_url: str):
    """FastMCP's client in its default mode: sessionless 2026-07-28."""
    async with Client(mcp_url, timeout=30) as c:
        yield c


async def handle_of(client: Client) -> str:
    return (await client.call_tool("create_session", {})).data["session_id"]


async def modern_post(
    http: httpx2.AsyncClient, url: str, method: str, params: dict, *, meta: dict | None = None, **headers: str
) -> httpx2.Response:
    """A sessionless request as any 2026-07-28 client sends it, with extra `_meta` and headers."""
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": {**params, "_meta": {**META, **(meta or {})}}}
    return await http.post(
        url,
        json=body,
        headers={
            "Content-Type": "application/json",
            "Accept": ACCEPT,
            "MCP-Protocol-Version": MODERN,
            "Mcp-Method": method,
            **({"Mcp-Name": params["name"]} if "name" in params else {}),
            **headers,
        },
    )


async def test_every_contract_tool_works_for_a_sessionless_client(sessionless: Client) -> None:
    handle = await handle_of(sessionless)
    args = {"session_id": handle}
    assert (await sessionless.call_tool("increment_counter", args)).data["counter"] == 1
    assert (await sessionless.call_tool("increment_counter", args)).data["counter"] == 2
    assert (await sessionless.call_tool("get_counter", args)).data["counter"] == 2
    assert (await sessionless.call_tool("add_note", {**args, "note": "a"})).data["notes_count"] == 1
    assert (await sessionless.call_tool("list_notes", args)).data["notes"] == ["a"]
    analysis = (await sessionless.call_tool("analyze_data", {**args, "num_items": 4})).data
    assert analysis["items_processed"] == 4 and analysis["total_score"] == 15.0
    assert (await sessionless.call_tool("watch_counter", {**args, "duration_seconds": 0})).data["total_changes"] == 0
    assert (await sessionless.call_tool("resume_session", {**args, "old_session_id": handle})).data[
        "status"
    ] == "same_session"
    # Tools that need no session need no handle.
    assert (await sessionless.call_tool("get_server_info", {})).data["sessions"] >= 1
    assert (await sessionless.call_tool("get_status", {})).data["active_sessions"] >= 1
    summary = json.loads((await sessionless.read_resource(f"resource://session/{handle}/summary"))[0].text)
    assert (summary["counter"], summary["notes"]) == (2, ["a"])
    assert summary["analysis_result"] == {"total_score": 15.0, "items_processed": 4}


async def test_a_sessionless_counter_counts_across_replicas(sessionless: Client) -> None:
    handle = await handle_of(sessionless)
    results = [(await sessionless.call_tool("increment_counter", {"session_id": handle})).data for _ in range(30)]
    assert [r["counter"] for r in results] == list(range(1, 31))
    # Nothing pins a sessionless request: HAProxy spreads them by load.
    assert len({r["instance"] for r in results}) >= 2


async def test_concurrent_sessionless_increments_on_one_handle_all_count(mcp_url: str) -> None:
    async with Client(mcp_url, timeout=30) as first:
        handle = await handle_of(first)
    clients = [Client(mcp_url, timeout=30) for _ in range(4)]
    for c in clients:
        await c.__aenter__()
    try:
        await asyncio.gather(
            *[c.call_tool("increment_counter", {"session_id": handle}) for c in clients for _ in range(25)]
        )
        assert (await clients[0].call_tool("get_counter", {"session_id": handle})).data["counter"] == 100
    finally:
        for c in clients:
            await c.__aexit__(None, None, None)


async def test_a_sessionless_stateful_call_without_a_handle_says_what_to_do(sessionless: Client) -> None:
    for tool, args in [
        ("increment_counter", {}),
        ("get_counter", {}),
        ("add_note", {"note": "x"}),
        ("analyze_data", {"num_items": 1}),
        ("resume_session", {"old_session_id": uuid.uuid4().hex}),
    ]:
        with pytest.raises(ToolError) as error:
            await sessionless.call_tool(tool, args)
        assert str(error.value) == NO_SESSION


@pytest.mark.parametrize("bad", [UNKNOWN, "*", "?" * 32, "x" * 5000, UNKNOWN.upper(), ""])
async def test_unknown_or_malformed_handles_get_one_answer(sessionless: Client, bad: str) -> None:
    with pytest.raises(ToolError) as error:
        await sessionless.call_tool("increment_counter", {"session_id": bad})
    assert str(error.value) == UNKNOWN_HANDLE


async def test_a_handle_that_is_not_a_string_is_refused(http: httpx2.AsyncClient, mcp_url: str) -> None:
    response = await modern_post(http, mcp_url, "tools/call", {"name": "get_counter", "arguments": {"session_id": 12}})
    assert response.status_code == 200
    message = last_jsonrpc_message(response)
    assert message.get("error") or message["result"]["isError"]


async def test_a_session_era_id_is_not_a_handle(sessionless: Client, raw: RawSession) -> None:
    await raw.call("increment_counter")
    with pytest.raises(ToolError) as error:
        await sessionless.call_tool("get_counter", {"session_id": raw.session_id})
    assert str(error.value) == UNKNOWN_HANDLE


async def test_a_forged_session_header_on_a_sessionless_request_reaches_no_session(
    http: httpx2.AsyncClient, mcp_url: str, raw: RawSession
) -> None:
    await raw.call("increment_counter")
    response = await modern_post(
        http, mcp_url, "tools/call", {"name": "get_counter", "arguments": {}}, **{"mcp-session-id": raw.session_id}
    )
    assert response.status_code == 200
    result = last_jsonrpc_message(response)["result"]
    assert result["isError"] and result["content"][0]["text"] == NO_SESSION


@pytest.mark.parametrize("version", ["1999-01-01", "garbage", "2026-07-28x", ""])
async def test_an_unsupported_protocol_version_header_is_a_4xx(
    http: httpx2.AsyncClient, mcp_url: str, version: str
) -> None:
    response = await modern_post(
        http, mcp_url, "tools/call", {"name": "get_server_info", "arguments": {}}, **{"MCP-Protocol-Version": version}
    )
    assert 400 <= response.status_code < 500, (response.status_code, response.text)


async def test_state_moves_between_generations_with_resume_session(sessionless: Client, raw: RawSession) -> None:
    await raw.call("increment_counter")
    await raw.call("add_note", {"note": "from a session"})
    handle = await handle_of(sessionless)
    resumed = (
        await sessionless.call_tool("resume_session", {"old_session_id": raw.session_id, "session_id": handle})
    ).data
    assert (resumed["status"], resumed["keys_copied"]) == ("resumed", 2)
    await sessionless.call_tool("add_note", {"note": "from a handle", "session_id": handle})
    back = await raw.call("resume_session", {"old_session_id": handle})
    assert back["keys_copied"] == 2
    assert (await raw.call("list_notes"))["notes"] == ["from a session", "from a handle"]


async def test_a_repeated_idempotency_key_on_a_handle_applies_once(
    http: httpx2.AsyncClient, mcp_url: str, sessionless: Client
) -> None:
    handle = await handle_of(sessionless)
    params = {"name": "increment_counter", "arguments": {"session_id": handle}}
    answers = [
        last_jsonrpc_message(await modern_post(http, mcp_url, "tools/call", params, meta={IDEMPOTENCY_KEY: "one-call"}))
        for _ in range(3)
    ]
    assert [a["result"]["structuredContent"]["counter"] for a in answers] == [1, 1, 1]
    assert (await sessionless.call_tool("get_counter", {"session_id": handle})).data["counter"] == 1


@pytest.mark.timeout(90)
async def test_a_sessionless_client_rides_through_kill_9_between_calls(healed_stack: Stack, mcp_url: str) -> None:
    async with Client(mcp_url, timeout=30) as c:
        handle = await handle_of(c)
        served = (await c.call_tool("increment_counter", {"session_id": handle})).data["instance"]
        healed_stack.signal(served, signal.SIGKILL)
        failures, counters = [], []
        for _ in range(20):
            try:
                result = (await c.call_tool("increment_counter", {"session_id": handle})).data
                counters.append(result["counter"])
                assert result["instance"] != served
            except Exception as exc:
                failures.append(repr(exc))
        assert failures == []
        assert counters == list(range(2, 22))


async def test_end_session_ends_a_handle_on_every_replica(sessionless: Client) -> None:
    handle = await handle_of(sessionless)
    await sessionless.call_tool("increment_counter", {"session_id": handle})
    ended = (await sessionless.call_tool("end_session", {"session_id": handle})).structured_content
    assert ended["ended"] is True
    # Several calls, so they land on more than the replica that ended it.
    for _ in range(4):
        with pytest.raises(ToolError, match=UNKNOWN_HANDLE):
            await sessionless.call_tool("get_counter", {"session_id": handle})
    with pytest.raises(ToolError, match=UNKNOWN_HANDLE):
        await sessionless.call_tool("end_session", {"session_id": handle})  # once ended, it is unknown


@pytest.mark.parametrize("handle", [UNKNOWN, "not-a-handle", "0" * 32 + "\n"])
async def test_end_session_refuses_an_unknown_handle_clearly(sessionless: Client, handle: str) -> None:
    with pytest.raises(ToolError, match=UNKNOWN_HANDLE):
        await sessionless.call_tool("end_session", {"session_id": handle})


async def test_a_clients_handle_mistakes_are_answered_but_not_logged_as_errors(
    sessionless: Client, stack: Stack
) -> None:
    marker = uuid.uuid4().hex
    for arguments in ({"session_id": "f" * 32}, {"session_id": marker}, {}):
        with pytest.raises(ToolError):
            await sessionless.call_tool("increment_counter", arguments)
    # The same mistake a thousand clients could make must not fill the log at ERROR.
    for name in stack.config.replica_names():
        lines = [json.loads(line) for line in (stack.log_dir / f"{name}.log").read_text().splitlines()]
        assert not [
            line for line in lines if line.get("level") == "ERROR" and "increment_counter" in line.get("message", "")
        ]
