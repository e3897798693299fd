"""Pattern: `/health` that tells a balancer the truth, and sheds work the replica cannot do.

`GET /health` answers 200 `{"status": "ok", "instance": ...}` while the
replica can reach its store, 503 `{"status": "degraded", ..., "store":
"unreachable"}` when it cannot, and 503 `{"status": "draining"}` once a drain
has let its calls finish (`drain.py`).

Calls retry the store for up to REDIS_RETRY_SECONDS from the start of an
outage (long enough for a Sentinel failover), so a replica that cannot reach
its store for a moment still serves: failing /health at once would take every
replica out of HAProxy together and turn a short failover into 503s for
everyone. Once the store has been gone longer, the replica sheds new requests
with a 503 that says why (HAProxy tries another replica), and fails /health
only when the calls it already took have answered: HAProxy cuts whatever is
still open on a replica it takes out (`drain.py` has the same reason to do
things in this order). A replica that has never reached its store has nothing
to ride out, and fails from its first check.

The body also carries the store's memory pressure (`store_memory`: bytes
used, Redis `maxmemory`, and `pressure` past 90%), read at most every
MEMORY_SECONDS: a full store refuses writes cleanly (`StoreFull`) and
evicts nothing, so pressure is a warning for the operator, not a reason to
take the replica out of rotation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse

from .drain import BALANCER_CHECK_HEADER, Drain
from .session_store import STORE_UNAVAILABLE, SessionStore

# Under HAProxy's 800 ms check timeout, so a hung store is answered (and
# forgiven, for a while) before HAProxy counts the check failed.
PING_SECONDS = 0.5
# How often a health check also reads the store's memory (one INFO, not one per check).
MEMORY_SECONDS = 5.0
# The share of maxmemory past which the health detail says "pressure".
PRESSURE_RATIO = 0.9

STORE_GONE = JSONResponse(
    {"jsonrpc": "2.0", "id": None, "error": {"code": -32000, "message": STORE_UNAVAILABLE}},
    status_code=503,
    headers={"retry-after": "1"},
)


class StoreHealth:
    """Whether this replica can serve, as far as its store goes; and what it does when it cannot."""

    def __init__(self, store: SessionStore, drain: Drain, *, grace_seconds: float) -> None:
        self.store = store
        self.drain = drain
        self.grace_seconds = grace_seconds
        self.unreachable_since: float | None = None
        self.reached = False
        self.memory: dict[str, object] | None = None
        self._memory_read_at = -MEMORY_SECONDS

    async def read_memory(self) -> dict[str, object] | None:
        """The store's memory pressure, read again when the last read is MEMORY_SECONDS old."""
        now = time.monotonic()
        if now - self._memory_read_at >= MEMORY_SECONDS:
            self._memory_read_at = now
            try:
                found = await asyncio.wait_for(self.store.memory(), PING_SECONDS)
            except TimeoutError:
                found = None
            if found is not None:
                used, most = found
                self.memory = {
                    "used_bytes": used,
                    "max_bytes": most,
                    "pressure": bool(most and used >= PRESSURE_RATIO * most),
                }
        return self.memory

    async def check(self) -> bool:
        try:
            reachable = await asyncio.wait_for(self.store.ping(), PING_SECONDS)
        except TimeoutError:
            reachable = False
        now = time.monotonic()
        if reachable:
            self.unreachable_since = None
            self.reached = True
            self.drain.shed(None)
            return True
        if self.unreachable_since is None:
            self.unreachable_since = now
        if self.reached and now - self.unreachable_since < self.grace_seconds:
            return True
        self.drain.shed(STORE_GONE)
        return self.drain.in_flight > 0


def health_endpoint(
    instance: str, drain: Drain, store_health: StoreHealth
) -> Callable[[Request], Awaitable[JSONResponse]]:
    """`GET /health`, as a Starlette endpoint (a function: Starlette serves a callable object as ASGI)."""

    async def health(request: Request) -> JSONResponse:
        if not drain.health_checked(balancer=request.headers.get(BALANCER_CHECK_HEADER)):
            return JSONResponse({"status": "draining", "instance": instance}, status_code=503)
        if await store_health.check():
            memory = await store_health.read_memory()
            detail = {} if memory is None else {"store_memory": memory}
            return JSONResponse({"status": "ok", "instance": instance, **detail})
        return JSONResponse({"status": "degraded", "instance": instance, "store": "unreachable"}, status_code=503)

    return health
