"""A 2026-07-28 call whose stream is cut: its client is told at once, by any replica, that it ended."""

from __future__ import annotations

import base64
import json

from mcp_types import (
    INTERNAL_ERROR,
    ErrorData,
    JSONRPCError,
)
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..idempotency import IDEMPOTENCY_KEY
from .event_store import MAX_STREAM_ID_BYTES

# A sessionless call's priming event id: this, then base64url(JSON [request id, whether it has a key]).
CUT_MARK = "mcp-ha-cut."
CUT = (
    "This call's response stream was cut before its answer (its replica stopped, or the connection broke), "
    "and a 2026-07-28 call ends with its stream: it is not running any more. {retry}"
)
CUT_KEYED = "Retrying is safe: send it again with the same idempotency key, and its writes apply once."
CUT_UNKEYED = (
    "Send it again to complete it. It carried no idempotency key ({key} in _meta), so writes it made "
    "before the cut may apply again; a tools/call with a key applies them once."
)
# The client's reconnection delay: any replica answers it at once (HAProxy skips a dead one).
CUT_RETRY_MS = 250


def sessionless(scope: Scope) -> bool:
    """A 2026-07-28 request: the SDK routes by this header alone (`adoption.session_era`, negated)."""
    version = Headers(scope=scope).get("mcp-protocol-version")
    return version is not None and version not in HANDSHAKE_PROTOCOL_VERSIONS


def cut_event_id(request_id: object, keyed: bool) -> str | None:
    """The priming event id naming a sessionless request; None for an id that cannot be named by one
    (not an integer or string, or too long)."""
    if isinstance(request_id, bool) or not isinstance(request_id, int | str):
        return None
    text = json.dumps([request_id, keyed], separators=(",", ":"))
    if len(text) > MAX_STREAM_ID_BYTES:
        return None
    return CUT_MARK + base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def cut_call_named(last_event_id: str | None) -> tuple[int | str, bool] | None:
    """The (request id, keyed) a `cut_event_id` names; None for any other id, however malformed."""
    if not last_event_id or not last_event_id.startswith(CUT_MARK) or len(last_event_id) > 2 * MAX_STREAM_ID_BYTES:
        return None
    encoded = last_event_id.removeprefix(CUT_MARK)
    try:
        found = json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
    except (ValueError, RecursionError):  # binascii.Error and UnicodeDecodeError are ValueErrors
        return None
    if not isinstance(found, list) or len(found) != 2:
        return None
    request_id, keyed = found
    if isinstance(request_id, bool) or not isinstance(request_id, int | str) or not isinstance(keyed, bool):
        return None
    return request_id, keyed


def cut_error(request_id: int | str, keyed: bool) -> JSONRPCError:
    """What the client of a cut sessionless call is told: the call ended, and a retry is safe."""
    retry = CUT_KEYED if keyed else CUT_UNKEYED.format(key=IDEMPOTENCY_KEY)
    error = ErrorData(code=INTERNAL_ERROR, message=CUT.format(retry=retry), data={"retryable": True})
    return JSONRPCError(jsonrpc="2.0", id=request_id, error=error)


async def answer_cut(send: Send, request_id: int | str, keyed: bool) -> None:
    """A 200 stream of one event, the cut call's error: only a message with the request's id ends the
    TypeScript client's call (any other status leaves it to its timeout)."""
    text = cut_error(request_id, keyed).model_dump_json(by_alias=True, exclude_unset=True)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache, no-transform")],
        }
    )
    await send({"type": "http.response.body", "body": f"event: message\r\ndata: {text}\r\n\r\n".encode()})


class CutCalls:
    """ASGI middleware: a sessionless call answered as an SSE stream opens with a priming event whose id
    names the request (`cut_event_id`) and a short `retry:`, so a client whose stream is cut reconnects
    with it and `CheckResumption` tells it at once that the call ended.

    Listen streams are left alone: the TypeScript client already ends those when they end."""

    def __init__(self, app: ASGIApp, *, retry_ms: int = CUT_RETRY_MS) -> None:
        self.app = app
        self.retry_ms = retry_ms

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (scope["method"] == "POST" and sessionless(scope)):
            return await self.app(scope, receive, send)
        body: list[bytes] = []  # BodyLimit, outside, bounds it

        async def keep_body() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                body.append(message.get("body", b""))
            return message

        async def send_priming(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.start":
                content_type = Headers(raw=message.get("headers", [])).get("content-type", "")
                if content_type.startswith("text/event-stream") and (event_id := self._event_id(b"".join(body))):
                    event = f"id: {event_id}\r\nretry: {self.retry_ms}\r\ndata: \r\n\r\n"
                    await send({"type": "http.response.body", "body": event.encode(), "more_body": True})

        await self.app(scope, keep_body, send_priming)

    @staticmethod
    def _event_id(body: bytes) -> str | None:
        """The priming event id for the request in `body`; None when it gets none. Parsed only once the
        answer streams: the SDK has parsed it already, so it is a valid request."""
        try:
            request = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(request, dict) or request.get("method") == "subscriptions/listen":
            return None
        params = request.get("params")
        meta = params.get("_meta") if isinstance(params, dict) else None
        keyed = isinstance(meta, dict) and isinstance(meta.get(IDEMPOTENCY_KEY), str)
        return cut_event_id(request.get("id"), keyed)
