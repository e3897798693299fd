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
only when the calls it already took have answered: a balancer that marks a
replica down may cut whatever is still open on it (`drain.py` has the same
reason to do things in this order; the kit's HAProxy only stops sending work
to a replica that answers 503, and cuts nothing). A replica that has never
reached its store has nothing to ride out, and fails from its first check.

`GET /livez` answers 200 `{"status": "alive", "instance": ...}` from the
event loop and asks nothing of the store: a liveness probe for a platform
that restarts what hangs (Kubernetes). A replica whose loop is stuck
(SIGSTOP, a deadlock, a blocking call) answers nothing, while a TCP probe
still connects to its listening socket (the kernel accepts). Not /health:
that answers 503 while the store is down, and restarting every replica
would not bring the store back. HAProxy does not pass /livez to clients.

A health check also reads the store's memory (bytes used, Redis
`maxmemory`) at most every MEMORY_SECONDS, for the replica's /metrics
(`mcp_store_memory_used_bytes`, `mcp_store_memory_max_bytes`). Not in the
body: /health answers anyone, and how full the store is would tell an
attacker how near a flood is to refusing everyone's writes. A full store
refuses writes cleanly (`StoreFull`) and evicts nothing, so pressure is for
the operator to watch, not a reason to take the replica out of rotation.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse

from .drain import BALANCER_CHECK_HEADER, Drain
from .errors import refusal
from .session_store import STORE_UNAVAILABLE, SessionStore

# Under HAProxy's 800 ms check timeout, so a hung store is answered (and
# forgiven, for a while) before HAProxy counts the check failed.
PING_SECONDS = 0.5
# How often a health check also reads the store's memory (one INFO, not one per check).
MEMORY_SECONDS = 5.0

STORE_GONE = refusal(503, STORE_UNAVAILABLE, code=-32000, retry_after=1)


class StoreHealth:
    """Whether this replica can serve, as far as its store goes; and what it does when it cannot."""

    def __init__(self, store: SessionStore, drain: Drain, *, grace_seconds: float) -> None:
        self.store = store
        self.drain = drain
        self.grace_seconds = grace_seconds
        self.unreachable_since: float | None = None
        self.reached = False
        self._memory_read_at = -MEMORY_SECONDS

    async def read_memory(self) -> None:
        """Read the store's memory again when the last read is MEMORY_SECONDS old: a metered store
        (metrics.MeteredStore) exports what it reads."""
        now = time.monotonic()
        if now - self._memory_read_at >= MEMORY_SECONDS:
            self._memory_read_at = now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.store.memory(), PING_SECONDS)

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
            await store_health.read_memory()
            return JSONResponse({"status": "ok", "instance": instance})
        return JSONResponse({"status": "degraded", "instance": instance, "store": "unreachable"}, status_code=503)

    return health


def livez_endpoint(instance: str) -> Callable[[Request], Awaitable[JSONResponse]]:
    """`GET /livez`: 200 while this replica's event loop runs; nothing else is asked."""

    async def livez(request: Request) -> JSONResponse:
        return JSONResponse({"status": "alive", "instance": instance})

    return livez
