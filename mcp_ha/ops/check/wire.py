"""MCP over plain HTTP, the one raw client of the kit: for tests that need to see the wire (status codes,
headers, SSE), and for the benchmarks (tools.bench, tools.failover_bench), which want a client whose own
overhead stays small.

    RawSession          session-era MCP (2025-11-25): initialize, then mcp-session-id on every request
    SessionlessSession  2026-07-28 MCP: no initialize; each request carries its `_meta` and names its
                        method (and tool) in headers

Two ways to call a tool: `call_tool` raises `CallFailed` for an answer that is not a success (an
httpx2.HTTPError or, past `timeout`, TimeoutError as they come; the benchmarks count them all), `call`
fails a test (AssertionError). SSE is split into lines at CR, LF or CRLF only, as the SSE
specification says: `str.splitlines` (and httpx's `aiter_lines`, which uses it) would also split at
U+0085, U+2028 and others inside a JSON string.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx2

PROTOCOL = "2025-11-25"
SESSIONLESS_PROTOCOL = "2026-07-28"
ACCEPT = "application/json, text/event-stream"

# An SSE line ends at CR, LF or CRLF, and nowhere else.
_LINE_END = re.compile(r"\r\n|\r|\n")


class CallFailed(Exception):
    """An answer that is not a successful one: an HTTP error status, no JSON-RPC message in it, a JSON-RPC
    error, a tool error. The message says which, with the start of what came back."""


@dataclass
class Event:
    """One SSE event: its id, and its JSON-RPC message (None for a priming event, which has no data)."""

    id: str | None
    message: dict[str, Any] | None


async def sse_lines(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The lines of an SSE stream as they arrive, split at CR, LF or CRLF only."""
    pending = ""
    async for chunk in chunks:
        text = pending + chunk
        # A CR at the very end may be the first half of a CRLF: decide once the next chunk is in.
        held = text.endswith("\r")
        lines = _LINE_END.split(text[:-1] if held else text)
        pending = lines.pop() + ("\r" if held else "")
        for line in lines:
            yield line
    if pending:  # the last line, ended by a CR or by the end of the stream
        yield pending.removesuffix("\r")


