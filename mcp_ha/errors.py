"""Pattern: a store's refusal is a clear answer, never a traceback.

What a tool's write can meet, each with what the client is told:

- the store is unreachable (`StoreUnavailable`): a tool error saying so
  (`STORE_UNAVAILABLE`); a keyed call may be sent again, its writes replay;
- the store is full (`StoreFull`, Redis past `maxmemory`): a tool error
  saying so (`STORE_FULL`); nothing was applied, nothing live was evicted;
- another replica adopted the session while the call ran (`Fenced`), and the
  call has no key or was fenced again after taking the session back
  (`adoption.RetakeFenced` runs a keyed one once more): nothing was applied,
  the client is told to call again (`SESSION_MOVED`), and the session is
  marked stale here so the next request adopts it afresh;
- the idempotency key was used for a different call (`OpReused`): a JSON-RPC
  invalid-params error (`KEY_REUSED`);
- the write or new handle would pass one of the store's bounds
  (`LimitExceeded`): a tool error naming the bound; nothing was applied.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastmcp.exceptions import ToolError
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, INVALID_REQUEST
from starlette.responses import JSONResponse

from .refusals import STORE_QUOTA, refused
from .session_store import STORE_UNAVAILABLE, Conflict, Fenced, LimitExceeded, OpReused, StoreFull, StoreUnavailable

log = logging.getLogger(__name__)

# Told when another replica adopted the session while the call ran: nothing was applied.
SESSION_MOVED = "This session moved to another replica; call again."
# Told when an idempotency key comes back with a different call (`idempotency.py`).
KEY_REUSED = "This idempotency key was already used for a different call"

# Told when Redis refuses a write past its maxmemory: it evicts nothing live, so nothing is lost either.
STORE_FULL = "Session store is full; nothing was applied. Try again later."
# Told when an apply-once block kept meeting concurrent changes: nothing was applied.
SESSION_BUSY = "This session changed while the call ran, again and again; nothing was applied. Call again."
# The exceptions this module answers: expected, so their tracebacks are not logged (`logs.Expected`).
ANSWERED = (StoreUnavailable, Fenced, OpReused, Conflict, LimitExceeded)


def refusal(
    status: int,
    message: str,
    *,
    code: int = INVALID_REQUEST,
    id: Any = None,
    retry_after: int | None = None,
    bound: str | None = None,
) -> JSONResponse:
    """The kit's every HTTP refusal: a JSON-RPC error answering `id` (None: no request read), with an HTTP
    status, and Retry-After for what frees up. `bound`: the setting refused past, counted and logged
    (refusals.py); made per refusal, so each is counted once."""
    if bound is not None:
        refused(bound)
    headers = None if retry_after is None else {"Retry-After": str(retry_after)}
    body = {"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


class StoreErrors(Middleware):
    """`on_fenced(session_id)`: a write of that session was fenced off (`adoption.Ownership.lost`)."""

    def __init__(self, *, on_fenced: Callable[[str], None]) -> None:
        self.on_fenced = on_fenced

    async def on_call_tool(self, context: MiddlewareContext, call_next: CallNext) -> Any:
        try:
            return await call_next(context)
        except (ToolError, *ANSWERED) as exc:
            # Raised in a tool, FastMCP has already wrapped it; the cause says why.
            cause = exc.__cause__ if isinstance(exc, ToolError) else exc
            if isinstance(cause, StoreFull):
                log.warning("store full during %s: %s", context.message.name, cause)
                raise ToolError(STORE_FULL) from cause
            if isinstance(cause, StoreUnavailable):
                log.warning("store unavailable during %s: %s", context.message.name, cause)
                raise ToolError(STORE_UNAVAILABLE) from cause
            if isinstance(cause, Fenced):
                log.info("write fenced off during %s: the session has a newer owner", context.message.name)
                if context.fastmcp_context is not None and context.fastmcp_context.session_id:
                    self.on_fenced(context.fastmcp_context.session_id)
                raise ToolError(SESSION_MOVED) from cause
            if isinstance(cause, OpReused):
                raise MCPError(INVALID_PARAMS, KEY_REUSED) from cause
            if isinstance(cause, Conflict):
                raise ToolError(SESSION_BUSY) from cause
            if isinstance(cause, LimitExceeded):
                refused(STORE_QUOTA, str(cause))
                # The client's doing, answered in its own words: logged below ERROR (refusals.py logs the count).
                raise ToolError(f"Refused: {cause}. Nothing was applied.", log_level=logging.DEBUG) from cause
            raise
