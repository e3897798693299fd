"""MCP over plain HTTP, for tests that need to see the wire: status codes, headers, SSE."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx2

PROTOCOL = "2025-11-25"
ACCEPT = "application/json, text/event-stream"


@dataclass
class Event:
    """One SSE event: its id, and its JSON-RPC message (None for a priming event, which has no data)."""

    id: str | None
    message: dict | None


class EventStream:
    """An SSE response, read event by event as it arrives."""

    def __init__(self, response: httpx2.Response, request_id: int | None = None) -> None:
        self.response = response
        self.request_id = request_id

    async def __aiter__(self) -> AsyncIterator[Event]:
        event_id: str | None = None
        data: list[str] = []
        async for line in self.response.aiter_lines():
            if line:
                name, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if name == "id":
                    event_id = value
                elif name == "data":
                    data.append(value)
                continue  # comments (": ping") and other fields carry no event
            if event_id is not None or data:
                text = "\n".join(data)
                yield Event(event_id, json.loads(text) if text.strip() else None)
            event_id, data = None, []


class RawSession:
    """MCP over plain HTTP, as curl or another language's client would speak it."""

    def __init__(self, http: httpx2.AsyncClient, url: str, *, token: str | None = None) -> None:
        self.http = http
        self.url = url
        self.token = token  # a bearer token, for a stack with authentication on
        self.session_id: str | None = None
        self._next_id = 0

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": ACCEPT, "MCP-Protocol-Version": PROTOCOL}
        if self.session_id:
            headers["mcp-session-id"] = self.session_id
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
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

    def at(self, url: str, *, token: str | None = None) -> RawSession:
        """The same session spoken to another address (a replica directly, bypassing HAProxy), with the same
        token or, to act as someone else, `token`."""
        session = RawSession(self.http, url, token=token or self.token)
        session.session_id = self.session_id
        session._next_id = self._next_id
        return session

    @contextlib.asynccontextmanager
    async def stream(self, method: str, params: dict | None = None) -> AsyncIterator[EventStream]:
        """Send a request and read its SSE answer as it comes; leaving the block early cuts the connection."""
        self._next_id += 1
        body = {"jsonrpc": "2.0", "id": self._next_id, "method": method, "params": params or {}}
        async with self.http.stream("POST", self.url, headers=self.headers(), json=body) as response:
            yield EventStream(response, self._next_id)

    @contextlib.asynccontextmanager
    async def resume(self, last_event_id: str) -> AsyncIterator[EventStream]:
        """`GET` with `Last-Event-ID`: the rest of a stream, read as it comes."""
        headers = {**self.headers(), "Last-Event-ID": last_event_id}
        async with self.http.stream("GET", self.url, headers=headers) as response:
            yield EventStream(response)

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
    # SSE lines end at CR, LF or CRLF only: str.splitlines would also split at U+0085 or U+2028 inside a JSON string.
    lines = re.split(r"\r\n|\r|\n", response.text)
    return [json.loads(line[5:]) for line in lines if line.startswith("data:") and line[5:].strip()]


def last_jsonrpc_message(response: httpx2.Response) -> dict:
    return jsonrpc_messages(response)[-1]
