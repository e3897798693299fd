"""Pattern: idempotency keys, so a retried tool call is applied at most once.

A client that retries after a failure cannot know whether its first attempt
was applied. So every `tools/call` may carry a key in its `_meta`
(`IDEMPOTENCY_KEY`); where the client sent none, the `X-Request-Id` that
HAProxy stamps on each request serves instead (it stays the same across
HAProxy's own retries and redispatches, so those apply once too).

For a call with a key, this middleware sets `current_call` to the key and a
digest of the call (tool and arguments) while the tool runs. Every store
write the tool makes through a `Session` then carries an op (`Op`: the key,
the digest, and the write's name: its operation, state key and count), and
the store commits each write together with its op record, in one Lua
script. So:

- a repeat of the call, wherever it lands (after a replica was killed
  mid-call, or after HAProxy re-sent it), runs the tool again, but each of its
  writes replays the recorded result instead of applying twice, and the tool
  answers as the first run did;
- a repeat whose tool or arguments differ is refused: its digest does not
  match the recorded one, the store raises `OpReused` and applies nothing,
  and `errors.StoreErrors` answers with a JSON-RPC error (`KEY_REUSED`);
- records are kept per session (the session the write goes to), so a key
  only ever matches calls of the same session.

Nothing is read or written for the key itself: the at-most-once guarantee
rides on the writes, so a call costs no extra round trip. Reads simply run
again. Tools whose effects live outside the store must make those effects
idempotent themselves; `current_call` gives them the key to do it with.
"""

from __future__ import annotations

import hashlib
import json
from contextvars import ContextVar
from typing import Any

from fastmcp.server.dependencies import get_http_request
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from fastmcp.tools import ToolResult
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, CallToolRequestParams

IDEMPOTENCY_KEY = "io.github.mcp-ha-kit/idempotency-key"
REQUEST_ID_HEADER = "x-request-id"
MAX_KEY_LENGTH = 200

# The call being served, as (idempotency key, digest), for `Session` writes; None without a key.
current_call: ContextVar[tuple[str, str] | None] = ContextVar("current_call", default=None)
# Told to the client (JSON-RPC -32602) when a write finds its key recorded for another call (`OpReused`).


def key_of(context: MiddlewareContext) -> str | None:
    request = context.fastmcp_context.request_context if context.fastmcp_context else None
    key = (getattr(request, "meta", None) or {}).get(IDEMPOTENCY_KEY)
    if key is None:
        try:
            key = get_http_request().headers.get(REQUEST_ID_HEADER)
        except RuntimeError:  # not over HTTP
            return None
    if key is None:
        return None
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_LENGTH or not key.isprintable():
        raise MCPError(
            INVALID_PARAMS, f"{IDEMPOTENCY_KEY} must be a printable string of 1 to {MAX_KEY_LENGTH} characters"
        )
    return key


def _digest(name: str, arguments: dict[str, Any] | None) -> str:
    canonical = json.dumps([name, arguments or {}], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


class IdempotentCalls(Middleware):
    async def on_call_tool(
        self,
        context: MiddlewareContext[CallToolRequestParams],
        call_next: CallNext[CallToolRequestParams, ToolResult],
    ) -> ToolResult:
        key = key_of(context)
        if key is None:
            return await call_next(context)
        token = current_call.set((key, _digest(context.message.name, context.message.arguments)))
        try:
            return await call_next(context)
        finally:
            current_call.reset(token)
