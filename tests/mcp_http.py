"""MCP over plain HTTP, for tests that need to see the wire: status codes, headers, SSE."""

from __future__ import annotations

import json

import httpx2

PROTOCOL = "2025-11-25"
ACCEPT = "application/json, text/event-stream"


class RawSession:
    """MCP over plain HTTP, as curl or another language's client would speak it."""

    def __init__(self, http: httpx2.AsyncClient, url: str) -> None:
        self.http = http
        self.url = url
        self.session_id: str | None = None
        self._next_id = 0

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": ACCEPT, "MCP-Protocol-Version": PROTOCOL}
        if self.session_id:
            headers["mcp-session-id"] = self.session_id
        return headers

    async def initialize(self) -> str:
        response = await self.post(
            "initialize",
            {"protocolVersion": PROTOCOL, "capabilities": {}, "clientInfo": {"name": "tests", "version": "1"}},
        )
        assert response.status_code == 200, response.text
        self.session_id = response.headers["mcp-session-id"]
        await self.http.post(
            self.url, headers=self.headers(), json={"jsonrpc": "2.0", "method": "notifications/initialized"}
        )
        return self.session_id

    async def post(self, method: str, params: dict | None = None) -> httpx2.Response:
        self._next_id += 1
        body = {"jsonrpc": "2.0", "id": self._next_id, "method": method, "params": params or {}}
        return await self.http.post(self.url, headers=self.headers(), json=body)

    async def call(self, tool: str, arguments: dict | None = None) -> dict:
        """A tool's structured result; fails the test on any error."""
        response = await self.post("tools/call", {"name": tool, "arguments": arguments or {}})
        assert response.status_code == 200, (response.status_code, response.text)
        message = last_jsonrpc_message(response)
        assert "result" in message and not message["result"].get("isError"), message
        return message["result"]["structuredContent"]


def jsonrpc_messages(response: httpx2.Response) -> list[dict]:
    """Every JSON-RPC message in a response, whether JSON or an SSE stream."""
    if response.headers.get("content-type", "").startswith("application/json"):
        return [response.json()]
    return [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:") and line[5:].strip()]


def last_jsonrpc_message(response: httpx2.Response) -> dict:
    return jsonrpc_messages(response)[-1]
