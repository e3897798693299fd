"""The contract's tools, resource and /health, through HAProxy, with FastMCP's client in session mode.

`tests/test_auth.py` runs these same tests again against a stack with authentication on,
with a token: every client comes from the `connect` fixture, which sends the stack's.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import datetime

import httpx2
import pytest
from conftest import Connect
from fastmcp import Client
from fastmcp.client.elicitation import ElicitResult
from fastmcp.exceptions import ToolError

from mcp_ha.ops.check.wire import RawSession, SessionlessSession, jsonrpc_messages, last_jsonrpc_message
from mcp_ha.ops.stack import Stack

REPLICAS = {"mcp-server-1", "mcp-server-2", "mcp-server-3"}
# Well formed and minted by nobody; fixed, so parallel workers collect the same test ids.
UNKNOWN = "5f0c3e1a9b7d4e2f8a6c1b3d5e7f9a0b"


async def test_counter_increments_and_reads_back(client: Client) -> None:
    first = (await client.call_tool("increment_counter", {})).data
    second = (await client.call_tool("increment_counter", {})).data
    assert (first["counter"], second["counter"]) == (1, 2)
    assert first["instance"] in REPLICAS
    assert (await client.call_tool("get_counter", {})).data == {"counter": 2, "instance": first["instance"]}


async def test_counter_is_zero_when_never_set(client: Client) -> None:
    assert (await client.call_tool("get_counter", {})).data["counter"] == 0


async def test_notes_keep_insertion_order(client: Client) -> None:
    assert (await client.call_tool("list_notes", {})).data["notes"] == []
    for i, note in enumerate(["first", "second", "third"], start=1):
        assert (await client.call_tool("add_note", {"note": note})).data["notes_count"] == i
    assert (await client.call_tool("list_notes", {})).data["notes"] == ["first", "second", "third"]


async def test_results_are_structured_and_mirrored_as_text(client: Client) -> None:
    result = await client.call_tool("increment_counter", {})
    assert result.structured_content == json.loads(result.content[0].text)


async def test_server_info_and_status_count_live_sessions(client: Client, connect: Connect) -> None:
    info = (await client.call_tool("get_server_info", {})).data
    assert info["instance"] in REPLICAS and info["sessions"] >= 1
    async with connect() as other:
        await other.call_tool("increment_counter", {})
        assert (await client.call_tool("get_server_info", {})).data["sessions"] >= info["sessions"] + 1
    status = (await client.call_tool("get_status", {})).data
    assert set(status) == {"instance", "uptime_seconds", "active_sessions", "timestamp"}
    assert status["uptime_seconds"] > 0 and status["active_sessions"] >= 2
    assert datetime.fromisoformat(status["timestamp"]).utcoffset().total_seconds() == 0


async def test_analyze_data_streams_logs_and_progress_and_stores_its_result(connect: Connect) -> None:
    logs: list[tuple[str, str]] = []
    progress: list[float] = []

    async def on_log(message) -> None:
        logs.append((message.level, message.data["msg"]))

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(done)

    async with connect(log_handler=on_log) as client:
        result = await client.call_tool("analyze_data", {"num_items": 4}, progress_handler=on_progress)
        assert result.data["items_processed"] == 4
        assert result.data["total_score"] == 1.5 * (1 + 2 + 3 + 4)
        summary = await client.read_resource(f"resource://session/{client.transport.get_session_id()}/summary")
        stored = json.loads(summary[0].text)["analysis_result"]
    assert stored == {"total_score": 15.0, "items_processed": 4}
    levels = {level for level, _ in logs}
    assert {"info", "debug"} <= levels
    assert any("Starting analysis" in msg for level, msg in logs if level == "info")
    assert any("Analysis complete" in msg for level, msg in logs if level == "info")
    assert progress == [1, 2, 3, 4]


async def test_watch_counter_reports_every_change(connect: Connect) -> None:
    logs: list[str] = []

    async def on_log(message) -> None:
        logs.append(message.data["msg"])

    async with connect(log_handler=on_log) as client:
        watch = asyncio.create_task(client.call_tool("watch_counter", {"duration_seconds": 3}))
        for _ in range(3):
            await asyncio.sleep(0.7)
            await client.call_tool("increment_counter", {})
        result = (await watch).data
    assert result["total_changes"] == len(result["changes"]) == 3
    assert [(c["from"], c["to"]) for c in result["changes"]] == [(0, 1), (1, 2), (2, 3)]
    assert all(datetime.fromisoformat(c["at"]) for c in result["changes"])
    assert sum("changed" in msg for msg in logs) == 3


async def test_summary_resource_reads_a_sessions_state(client: Client) -> None:
    await client.call_tool("increment_counter", {})
    await client.call_tool("add_note", {"note": "hello"})
    sid = client.transport.get_session_id()
    contents = await client.read_resource(f"resource://session/{sid}/summary")
    summary = json.loads(contents[0].text)
    assert summary["session_id"] == sid
    assert (summary["counter"], summary["notes"], summary["analysis_result"]) == (1, ["hello"], None)
    assert summary["instance"] in REPLICAS


async def test_summary_of_a_fresh_session_has_defaults(client: Client) -> None:
    sid = uuid.uuid4().hex
    summary = json.loads((await client.read_resource(f"resource://session/{sid}/summary"))[0].text)
    assert (summary["counter"], summary["notes"], summary["analysis_result"]) == (0, [], None)


async def test_resume_session_with_own_id_is_same_session(client: Client) -> None:
    result = (await client.call_tool("resume_session", {"old_session_id": client.transport.get_session_id()})).data
    assert (result["status"], result["keys_copied"]) == ("same_session", 0)


async def test_resume_session_copies_another_sessions_state(connect: Connect, client: Client) -> None:
    async with connect() as old:
        for _ in range(3):
            await old.call_tool("increment_counter", {})
        await old.call_tool("add_note", {"note": "carried over"})
        old_id = old.transport.get_session_id()
    result = (await client.call_tool("resume_session", {"old_session_id": old_id})).data
    assert (result["status"], result["keys_copied"]) == ("resumed", 2)
    assert (await client.call_tool("increment_counter", {})).data["counter"] == 4
    assert (await client.call_tool("list_notes", {})).data["notes"] == ["carried over"]


@pytest.mark.parametrize("old_id", ["*", "?" * 32, "[0-9a-f]*", UNKNOWN, "x" * 10_000, "mcp:sessions"])
async def test_resume_session_treats_ids_as_data(connect: Connect, client: Client, old_id: str) -> None:
    async with connect() as victim:
        await victim.call_tool("increment_counter", {})
        await victim.call_tool("add_note", {"note": "private"})
    result = (await client.call_tool("resume_session", {"old_session_id": old_id})).data
    assert (result["status"], result["keys_copied"]) == ("resumed", 0)
    assert (await client.call_tool("get_counter", {})).data["counter"] == 0
    assert (await client.call_tool("list_notes", {})).data["notes"] == []


async def test_sessions_are_isolated(connect: Connect) -> None:
    async with connect() as a, connect() as b:
        await a.call_tool("increment_counter", {})
        await a.call_tool("add_note", {"note": "a's"})
        assert (await b.call_tool("get_counter", {})).data["counter"] == 0
        assert (await b.call_tool("list_notes", {})).data["notes"] == []


async def test_every_contract_tool_is_listed_with_the_contracts_required_arguments(client: Client) -> None:
    required = {tool.name: set(tool.input_schema.get("required", [])) for tool in await client.list_tools()}
    assert required == {
        "increment_counter": set(),
        "get_counter": set(),
        "add_note": {"note"},
        "list_notes": set(),
        "get_server_info": set(),
        "get_status": set(),
        "analyze_data": {"num_items"},
        "watch_counter": {"duration_seconds"},
        "resume_session": {"old_session_id"},
        # Beyond the contract: handles for sessionless clients (mcp_ha/handles.py), and a reset that
        # asks the user first (docs/generations.md).
        "create_session": set(),
        "end_session": {"session_id"},
        "reset_counter": set(),
    }


async def test_reset_counter_refuses_at_once_a_client_that_cannot_be_asked(
    http: httpx2.AsyncClient, mcp_url: str, bearer: str | None
) -> None:
    """A client that declared no elicitation capability would never answer: a tool error, not a held call."""
    raw = RawSession(http, mcp_url, token=bearer)
    await raw.initialize()
    await raw.call("increment_counter")
    response = await raw.post("tools/call", {"name": "reset_counter", "arguments": {}})
    result = last_jsonrpc_message(response)["result"]
    assert result["isError"] and "no elicitation capability" in result["content"][0]["text"]
    assert (await raw.call("get_counter"))["counter"] == 1


@pytest.mark.parametrize("answer", ["accept", "decline"])
async def test_reset_counter_asks_a_session_era_client_on_its_stream(connect: Connect, answer: str) -> None:
    asked: list[str] = []

    async def handler(message: str, response_type: type, params: object, context: object) -> object:
        asked.append(message)
        return True if answer == "accept" else ElicitResult(action="decline")  # the client's own ElicitResult

    async with connect(timeout=30, elicitation_handler=handler) as client:
        await client.call_tool("increment_counter", {})
        done = (await client.call_tool("reset_counter", {})).structured_content
        assert asked == ["Reset this session's counter (now 1) to 0?"]
        assert done["reset"] is (answer == "accept") and done["was"] == 1
        assert (await client.call_tool("get_counter", {})).data["counter"] == (0 if answer == "accept" else 1)


async def test_wrong_argument_types_are_tool_errors(client: Client) -> None:
    with pytest.raises(ToolError):
        await client.call_tool("analyze_data", {"num_items": "many"})
    with pytest.raises(ToolError):
        await client.call_tool("add_note", {})
    assert (await client.call_tool("get_counter", {})).data["counter"] == 0


@pytest.mark.parametrize(
    ("level", "expected"),
    [(None, []), ("error", []), ("info", ["info", "info"]), ("debug", ["info", "debug", "debug", "info"])],
)
async def test_a_sessionless_client_gets_the_logs_its_request_asks_for(
    mcp_url: str, bearer: str | None, level: str | None, expected: list[str]
) -> None:
    """2026-07-28: no logging/setLevel; each request's `_meta` names the level it wants, on any replica."""
    async with httpx2.AsyncClient(timeout=30) as http:
        session = SessionlessSession(http, mcp_url, token=bearer)
        handle = await session.open()
        meta = {} if level is None else {"io.modelcontextprotocol/logLevel": level}
        response = await session.post(
            "tools/call", {"name": "analyze_data", "arguments": {"num_items": 2, "session_id": handle}, "_meta": meta}
        )
        messages = jsonrpc_messages(response)
        logs = [m["params"] for m in messages if m.get("method") == "notifications/message"]
        assert [log["level"] for log in logs] == expected
        assert messages[-1]["result"]["structuredContent"]["items_processed"] == 2
        if expected:
            assert "Starting analysis" in logs[0]["data"]["msg"] and "Analysis complete" in logs[-1]["data"]["msg"]


