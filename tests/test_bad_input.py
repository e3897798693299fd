"""Bad input and a lost store: a JSON-RPC error or a 4xx every time, never a 5xx, a hang or a dead replica."""

from __future__ import annotations

import asyncio
import uuid

import httpx2
import pytest

from mcp_http import ACCEPT, PROTOCOL, RawSession, last_jsonrpc_message
from stack import Stack

# The documented bound on a note (server.MAX_NOTE_CHARS), stated here as the contract clients see.
MAX_NOTE_CHARS = 10_000


async def assert_untouched(session: RawSession, counter: int, notes: list[str]) -> None:
    assert (await session.call("get_counter"))["counter"] == counter
    assert (await session.call("list_notes"))["notes"] == notes


@pytest.fixture
async def bystander(http: httpx2.AsyncClient, mcp_url: str) -> RawSession:
    """Another session with state, which no bad request may change."""
    session = RawSession(http, mcp_url)
    await session.initialize()
    await session.call("increment_counter")
    await session.call("add_note", {"note": "mine"})
    return session


@pytest.mark.parametrize(
    "body",
    [b'{"jsonrpc":', b"not json", b"", b"[]", b'{"jsonrpc":"2.0","id":1}', b'"just a string"', b"\xff\xfe"],
)
async def test_malformed_bodies_get_a_4xx_json_rpc_error(raw: RawSession, bystander: RawSession, body: bytes) -> None:
    response = await raw.http.post(raw.url, headers=raw.headers(), content=body)
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    assert "error" in response.json()
    await assert_untouched(bystander, 1, ["mine"])


async def test_a_batch_is_refused_with_a_4xx(raw: RawSession) -> None:
    batch = [{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "increment_counter", "arguments": {}}}]
    response = await raw.http.post(raw.url, headers=raw.headers(), json=batch)
    assert 400 <= response.status_code < 500
    assert (await raw.call("get_counter"))["counter"] == 0


async def test_unknown_tool_is_an_error_result(raw: RawSession) -> None:
    response = await raw.post("tools/call", {"name": "no_such_tool", "arguments": {}})
    assert response.status_code == 200
    assert last_jsonrpc_message(response)["result"]["isError"] is True


async def test_unknown_method_is_method_not_found(raw: RawSession) -> None:
    response = await raw.post("no/such/method")
    assert last_jsonrpc_message(response)["error"]["code"] == -32601


@pytest.mark.parametrize(
    ("tool", "arguments"),
    [
        ("add_note", {"note": 5}),
        ("add_note", {"note": None}),
        ("add_note", {}),
        ("analyze_data", {"num_items": "three"}),
        ("analyze_data", {"num_items": -1}),
        ("analyze_data", {"num_items": 10**12}),
        ("watch_counter", {"duration_seconds": [1]}),
        ("resume_session", {"old_session_id": {"$ne": 1}}),
    ],
)
async def test_wrong_arguments_are_error_results(
    raw: RawSession, bystander: RawSession, tool: str, arguments: dict
) -> None:
    response = await raw.post("tools/call", {"name": tool, "arguments": arguments})
    assert response.status_code == 200
    assert last_jsonrpc_message(response)["result"]["isError"] is True
    await assert_untouched(bystander, 1, ["mine"])


@pytest.mark.parametrize("session_id", ["garbage", "*", uuid.uuid4().hex, "a" * 5000, "../../etc/passwd"])
async def test_unknown_or_garbage_session_ids_get_404(
    http: httpx2.AsyncClient, mcp_url: str, bystander: RawSession, session_id: str
) -> None:
    headers = {"Content-Type": "application/json", "Accept": ACCEPT, "MCP-Protocol-Version": PROTOCOL,
               "mcp-session-id": session_id}
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "increment_counter", "arguments": {}}}
    response = await http.post(mcp_url, headers=headers, json=body)
    # A header HAProxy itself refuses (too long) is a 4xx too.
    assert 400 <= response.status_code < 500, response.status_code
    await assert_untouched(bystander, 1, ["mine"])


