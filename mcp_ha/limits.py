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
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _too_large(max_bytes: int) -> JSONResponse:
    return JSONResponse(
        {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": f"Request body over {max_bytes} bytes"}},
        status_code=413,
    )


class BodyLimit:
    """ASGI middleware: a body to `path` over `max_bytes` gets 413 (module docstring)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, path: str = "/mcp") -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.path = path

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
        await self.app(scope, _replay([{"type": "http.request", "body": b"".join(chunks)}], then=receive), send)


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