async def test_analyze_data_sent_again_under_its_key_resumes_from_its_checkpoint(
    mcp_url: str, bearer: str | None
) -> None:
    """A re-run of a call (its replica died; here, the client sent it again under the same key) carries on
    from the latest checkpoint of the first run, and answers as the first run did."""
    key = {"io.github.mcp-ha-kit/idempotency-key": f"analyze-{uuid.uuid4().hex}"}
    async with httpx2.AsyncClient(timeout=30) as http:
        session = SessionlessSession(http, mcp_url, token=bearer)
        handle = await session.open()
        answers, starts = [], []
        for _ in range(2):
            response = await session.post(
                "tools/call",
                {
                    "name": "analyze_data",
                    "arguments": {"num_items": 25, "session_id": handle},
                    "_meta": {**key, "io.modelcontextprotocol/logLevel": "info"},
                },
            )
            messages = jsonrpc_messages(response)
            starts += [m["params"]["data"]["msg"] for m in messages if m.get("method") == "notifications/message"][:1]
            answers.append({k: v for k, v in messages[-1]["result"]["structuredContent"].items() if k != "instance"})
    assert answers == [{"items_processed": 25, "total_score": 1.5 * 25 * 26 / 2}] * 2
    # The first run checkpointed every 10 items: the second started after item 20.
    assert "resumed" not in starts[0] and starts[1].endswith("(resumed after item 20)")


async def test_health_names_the_replica(stack: Stack) -> None:
    async with httpx2.AsyncClient() as http:
        through_proxy = await http.get(f"http://127.0.0.1:{stack.config.http_port}/health")
        assert through_proxy.status_code == 200
        assert through_proxy.json()["status"] == "ok" and through_proxy.json()["instance"] in REPLICAS
        for name, port in zip(stack.config.replica_names(), stack.config.replica_ports, strict=True):
            direct = (await http.get(f"http://127.0.0.1:{port}/health")).json()
            assert direct == {"status": "ok", "instance": name}
            # The store's memory is for the operator, on the replica's /metrics: bounded, and far from full here.
            scrape = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            used, most = (
                float(line.split()[1])
                for metric in ("mcp_store_memory_used_bytes", "mcp_store_memory_max_bytes")
                for line in scrape.splitlines()
                if line.startswith(f"{metric} ")
            )
            assert 0 < used < most