class EventStream:
    """An SSE response, read event by event as it arrives."""

    def __init__(self, response: httpx2.Response, request_id: int | None = None) -> None:
        self.response = response
        self.request_id = request_id

    async def __aiter__(self) -> AsyncIterator[Event]:
        event_id: str | None = None
        data: list[str] = []
        async for line in sse_lines(self.response.aiter_text()):
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
    """MCP over plain HTTP, as curl or another language's client would speak it.

    `timeout`, when given, bounds each request as a whole (httpx's own timeout bounds each read, so a
    trickling answer could outlast it): past it, TimeoutError. `client_name` is the clientInfo name.
    """

    protocol = PROTOCOL

    def __init__(
        self,
        http: httpx2.AsyncClient,
        url: str,
        *,
        token: str | None = None,
        timeout: float | None = None,
        client_name: str = "tests",
    ) -> None:
        self.http = http
        self.url = url
        self._token = token  # a bearer token, for a stack with authentication on
        self._session_id: str | None = None
        self.timeout = timeout
        self.client_name = client_name
        self._next_id = 0
        # The headers every request sends, built once per session id and token (never mutated once built).
        self._wire: dict[str, str] | None = None

    @property
    def session_id(self) -> str | None:
        return self._session_id

    @session_id.setter
    def session_id(self, value: str | None) -> None:
        self._session_id = value
        self._wire = None

    @property
    def token(self) -> str | None:
        return self._token

    @token.setter
    def token(self, value: str | None) -> None:
        self._token = value
        self._wire = None

    def headers(self) -> dict[str, str]:
        """The headers of this session's requests (a new dict, the caller's to change)."""
        headers = {"Content-Type": "application/json", "Accept": ACCEPT, "MCP-Protocol-Version": self.protocol}
        if self._session_id:
            headers["mcp-session-id"] = self._session_id
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    def _wire_headers(self, method: str, params: dict[str, Any]) -> dict[str, str]:
        wire = self._wire
        if wire is None:
            wire = self._wire = self.headers()
        return wire

    async def open(self) -> str:
        """initialize, then notifications/initialized; the session id. CallFailed when it cannot."""
        response = await self.post(
            "initialize",
            {
                "protocolVersion": self.protocol,
                "capabilities": {},
                "clientInfo": {"name": self.client_name, "version": "1"},
            },
        )
        message = final_message(response)
        if "result" not in message:
            raise CallFailed(f"initialize failed: {json.dumps(message)[:160]}")
        session_id = response.headers.get("mcp-session-id")
        if not session_id:
            raise CallFailed("initialize answered without an mcp-session-id")
        self.session_id = session_id
        await self.notify("notifications/initialized")
        return session_id

    async def initialize(self) -> str:
        """`open`, failing the test on any error."""
        try:
            return await self.open()
        except CallFailed as exc:
            raise AssertionError(str(exc)) from exc

    def at(self, url: str, *, token: str | None = None) -> RawSession:
        """The same session spoken to another address (a replica directly, bypassing HAProxy), with the same
        token or, to act as someone else, `token`."""
        session = type(self)(
            self.http, url, token=token or self.token, timeout=self.timeout, client_name=self.client_name
        )
        session.session_id = self.session_id
        session._next_id = self._next_id
        return session

    @contextlib.asynccontextmanager
    async def stream(self, method: str, params: dict[str, Any] | None = None) -> AsyncIterator[EventStream]:
        """Send a request and read its SSE answer as it comes; leaving the block early cuts the connection."""
        self._next_id += 1
        params = params or {}
        body = {"jsonrpc": "2.0", "id": self._next_id, "method": method, "params": self._params(params)}
        headers = self._wire_headers(method, params)
        async with self.http.stream("POST", self.url, headers=headers, json=body) as response:
            yield EventStream(response, self._next_id)

    @contextlib.asynccontextmanager
    async def resume(self, last_event_id: str) -> AsyncIterator[EventStream]:
        """`GET` with `Last-Event-ID`: the rest of a stream, read as it comes."""
        headers = {**self.headers(), "Last-Event-ID": last_event_id}
        async with self.http.stream("GET", self.url, headers=headers) as response:
            yield EventStream(response)

    def _params(self, params: dict[str, Any]) -> dict[str, Any]:
        return params

    async def post(
        self, method: str, params: dict[str, Any] | None = None, *, headers: dict[str, str] | None = None
    ) -> httpx2.Response:
        """One JSON-RPC request, its answer as it came (any status); `headers` are added to this one only
        (an X-Request-Id, say). An idempotency key goes in `params["_meta"]`."""
        self._next_id += 1
        if params is None:
            params = {}
        body = {"jsonrpc": "2.0", "id": self._next_id, "method": method, "params": self._params(params)}
        wire = self._wire_headers(method, params)
        if headers:
            wire = {**wire, **headers}
        # _send's work, inline: every call of a benchmark's hot path comes through here.
        if self.timeout is None:
            return await self.http.post(self.url, headers=wire, json=body)
        async with asyncio.timeout(self.timeout):
            return await self.http.post(self.url, headers=wire, json=body)

    async def notify(self, method: str, params: dict[str, Any] | None = None) -> httpx2.Response:
        """A JSON-RPC notification (no id, no answer but a status)."""
        body: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            body["params"] = params
        return await self._send(body, self._wire_headers(method, params or {}), None)

    async def _send(self, body: dict[str, Any], wire: dict[str, str], extra: dict[str, str] | None) -> httpx2.Response:
        if extra:
            wire = {**wire, **extra}
        if self.timeout is None:
            return await self.http.post(self.url, headers=wire, json=body)
        async with asyncio.timeout(self.timeout):
            return await self.http.post(self.url, headers=wire, json=body)

    async def call_tool(
        self, tool: str, arguments: dict[str, Any] | None = None, *, headers: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """A tool's structured result; CallFailed on an HTTP error, a JSON-RPC error or a tool error."""
        response = await self.post(
            "tools/call", {"name": tool, "arguments": {} if arguments is None else arguments}, headers=headers
        )
        return tool_result(final_message(response))

    async def call(self, tool: str, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
        """A tool's structured result; fails the test on any error."""
        try:
            return await self.call_tool(tool, arguments)
        except CallFailed as exc:
            raise AssertionError(str(exc)) from exc

    async def close(self) -> None:
        """End the session (DELETE); an answer that does not come is let go: the session expires anyway."""
        if not self._session_id:
            return
        try:
            async with asyncio.timeout(self.timeout):
                await self.http.delete(self.url, headers=self._wire_headers("", {}))
        except (httpx2.HTTPError, TimeoutError):
            pass


class SessionlessSession(RawSession):
    """2026-07-28 MCP: no initialize and no session id. Every request carries the protocol version, client
    info and capabilities in `params._meta`, and its method (and, with a `name`, the tool) in the Mcp-Method
    and Mcp-Name headers. State lives under a handle: `open` asks `create_session` for one and keeps it
    in `handle`; the caller passes it to the tools that keep state."""

    protocol = SESSIONLESS_PROTOCOL

    def __init__(
        self,
        http: httpx2.AsyncClient,
        url: str,
        *,
        token: str | None = None,
        timeout: float | None = None,
        client_name: str = "tests",
    ) -> None:
        super().__init__(http, url, token=token, timeout=timeout, client_name=client_name)
        self.meta = {
            "io.modelcontextprotocol/protocolVersion": SESSIONLESS_PROTOCOL,
            "io.modelcontextprotocol/clientInfo": {"name": client_name, "version": "1"},
            "io.modelcontextprotocol/clientCapabilities": {},
        }
        self.handle: str | None = None
        # Per method, per name: the headers, built once each.
        self._by_method: dict[str, dict[str | None, dict[str, str]]] = {}

    def _wire_headers(self, method: str, params: dict[str, Any]) -> dict[str, str]:
        base = self._wire
        if base is None:
            base = self._wire = self.headers()
            self._by_method = {}
        names = self._by_method.get(method)
        if names is None:
            names = self._by_method[method] = {}
        name = params.get("name")
        wire = names.get(name)
        if wire is None:
            wire = names[name] = {**base, "Mcp-Method": method}
            if isinstance(name, str):
                wire["Mcp-Name"] = name
        return wire

    def _params(self, params: dict[str, Any]) -> dict[str, Any]:
        meta = params.get("_meta")
        return {**params, "_meta": self.meta if meta is None else {**self.meta, **meta}}

    async def open(self) -> str:
        """A handle from `create_session`; CallFailed when none comes."""
        handle = (await self.call_tool("create_session")).get("session_id")
        if not isinstance(handle, str) or not handle:
            raise CallFailed("create_session answered without a session_id")
        self.handle = handle
        return handle

    async def close(self) -> None:
        """Nothing to end: a handle expires with the session TTL, like any idle session."""


def _data_field(text: str, end: int) -> tuple[int, str]:
    """The last `data:` field of an SSE text that starts before `end`: where it starts, and its value
    ((-1, "") when there is none). A field starts a line: it begins the text or follows a CR or LF, and
    its line ends at the next CR or LF (a JSON string holds neither raw). Searched from the end, as a
    benchmark wants only the last message: no list of every line is made."""
    while (at := text.rfind("data:", 0, end)) >= 0:
        if at == 0 or text[at - 1] in "\r\n":
            start = at + 5
            stop = text.find("\n", start)
            if stop < 0:
                stop = len(text)
            cr = text.find("\r", start, stop)
            return at, text[start : stop if cr < 0 else cr]
        end = at
    return -1, ""


def jsonrpc_messages(response: httpx2.Response) -> list[dict[str, Any]]:
    """Every JSON-RPC message in a response, whether JSON or an SSE stream."""
    if response.headers.get("content-type", "").startswith("application/json"):
        return [response.json()]
    text = response.text
    values = []
    at, value = _data_field(text, len(text))
    while at >= 0:
        if value.strip():
            values.append(value)
        at, value = _data_field(text, at)
    return [json.loads(value) for value in reversed(values)]


def last_jsonrpc_message(response: httpx2.Response) -> dict[str, Any]:
    return jsonrpc_messages(response)[-1]


def final_message(response: httpx2.Response) -> dict[str, Any]:
    """The last JSON-RPC message of a 200 answer, JSON or SSE (only that one is parsed); CallFailed for
    another status or an answer with no message in it."""
    if response.status_code != 200:
        raise CallFailed(f"HTTP {response.status_code}: {response.text[:160]}")
    if response.headers.get("content-type", "").startswith("application/json"):
        message = response.json()
    else:
        text = response.text
        at, value = _data_field(text, len(text))
        while at >= 0 and not value.strip():  # a priming event's empty data
            at, value = _data_field(text, at)
        if at < 0:
            raise CallFailed("an answer with no message in it")
        message = json.loads(value)
    if not isinstance(message, dict):
        raise CallFailed(f"not a JSON-RPC message: {json.dumps(message)[:160]}")
    return message


def tool_result(message: dict[str, Any]) -> dict[str, Any]:
    """A tools/call answer's structured result; CallFailed for a JSON-RPC error or a tool error."""
    result = message.get("result")
    if not isinstance(result, dict):
        raise CallFailed(f"no result: {json.dumps(message)[:160]}")
    if result.get("isError"):
        raise CallFailed(f"tool error: {json.dumps(result.get('content'))[:160]}")
    return result.get("structuredContent") or {}
