"""Pattern: 2026-07-28 request state that any replica can open.

A multi-round-trip request (elicitation, sampling) ends its first leg with an
`InputRequiredResult` whose `requestState` the SDK seals; the client sends the
call again with its answers and that state, and the second leg may land on any
replica. The SDK seals under a key of its own process unless told otherwise,
so a second leg on another replica is refused ("Invalid or expired
requestState"). Here every replica seals and opens with the same ring
(REQUEST_STATE_KEYS: the first key seals, every key opens) and the same
audience (the server's name), so the legs may land anywhere.

The SDK still checks everything else on every leg: expiry
(REQUEST_STATE_TTL_SECONDS), the request the state was minted for, the
audience, and the principal, so a state minted for one principal is refused
for another. Rotating keys without downtime: docs/operations.md.

What it does not check is a second use. A sealed state is valid until it
expires, so a second leg sent again (or captured and sent by someone
holding the same credentials) would act twice. Here each state is claimed
in the store (`SessionStore.claim`) by the request that first brings it,
for as long as the state lives: a retry of that same request (the same
idempotency key or `X-Request-Id`, which HAProxy keeps across its own
re-sends) passes, and its writes replay (`idempotency.py`); any other use is
refused with -32602 and changes nothing. Only a state the SDK has opened is
claimed, so a forged one costs the store nothing; a claim counts against the
quota of the client that brings the state (MAX_CLIENT_BYTES).

The claim is taken before the call runs and kept however the call ends:
releasing it after a failure could let a retry under another key apply the
call's first writes twice. So a second leg whose call failed (or whose
replica died) is sent again with the same idempotency key, or the request
starts over from its first leg.
"""

from __future__ import annotations

import hashlib
import logging
import math
import uuid
from contextvars import ContextVar
from typing import Any

from fastmcp.server.middleware import Middleware, MiddlewareContext
from mcp.server.request_state import RequestStateSecurity
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS
from mcp_types.methods import INPUT_REQUIRED_METHODS

from .handles import current_client
from .idempotency import key_of
from .session_store import SessionStore
from .settings import Settings

log = logging.getLogger(__name__)


def request_state_security(settings: Settings, *, audience: str) -> RequestStateSecurity | None:
    """The sealing policy every replica shares; None (the SDK's per-process key) when no ring is set."""
    if not settings.request_state_keys:
        if settings.uses_redis:
            # Several replicas share this store, and each would seal under its own key.
            log.warning(
                "REQUEST_STATE_KEYS is unset: a multi-round-trip request whose legs land on two "
                "replicas will be refused; set the same ring on every replica"
            )
        return None
    return RequestStateSecurity(
        keys=list(settings.request_state_keys), ttl=settings.request_state_ttl_seconds, audience=audience
    )


REPLAYED = "This requestState was already used by another request; send the call without it to start over."
# The digest of the sealed state a request carries, noted before the SDK opens it (`NoteSealedState`).
_sealed: ContextVar[str | None] = ContextVar("sealed_request_state", default=None)


class NoteSealedState:
    """A server middleware of the SDK's, run just outside its `RequestStateBoundary`: notes which sealed
    state the request carries, which the boundary replaces with what it holds."""

    async def __call__(self, ctx: Any, call_next: Any) -> Any:
        # Only where the SDK opens a state: one on any other method is never checked, so never claimed.
        state = ctx.params.get("requestState") if ctx.params and ctx.method in INPUT_REQUIRED_METHODS else None
        token = _sealed.set(hashlib.sha256(state.encode()).hexdigest() if isinstance(state, str) else None)
        try:
            return await call_next(ctx)
        finally:
            _sealed.reset(token)


class RefuseReplays(Middleware):
    """A request bringing a state another request already brought is refused (module docstring)."""

    def __init__(self, store: SessionStore, *, ttl_seconds: float) -> None:
        self.store = store
        self.ttl_seconds = math.ceil(ttl_seconds)

    async def on_request(self, context: MiddlewareContext, call_next: Any) -> Any:
        # Set only once the SDK opened the state: a forged or expired one never gets here.
        sealed = _sealed.get()
        if sealed is not None:
            claimant = key_of(context) or uuid.uuid4().hex
            name = f"request-state:{sealed}"
            if not await self.store.claim(name, claimant, self.ttl_seconds, holder=current_client()):
                raise MCPError(INVALID_PARAMS, REPLAYED)
        return await call_next(context)
