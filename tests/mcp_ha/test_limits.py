"""Bounds on what one client may take (`mcp_ha/limits.py`), through HAProxy and on a replica directly."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx2
import pytest

from stack import Stack
from tools.mcp_wire import ACCEPT, PROTOCOL, final_message

pytestmark = pytest.mark.timeout(60)
MAX_BODY_BYTES = 1_048_576


def chunked(size: int) -> Iterator[bytes]:
    """A JSON-RPC ping whose id makes the body `size` bytes, sent in 64 KB chunks (no Content-Length)."""
    head, tail = b'{"jsonrpc":"2.0","method":"ping","id":"', b'"}'
    body = head + b"x" * (size - len(head) - len(tail)) + tail
    for start in range(0, len(body), 65536):
        yield body[start : start + 65536]


def post(url: str, body: Iterator[bytes]) -> httpx2.Response:
    headers = {"accept": ACCEPT, "content-type": "application/json", "mcp-protocol-version": PROTOCOL}
    return httpx2.post(url, content=body, headers=headers, timeout=30)


@pytest.mark.parametrize("where", ["haproxy", "replica"])
def test_a_chunked_body_over_the_bound_gets_413_with_a_json_rpc_error(stack: Stack, where: str) -> None:
    url = stack.config.mcp_url if where == "haproxy" else f"http://127.0.0.1:{stack.config.replica_ports[0]}/mcp"
    response = post(url, chunked(2 * MAX_BODY_BYTES))
    assert response.status_code == 413, response.text
    assert json.loads(response.text)["error"]["code"] == -32600
    # Just within the bound, the same body is read whole and answered by the SDK, not refused for its size.
    within = post(url, chunked(MAX_BODY_BYTES - 1024))
    assert within.status_code != 413, within.text
    assert within.status_code < 500, within.text


def test_an_initialize_with_a_padded_client_info_is_refused_and_records_nothing(stack: Stack) -> None:
    padded = {"name": "x" * 100_000, "version": "1"}
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": PROTOCOL, "capabilities": {}, "clientInfo": padded},
    }
    sessions_before = stack.redis_command("redis", "ZCARD", "mcp:sessions")
    headers = {"accept": ACCEPT, "content-type": "application/json", "mcp-protocol-version": PROTOCOL}
    response = httpx2.post(stack.config.mcp_url, json=body, headers=headers, timeout=30)
    assert response.status_code < 500, response.text
    message = final_message(response) if response.status_code == 200 else response.json()
    assert message["error"]["code"] == -32602 and "clientInfo" in message["error"]["message"], message
    assert stack.redis_command("redis", "ZCARD", "mcp:sessions") == sessions_before
    # A client within the bound opens its session as ever.
    assert "result" in final_message(
        httpx2.post(
            stack.config.mcp_url,
            json={**body, "params": {**body["params"], "clientInfo": {"name": "c", "version": "1"}}},
            headers=headers,
            timeout=30,
        )
    )
