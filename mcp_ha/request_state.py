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
"""

from __future__ import annotations

import logging

from mcp.server.request_state import RequestStateSecurity

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
