"""Pattern: externalize per-session state.

Tools never hold session state in process memory. They go through a
`Session` (a store bound to one session id), and the `SessionStore` behind it
lives outside the replica, so any replica can serve any session and a session
outlives the replica that served it.

The contract is deliberately small: implement these eight coroutines for
another backend and the shared contract suite in `tests/test_session_store.py`
tells you whether you got it right. Three rules every implementation keeps:

- every operation on a session is atomic on its own, so concurrent callers
  never lose an update (no read-modify-write in Python);
- every operation slides the session's TTL and marks it live in an index, so
  `count_sessions` never has to walk the keyspace;
- session ids are data, never patterns.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any

DEFAULT_TTL_SECONDS = 30 * 60

# The only form of id this kit mints: 128 random bits as lowercase hex, the
# same form as the MCP SDK's `uuid4().hex` session ids. Anything else is not a
# session id and is refused before it reaches a store or a log line.
_SESSION_ID = re.compile(r"[0-9a-f]{32}")


def is_session_id(value: object) -> bool:
    return isinstance(value, str) and _SESSION_ID.fullmatch(value) is not None


class StoreUnavailable(Exception):
    """The store could not be reached; the operation may not have happened."""


class SessionStore(ABC):
    """Where session state lives. Values are anything JSON can hold."""

    def __init__(self, *, ttl_seconds: int = DEFAULT_TTL_SECONDS) -> None:
        if ttl_seconds <= 0:
            raise ValueError("ttl_seconds must be positive")
        self.ttl_seconds = ttl_seconds

    @abstractmethod
    async def get(self, session_id: str, key: str) -> Any | None:
        """The value stored under `key`, or None."""

    @abstractmethod
    async def set(self, session_id: str, key: str, value: Any) -> None:
        """Store `value` under `key`, replacing what was there."""

    @abstractmethod
    async def incr(self, session_id: str, key: str, by: int = 1) -> int:
        """Atomically add `by` to the integer under `key` (0 when unset); the new value."""

    @abstractmethod
    async def append(self, session_id: str, key: str, value: Any) -> int:
        """Atomically append `value` to the list under `key`; the list's new length."""

    @abstractmethod
    async def items(self, session_id: str) -> dict[str, Any]:
        """Every entry of the session, in one consistent read."""

    @abstractmethod
    async def copy(self, source_id: str, target_id: str) -> int:
        """Atomically copy every entry of `source_id` over `target_id`; how many were copied.

        Costs time proportional to the source session's entries, never the store's.
        """

    @abstractmethod
    async def touch(self, session_id: str) -> None:
        """Mark the session live now (sliding its TTL) without changing its state."""

    @abstractmethod
    async def count_sessions(self) -> int:
        """Sessions touched within the TTL, from an index: never a scan."""

    async def ping(self) -> bool:
        """Whether the store answers now. Never raises."""
        return True

    async def aclose(self) -> None:
        """Release connections."""


class Session:
    """One session's view of the store: what a tool author works with."""

    def __init__(self, store: SessionStore, session_id: str) -> None:
        self.store = store
        self.id = session_id

    async def get(self, key: str, default: Any = None) -> Any:
        value = await self.store.get(self.id, key)
        return default if value is None else value

    async def set(self, key: str, value: Any) -> None:
        await self.store.set(self.id, key, value)

    async def incr(self, key: str, by: int = 1) -> int:
        return await self.store.incr(self.id, key, by)

    async def append(self, key: str, value: Any) -> int:
        return await self.store.append(self.id, key, value)

    async def items(self) -> dict[str, Any]:
        return await self.store.items(self.id)

    async def copy_from(self, other_id: str) -> int:
        return await self.store.copy(other_id, self.id)

    async def touch(self) -> None:
        await self.store.touch(self.id)
