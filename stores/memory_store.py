"""An in-process SessionStore: for a quick single-process start and the contract tests.

State dies with the process, so it gives none of the kit's availability; the
server uses it only when REDIS_URL is unset. Every method finishes without
awaiting, which is what makes each one atomic under asyncio.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from session_store import DEFAULT_TTL_SECONDS, SessionStore


class InMemorySessionStore(SessionStore):
    def __init__(
        self,
        *,
        ttl_seconds: int = DEFAULT_TTL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(ttl_seconds=ttl_seconds)
        self._clock = clock
        # Ordered by last touch, oldest first, so expiry pops from the front
        # and counting costs the number of sessions that expired, not all of them.
        self._sessions: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._seen: dict[str, float] = {}

    def _expire(self) -> None:
        horizon = self._clock() - self.ttl_seconds
        while self._sessions:
            oldest = next(iter(self._sessions))
            if self._seen[oldest] > horizon:
                break
            del self._sessions[oldest]
            del self._seen[oldest]

    def _live(self, session_id: str) -> dict[str, Any]:
        self._expire()
        data = self._sessions.setdefault(session_id, {})
        self._sessions.move_to_end(session_id)
        self._seen[session_id] = self._clock()
        return data

    async def get(self, session_id: str, key: str) -> Any | None:
        return copy.deepcopy(self._live(session_id).get(key))

    async def set(self, session_id: str, key: str, value: Any) -> None:
        self._live(session_id)[key] = copy.deepcopy(value)

    async def incr(self, session_id: str, key: str, by: int = 1) -> int:
        data = self._live(session_id)
        current = data.get(key, 0)
        if not isinstance(current, int):
            raise TypeError(f"{key!r} does not hold an integer")
        data[key] = current + by
        return data[key]

    async def append(self, session_id: str, key: str, value: Any) -> int:
        data = self._live(session_id)
        current = data.setdefault(key, [])
        if not isinstance(current, list):
            raise TypeError(f"{key!r} does not hold a list")
        current.append(copy.deepcopy(value))
        return len(current)

    async def items(self, session_id: str) -> dict[str, Any]:
        return copy.deepcopy(self._live(session_id))

    async def copy(self, source_id: str, target_id: str) -> int:
        self._expire()
        source = copy.deepcopy(self._sessions.get(source_id, {}))
        self._live(target_id).update(source)
        return len(source)

    async def touch(self, session_id: str) -> None:
        self._live(session_id)

    async def count_sessions(self) -> int:
        self._expire()
        return len(self._sessions)