async def test_a_request_without_a_session_id_is_refused(http: httpx2.AsyncClient, mcp_url: str) -> None:
    headers = {"Content-Type": "application/json", "Accept": ACCEPT, "MCP-Protocol-Version": PROTOCOL}
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "increment_counter", "arguments": {}}}
    response = await http.post(mcp_url, headers=headers, json=body)
    assert response.status_code == 400


async def test_a_huge_note_is_refused_before_it_reaches_the_store(raw: RawSession) -> None:
    response = await raw.post("tools/call", {"name": "add_note", "arguments": {"note": "x" * (5 * 1024 * 1024)}})
    assert response.status_code == 413
    assert (await raw.call("list_notes"))["notes"] == []


async def test_a_note_over_max_note_chars_is_a_tool_error_and_nothing_is_kept(raw: RawSession) -> None:
    assert (await raw.call("add_note", {"note": "é" * MAX_NOTE_CHARS}))["notes_count"] == 1
    # ~900 KB passes HAProxy's 1 MB body limit: the tool's own bound refuses it.
    for note in ("é" * (MAX_NOTE_CHARS + 1), "x" * 900_000):
        response = await raw.post("tools/call", {"name": "add_note", "arguments": {"note": note}})
        result = last_jsonrpc_message(response)["result"]
        assert result["isError"] is True
        assert f"at most {MAX_NOTE_CHARS} characters" in result["content"][0]["text"]
    assert (await raw.call("list_notes"))["notes"] == ["é" * MAX_NOTE_CHARS]


@pytest.mark.timeout(90)
async def test_an_unreachable_store_gives_clear_errors_and_health_503_then_recovers(
    healed_stack: Stack, raw: RawSession, http: httpx2.AsyncClient
) -> None:
    replica = (await raw.call("increment_counter"))["instance"]
    healed_stack.stop("redis")

    async def health_of(port: int) -> httpx2.Response:
        return await http.get(f"http://127.0.0.1:{port}/health")

    # For as long as a call would retry the store (a Sentinel failover), a replica stays in rotation...
    assert (await health_of(healed_stack.config.replica_ports[0])).status_code == 200
    # ...and a call waits that long for Redis, then is told plainly that it is not there.
    direct = RawSession(http, f"http://127.0.0.1:{healed_stack.service(replica).port}/mcp")
    direct.session_id = raw.session_id
    response = await direct.post("tools/call", {"name": "increment_counter", "arguments": {}})
    assert response.status_code == 200
    result = last_jsonrpc_message(response)["result"]
    assert result["isError"] is True
    assert result["content"][0]["text"] == "Session store unavailable; try again shortly."
    # ...and then says why it cannot serve.
    for name, port in zip(healed_stack.config.replica_names(), healed_stack.config.replica_ports):
        for _ in range(150):
            health = await health_of(port)
            if health.status_code != 200:
                break
            await asyncio.sleep(0.1)
        assert health.status_code == 503
        assert health.json() == {"status": "degraded", "instance": name, "store": "unreachable"}

    # Straight to the session's replica, which HAProxy has taken out by now: it sheds the call
    # before any work, saying why.
    response = await direct.post("tools/call", {"name": "increment_counter", "arguments": {}})
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "Session store unavailable; try again shortly."
    # Through HAProxy, once it has taken every replica out: its own 503, never a traceback.
    for _ in range(100):
        if not healed_stack.backends_up():
            break
        await asyncio.sleep(0.1)
    response = await raw.post("tools/call", {"name": "increment_counter", "arguments": {}})
    assert response.status_code == 503 and "No server is available" in response.text

    healed_stack.start("redis")  # AOF brings the state back
    healed_stack.wait_healthy("haproxy")
    assert (await raw.call("get_counter"))["counter"] == 1
    assert (await raw.call("increment_counter"))["counter"] == 2
    assert all(healed_stack.pid(name) for name in healed_stack.config.replica_names())
