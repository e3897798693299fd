"""Pattern: idempotency keys, so a retried tool call is applied at most once.

A client that retries after a failure cannot know whether its first attempt
was applied. So every `tools/call` may carry a key in its `_meta`
(`IDEMPOTENCY_KEY`); where the client sent none, the `X-Request-Id` that
HAProxy stamps on each request serves instead (it stays the same across
HAProxy's own retries and redispatches, so those apply once too).

Records are kept per session (the handle a sessionless call passes, else the
MCP session), so a key only ever matches calls of the same session.

For a call with a key, this middleware:

- answers a repeat with the recorded result, without running the tool again;
- refuses a repeat whose tool or arguments differ, with a JSON-RPC error;
- otherwise runs the tool with `current_call` set, so every store write the
  tool makes through a `Session` carries an op id derived from the key. The
  store commits each write together with its op record (one Lua script), so a
  replica killed mid-call never leaves a change without its record, and the
  retry, wherever it lands, replays the write instead of applying it twice.

Tools whose effects live outside the store get at-most-once only from the
recorded result, which is written after they return. Tools annotated
`readOnlyHint` skip all of this: running a read again is its safe replay.
"""

from __future__ import annotations

import hashlib
import json
from contextvars import ContextVar
from typing import Any

from fastmcp.server.dependencies import get_http_request
from fastmcp.server.middleware import Middleware, MiddlewareContext
from fastmcp.tools.base import ToolResult
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, ContentBlock
from pydantic import TypeAdapter

from session_handles import session_era_id
from session_store import SessionStore, is_session_id

IDEMPOTENCY_KEY = "io.github.mcp-ha-kit/idempotency-key"
REQUEST_ID_HEADER = "x-request-id"
MAX_KEY_LENGTH = 200

# The op-id prefix of the call being served, for `Session` writes; None without a key.
current_call: ContextVar[str | None] = ContextVar("current_call", default=None)

_content = TypeAdapter(list[ContentBlock])


def _key_of(context: MiddlewareContext) -> str | None:
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
        raise MCPError(INVALID_PARAMS, f"{IDEMPOTENCY_KEY} must be a printable string of 1 to {MAX_KEY_LENGTH} characters")
    return key


def _scope_of(context: MiddlewareContext) -> str | None:
    """The session whose state the call works on: its handle, else its MCP session."""
    handle = (context.message.arguments or {}).get("session_id")
    if handle is not None:
        # A handle that is not one is refused by the tool; no record is kept for it.
        return handle if is_session_id(handle) else None
    return session_era_id(context.fastmcp_context)


def _digest(name: str, arguments: dict[str, Any] | None) -> str:
    canonical = json.dumps([name, arguments or {}], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


class IdempotentCalls(Middleware):
    def __init__(self, store: SessionStore) -> None:
        self.store = store
        # Per tool name, looked up once: FastMCP's tool lookup walks its providers
        # and cost ~5% of a replica's CPU per call (py-spy, increment_counter load).
        self._read_only_tools: dict[str, bool] = {}

    async def _read_only(self, context: MiddlewareContext) -> bool:
        """A tool annotated readOnlyHint changes nothing: running it again is the safe replay."""
        name = context.message.name
        if name not in self._read_only_tools:
            tool = await context.fastmcp_context.fastmcp.get_tool(name)
            if tool is None:
                return False  # unknown: FastMCP answers it; not worth remembering
            self._read_only_tools[name] = bool(tool.annotations and tool.annotations.readOnlyHint)
        return self._read_only_tools[name]

    async def on_call_tool(self, context: MiddlewareContext, call_next):
        key = _key_of(context)
        if key is None or context.fastmcp_context is None or await self._read_only(context):
            return await call_next(context)
        session_id = _scope_of(context)
        if session_id is None:
            # A sessionless call without a handle has no session to keep a record in.
            return await call_next(context)
        digest = _digest(context.message.name, context.message.arguments)
        record_id = f"call:{key}"
        prior = await self.store.recall(session_id, record_id)
        if prior is not None:
            if prior["digest"] != digest:
                raise MCPError(INVALID_PARAMS, "This idempotency key was already used for a different call")
            return ToolResult(content=_content.validate_python(prior["content"]), structured_content=prior["structured"])
        # The digest is part of the op ids, so the same key with other arguments
        # can never replay this call's writes.
        token = current_call.set(f"{key}:{digest[:12]}")
        try:
            result = await call_next(context)
        finally:
            current_call.reset(token)
        await self.store.remember(session_id, record_id, {
            "digest": digest,
            "structured": result.structured_content,
            "content": [block.model_dump(mode="json", by_alias=True, exclude_none=True) for block in result.content],
        })
        return result
