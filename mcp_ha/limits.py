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
- `SessionLimits`: an `initialize` is refused before the SDK opens anything
  for it (a refused initialize would otherwise leave a transport behind
  until it idles out): 400 (JSON-RPC -32602) when its clientInfo and
  capabilities, kept in the session's record for its life, take more than
  MAX_SESSION_RECORD_BYTES; 429 when its client (principal, or address when
  unauthenticated: `principals.client_of`) holds MAX_SESSIONS_PER_CLIENT
  sessions and handles; 503 when the store holds MAX_SESSIONS. Both with
  Retry-After. The store enforces the same two counts atomically when the
  session is recorded, so a race past this check is refused there.

- `OneAnswerPerId`: a request whose JSON-RPC id is still in flight on its
  session gets 409 with a JSON-RPC error, instead of the SDK keying both
  calls' answers by that id and one of them never answering. An id is in
  flight from its request until its answer is on its way: released when the
  event log takes the answer (an SSE answer; before it is sent), when a JSON
  answer starts, or when the request ends however it ends, so a client that
  reuses an id after reading its answer is never refused.

Elsewhere, each where the resource is: the event log's bounds
(`streams.SessionEvents`, the store's `max_log_bytes`), replays per session
and per replica (`streams.CheckResumption`), a session's state
(`max_state_bytes`) and a handle's count (`errors.py` answers both), listen
streams (`subscriptions.py`), and idle transports (SESSION_IDLE_SECONDS).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .adoption import session_era
from .principals import client_of, refused_by_auth
from .session_store import SessionStore, StoreUnavailable

# A client over a count waits for sessions to end or expire: a minute, not a hot loop.
RETRY_AFTER_SECONDS = 60


def refusal(status: int, message: str, *, code: int = -32600, id: Any = None, retry_after: int | None = None):
    """A JSON-RPC error answering `id` with an HTTP status (and Retry-After, for a bound that frees up)."""
    headers = None if retry_after is None else {"Retry-After": str(retry_after)}
    body = {"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def _too_large(max_bytes: int) -> JSONResponse:
    return refusal(413, f"Request body over {max_bytes} bytes")


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


class SessionLimits:
    """ASGI middleware: an initialize past a bound is refused before the SDK sees it (module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: SessionStore,
        max_record_bytes: int,
        max_sessions: int,
        max_sessions_per_client: int,
        path: str = "/mcp",
    ) -> None:
        self.app = app
        self.store = store
        self.max_record_bytes = max_record_bytes
        self.max_sessions = max_sessions
        self.max_sessions_per_client = max_sessions_per_client
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] != self.path
            or scope["method"] != "POST"
            or "mcp-session-id" in Headers(scope=scope)
            or not session_era(scope)
            or refused_by_auth(scope)
        ):
            return await self.app(scope, receive, send)
        request, replay = await _peek_json(receive)
        if not isinstance(request, dict) or request.get("method") != "initialize":
            return await self.app(scope, replay, send)
        params = request.get("params")
        params = params if isinstance(params, dict) else {}
        size = sum(
            len(json.dumps(params.get(part), separators=(",", ":"), ensure_ascii=False).encode()) for part in _RECORDED
        )
        if size > self.max_record_bytes:
            message = (
                f"clientInfo and capabilities take {size} bytes; this server keeps at most {self.max_record_bytes}"
            )
            return await refusal(400, message, code=-32602, id=request.get("id"))(scope, replay, send)
        try:
            mine = await self.store.count_sessions(holder=client_of(scope))
            everyone = await self.store.count_sessions() if mine < self.max_sessions_per_client else 0
        except StoreUnavailable:
            return await refusal(503, "Session store unavailable", retry_after=1)(scope, replay, send)
        if mine >= self.max_sessions_per_client:
            message = (
                f"You hold {self.max_sessions_per_client} open sessions, the most one client may: "
                "end some (DELETE) or wait for them to expire"
            )
            return await refusal(429, message, id=request.get("id"), retry_after=RETRY_AFTER_SECONDS)(
                scope, replay, send
            )
        if everyone >= self.max_sessions:
            message = f"This server holds {self.max_sessions} sessions, the most it may; try again later"
            return await refusal(503, message, id=request.get("id"), retry_after=RETRY_AFTER_SECONDS)(
                scope, replay, send
            )
        await self.app(scope, replay, send)


# What a session's record keeps of its initialize.
_RECORDED = ("clientInfo", "capabilities")


async def _peek_json(receive: Receive) -> tuple[Any, Receive]:
    """The request's body as JSON (None if it is not JSON: the SDK answers that itself), and a receive
    that gives the app the body again. BodyLimit, outside, has bounded it."""
    messages: list[Message] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    try:
        request = json.loads(b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request"))
    except (ValueError, RecursionError):
        request = None
    return request, _replay(messages, then=receive)


class InFlight:
    """The JSON-RPC ids in flight on each session, on this replica."""

    def __init__(self) -> None:
        self._ids: dict[str, set[str]] = {}

    def take(self, session_id: str, request_id: str) -> bool:
        """Mark `request_id` in flight on `session_id`; False if it already is."""
        ids = self._ids.setdefault(session_id, set())
        if request_id in ids:
            return False
        ids.add(request_id)
        return True

    def release(self, session_id: str, request_id: str) -> None:
        ids = self._ids.get(session_id)
        if ids is not None:
            ids.discard(request_id)
            if not ids:
                del self._ids[session_id]


class OneAnswerPerId:
    """ASGI middleware: a request id still in flight on its session gets 409 (module docstring)."""

    def __init__(self, app: ASGIApp, *, in_flight: InFlight, path: str = "/mcp") -> None:
        self.app = app
        self.in_flight = in_flight
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        session_id = Headers(scope=scope).get("mcp-session-id") if scope["type"] == "http" else None
        if session_id is None or scope["path"] != self.path or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        request, replay = await _peek_json(receive)
        request_id = request.get("id") if isinstance(request, dict) and "method" in request else None
        if request_id is None or isinstance(request_id, bool | dict | list):
            return await self.app(scope, replay, send)
        key = str(request_id)  # as the SDK keys a request's stream
        if not self.in_flight.take(session_id, key):
            message = (
                f"A request with id {json.dumps(request_id)[:64]} is still in flight on this session; use another id"
            )
            return await refusal(409, message, id=request_id)(scope, replay, send)

        async def send_answer(message: Message) -> None:
            if message["type"] == "http.response.start":
                content_type = Headers(raw=message.get("headers", [])).get("content-type", "")
                if not content_type.startswith("text/event-stream"):
                    self.in_flight.release(session_id, key)  # a whole answer, before a byte of it is sent
            await send(message)

        try:
            await self.app(scope, replay, send_answer)
        finally:
            self.in_flight.release(session_id, key)
