"""Idempotency keys: a repeated call is applied once and answered as the first run was."""

from __future__ import annotations

import asyncio
import signal
import uuid

import httpx2

from mcp_ha.idempotency import IDEMPOTENCY_KEY
from mcp_ha.ops.check.wire import RawSession, last_jsonrpc_message
from mcp_ha.ops.stack import Stack


async def keyed(session: RawSession, tool: str, key: str, arguments: dict | None = None) -> dict:
    response = await session.post(
        "tools/call", {"name": tool, "arguments": arguments or {}, "_meta": {IDEMPOTENCY_KEY: key}}
    )
    assert response.status_code == 200, response.text
    return last_jsonrpc_message(response)


async def test_a_repeated_key_is_applied_once_and_replays_the_result(raw: RawSession) -> None:
    key = uuid.uuid4().hex
    first = await keyed(raw, "increment_counter", key)
    again = await keyed(raw, "increment_counter", key)
    assert first["result"]["structuredContent"]["counter"] == 1
    assert again["result"] == first["result"]
    assert (await raw.call("get_counter"))["counter"] == 1
    assert (await keyed(raw, "increment_counter", uuid.uuid4().hex))["result"]["structuredContent"]["counter"] == 2


async def test_concurrent_repeats_of_one_key_apply_once(raw: RawSession) -> None:
    key = uuid.uuid4().hex
    # 12: under MAX_CALLS_PER_SESSION (16), past which a session's calls get 429 instead of running.
    results = await asyncio.gather(*(keyed(raw, "add_note", key, {"note": "once"}) for _ in range(12)))
    assert {r["result"]["structuredContent"]["notes_count"] for r in results} == {1}
    assert (await raw.call("list_notes"))["notes"] == ["once"]


async def test_a_key_reused_with_other_arguments_is_refused(raw: RawSession) -> None:
    key = uuid.uuid4().hex
    await keyed(raw, "add_note", key, {"note": "first"})
    refused = await keyed(raw, "add_note", key, {"note": "second"})
    assert refused["error"]["code"] == -32602
    assert "already used for a different call" in refused["error"]["message"]
    other_tool = await keyed(raw, "increment_counter", key)
    assert other_tool["error"]["code"] == -32602
    assert (await raw.call("list_notes"))["notes"] == ["first"]
    assert (await raw.call("get_counter"))["counter"] == 0


async def test_keys_belong_to_their_session(raw: RawSession, http: httpx2.AsyncClient, mcp_url: str) -> None:
    other = RawSession(http, mcp_url)
    await other.initialize()
    key = uuid.uuid4().hex
    await keyed(raw, "increment_counter", key)
    assert (await keyed(other, "increment_counter", key))["result"]["structuredContent"]["counter"] == 1


async def test_a_malformed_key_is_refused(raw: RawSession) -> None:
    for bad in ["", "x" * 201, "tab\there", 42]:
        refused = await keyed(raw, "increment_counter", bad)  # type: ignore[arg-type]
        assert refused["error"]["code"] == -32602, bad
    assert (await raw.call("get_counter"))["counter"] == 0


async def test_a_retry_on_another_replica_after_a_kill_replays(healed_stack: Stack, raw: RawSession) -> None:
    key = uuid.uuid4().hex
    applied = await keyed(raw, "increment_counter", key)
    replica = applied["result"]["structuredContent"]["instance"]
    healed_stack.signal(replica, signal.SIGKILL)
    while replica in healed_stack.backends_up():  # noqa: ASYNC110  polls HAProxy; bounded by the test's timeout
        await asyncio.sleep(0.05)
    # The client never saw the answer, say, and retries: another replica adopts and replays.
    retried = await keyed(raw, "increment_counter", key)
    assert retried["result"]["structuredContent"]["counter"] == 1
    assert (await raw.call("get_counter"))["counter"] == 1


async def test_clients_cannot_choose_haproxys_request_id(raw: RawSession) -> None:
    """HAProxy replaces X-Request-Id, so a client cannot replay another's request by its id."""
    headers = {**raw.headers(), "X-Request-Id": "chosen-by-client"}
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "increment_counter", "arguments": {}}}
    for expected in (1, 2):
        response = await raw.http.post(raw.url, headers=headers, json=body)
        assert last_jsonrpc_message(response)["result"]["structuredContent"]["counter"] == expected


async def test_read_only_tools_just_run_again(raw: RawSession) -> None:
    """No record is kept for a readOnlyHint tool: a repeat reads the current state."""
    key = uuid.uuid4().hex
    assert (await keyed(raw, "get_counter", key))["result"]["structuredContent"]["counter"] == 0
    await raw.call("increment_counter")
    assert (await keyed(raw, "get_counter", key))["result"]["structuredContent"]["counter"] == 1
