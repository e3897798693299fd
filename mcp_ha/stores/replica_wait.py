"""How many replicas a durable write waits for on one primary (`wait_replicas`, Redis WAIT).

Right after a failover the promoted primary has no replica until the old primary is back as its
replica and synced (and none at all if it never comes back): a write waiting for one there failed
every call, each after the whole WAIT timeout. So a write that comes back short asks the primary
(INFO replication) how many replicas it has online; acknowledged by all of those, it succeeds, and
later writes to that primary wait for those there are, counted again every SHORT_RECOUNT_SECONDS so
a replica that is back is waited for again. A second failure in that window can lose what was
written meanwhile (docs/deploy.md). One Redis or Sentinel keeps one `ReplicaWait`; a cluster one per
primary node.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..session_store import StoreUnavailable

log = logging.getLogger(__name__)

# While a primary has fewer replicas online than a write waits for, they are counted again this often.
SHORT_RECOUNT_SECONDS = 1.0


def online_replicas(info: Mapping[str, Any]) -> int | None:
    """The replicas online in a primary's INFO replication, as redis-py parses it; None when the node that
    answered is not a primary. On a cluster that is an old primary back as a replica, still named by a
    slot map that has not seen the failover yet: its count says nothing of the new primary's replicas,
    and its own fields (`slave_repl_offset`, ...) are not replicas."""
    if info.get("role") != "master":
        return None
    return sum(
        1
        for name, replica in info.items()
        if re.fullmatch(r"slave\d+", name) and dict(replica).get("state") == "online"
    )


class ReplicaWait:
    """One primary's replicas, as writes on it wait for them: `replicas`, or all it has online while it
    has fewer. `count` asks the primary how many it has online now (None: the node is no primary)."""

    def __init__(
        self, replicas: int, count: Callable[[], Awaitable[int | None]], *, primary: str = "the primary"
    ) -> None:
        self.replicas = replicas
        self._count = count
        self._primary = primary
        # While the primary has fewer online than `replicas`: how many, and until when. Not counted yet
        # (or not since an outage): expired at once, so the next write counts first.
        self._short: tuple[int, float] | None = (replicas, 0.0)

    def forget(self) -> None:
        """Perhaps a failover: the next write asks the primary what replicas it has first, rather than
        wait the whole timeout for one a new primary does not have yet."""
        self._short = (self.replicas, 0.0)

    async def wanted(self) -> int:
        """How many replicas the next write waits for."""
        if self._short is None:
            return self.replicas
        online, until = self._short
        return online if time.monotonic() < until else await self.recount()

    async def recount(self) -> int:
        online = await self._count()
        if online is None:
            # Not a primary (yet, or any more): only a primary's own count lowers the wait. Asked again next time.
            return self.replicas
        was = self._short
        if online >= self.replicas:
            if was is not None and was[0] < self.replicas:
                log.warning(
                    "redis: %s has %d replica(s) online again: writes wait for %d", self._primary, online, self.replicas
                )
            self._short = None
            return self.replicas
        if was is None or was[0] >= self.replicas:
            log.warning(
                "redis: %s has %d of the %d replica(s) REDIS_WAIT_REPLICAS asks for online: writes wait for "
                "those there are until it has them again",
                self._primary,
                online,
                self.replicas,
            )
        self._short = (online, time.monotonic() + SHORT_RECOUNT_SECONDS)
        return online

    async def check(self, acknowledged: int, wanted: int, timeout_ms: int) -> None:
        """A write WAIT said `acknowledged` replicas have, of the `wanted` it waited for: fine if those
        cover what the primary has online now, else StoreUnavailable (a retry with the same op replays it)."""
        if acknowledged < wanted and acknowledged < await self.recount():
            raise StoreUnavailable(
                f"redis: the write reached the primary but {acknowledged} of {wanted} replica(s) "
                f"acknowledged it within {timeout_ms} ms; it may not survive a failover"
            )
