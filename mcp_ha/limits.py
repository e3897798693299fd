"""Pattern: nothing one client sends can take what every client shares.

A bound on each shared resource, each a setting with a safe default, each
answered with a clear error when hit (docs/operations.md lists them).

- `BodyLimit`: a request body to the MCP endpoint is at most
  MAX_BODY_BYTES, however it is sent. HAProxy refuses a larger declared
  Content-Length itself, but a chunked body declares none, and HAProxy only
  measures what it buffered; so the replica counts what arrives and answers
  413 with a JSON-RPC error past the bound, before the SDK sees a byte. A
  body within it is read whole first (MCP messages are small, and HAProxy
  buffers them anyway), so the app gets it as it was sent.
- The same class refuses a request whose JSON-RPC id is already in flight
  on the same session here: the SDK keys a session's response streams by
  request id, so a second one would take the first one's answer (or leave
  one call hanging). It gets 409 with a JSON-RPC error; the first goes on.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _too_large(max_bytes: int) -> JSONResponse:
    return JSONResponse(
        {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": f"Request body over {max_bytes} bytes"}},
        status_code=413,
    )


def _in_flight(request_id: Any) -> JSONResponse:
    message = f"Request id {json.dumps(request_id)[:100]} is already in flight on this session; use another id"
    return JSONResponse(
        {"jsonrpc": "2.0", "id": request_id, "error": {"code": -32600, "message": message}}, status_code=409
    )


class BodyLimit:
    """ASGI middleware: a body to `path` over `max_bytes` gets 413, and a request id already in flight on
    its session here gets 409 (module docstring)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, path: str = "/mcp") -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.path = path
        # (session id, request id as JSON) of the requests being served; as many as are in flight.
        self._in_flight: set[tuple[str, str]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != self.path or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _too_large(self.max_bytes)(scope, receive, send)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: the app hears it too
                return await self.app(scope, _replay([message]), send)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await _too_large(self.max_bytes)(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = _replay([{"type": "http.request", "body": body}], then=receive)
        key = _request_key(scope, body)
        if key is None:
            return await self.app(scope, replayed, send)
        if key in self._in_flight:
            return await _in_flight(json.loads(key[1]))(scope, receive, send)
        self._in_flight.add(key)
        try:
            await self.app(scope, replayed, send)
        finally:
            self._in_flight.discard(key)


def _request_key(scope: Scope, body: bytes) -> tuple[str, str] | None:
    """(session id, request id as JSON) for a JSON-RPC request on a session; None for anything else."""
    session_id = Headers(scope=scope).get("mcp-session-id")
    if session_id is None:
        return None
    try:
        message = json.loads(body)
    except (ValueError, RecursionError):
        return None  # the SDK answers it
    if not isinstance(message, dict) or "method" not in message or message.get("id") is None:
        return None  # a notification, a response or a batch: nothing is answered under its id
    return session_id, json.dumps(message["id"])


def _replay(messages: list[Message], *, then: Receive | None = None) -> Receive:
    """A receive that gives `messages`, then whatever `then` gives (a disconnect, for a streaming answer)."""
    pending = list(messages)

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        if then is None:
            return {"type": "http.disconnect"}
        return await then()

    return receive
