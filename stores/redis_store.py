"""A SessionStore in Redis: the only module of the kit that imports redis.

Layout, with the default prefix `mcp`:

- `mcp:session:<id>`: one hash per session, a field per state entry, each
  value JSON text. One key per session keeps memory per session small and
  lets one command copy or read a whole session.
- `mcp:sessions`: a sorted set of session ids scored by last-seen time (the
  Redis server's clock, so replicas never disagree). Counting live sessions is
  ZCOUNT over it: O(log n), never a SCAN.

Every operation is one Lua script: the change, the sliding TTL and the index
update happen atomically in one round trip, so 200 concurrent increments end at
exactly 200 and no reader sees half a copy.

Retries: redis-py's own retry is switched off, because retrying a write
after a timeout can apply it twice. Reads, which are safe to repeat, are
retried by stamina on the connection errors named below, bounded in attempts
and in time.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as redis
import stamina
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from session_store import DEFAULT_TTL_SECONDS, SessionStore, StoreUnavailable

T = TypeVar("T")

RETRYABLE = (RedisConnectionError, RedisTimeoutError)

# Shared by every script: slide the session's TTL and index it as seen now.
# KEYS[1] session hash, KEYS[2] index; ARGV[1] session id, ARGV[2] ttl seconds.
_TOUCH = """
local function touch()
  local now = redis.call('TIME')[1]
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  redis.call('ZADD', KEYS[2], now, ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
end
"""

_GET = _TOUCH + """
touch()
return redis.call('HGET', KEYS[1], ARGV[3])
"""

_SET = _TOUCH + """
redis.call('HSET', KEYS[1], ARGV[3], ARGV[4])
touch()
"""

_INCR = _TOUCH + """
local value = redis.call('HINCRBY', KEYS[1], ARGV[3], ARGV[4])
touch()
return value
"""

# The new item arrives as JSON text and is spliced into the stored JSON array,
# so nothing is decoded and re-encoded on the way (cjson would round floats).
_APPEND = _TOUCH + """
local current = redis.call('HGET', KEYS[1], ARGV[3])
local updated
if not current then
  updated = '[' .. ARGV[4] .. ']'
elseif string.sub(current, 1, 1) == '[' and current ~= '[]' then
  updated = string.sub(current, 1, -2) .. ',' .. ARGV[4] .. ']'
elseif current == '[]' then
  updated = '[' .. ARGV[4] .. ']'
else
  return redis.error_reply('WRONGTYPE entry does not hold a list')
end
redis.call('HSET', KEYS[1], ARGV[3], updated)
touch()
return #cjson.decode(updated)
"""

_ITEMS = _TOUCH + """
touch()
return redis.call('HGETALL', KEYS[1])
"""

_TOUCH_ONLY = _TOUCH + """
touch()
"""

# KEYS[3] is the source hash. HSET in chunks keeps unpack() far below Lua's
# stack limit however many entries the source has.
_COPY = _TOUCH + """
local flat = redis.call('HGETALL', KEYS[3])
for i = 1, #flat, 200 do
  redis.call('HSET', KEYS[1], unpack(flat, i, math.min(i + 199, #flat)))
end
touch()
return #flat / 2
"""

# Trim what fell out of the TTL, then count what is left.
_COUNT = """
local horizon = tonumber(redis.call('TIME')[1]) - tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', horizon)
return redis.call('ZCARD', KEYS[1])
"""


class RedisSessionStore(SessionStore):
    def __init__(
        self,
        url: str,
        *,
        ttl_seconds: int = DEFAULT_TTL_SECONDS,
        prefix: str = "mcp",
        timeout_seconds: float = 2.0,
        read_attempts: int = 3,
        max_connections: int = 64,
    ) -> None:
        super().__init__(ttl_seconds=ttl_seconds)
        self._prefix = prefix
        self._index = f"{prefix}:sessions"
        self._timeout = timeout_seconds
        self._read_attempts = read_attempts
        # A bounded pool that makes a burst of calls queue for a connection
        # (up to the timeout) instead of failing or opening one per call.
        pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_seconds,
            decode_responses=True,
            socket_timeout=timeout_seconds,
            socket_connect_timeout=timeout_seconds,
            retry=Retry(NoBackoff(), 0),
        )
        self._redis = redis.Redis.from_pool(pool)
        register = self._redis.register_script
        self._get, self._set, self._incr = register(_GET), register(_SET), register(_INCR)
        self._append, self._items, self._copy = register(_APPEND), register(_ITEMS), register(_COPY)
        self._touch, self._count = register(_TOUCH_ONLY), register(_COUNT)

    def _key(self, session_id: str) -> str:
        return f"{self._prefix}:session:{session_id}"

    def _session_args(self, session_id: str, *extra: Any) -> dict[str, list[Any]]:
        return {
            "keys": [self._key(session_id), self._index],
            "args": [session_id, self.ttl_seconds, *extra],
        }

    async def _write(self, call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await call()
        except RETRYABLE as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        except ResponseError as exc:
            if "WRONGTYPE" in str(exc) or "not an integer" in str(exc):
                raise TypeError(str(exc)) from exc
            raise

    async def _read(self, call: Callable[[], Awaitable[T]]) -> T:
        try:
            async for attempt in stamina.retry_context(
                on=RETRYABLE, attempts=self._read_attempts, timeout=self._timeout * 2, wait_initial=0.05
            ):
                with attempt:
                    return await call()
        except RETRYABLE as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        raise AssertionError("unreachable: stamina either returns or raises")

    async def get(self, session_id: str, key: str) -> Any | None:
        raw = await self._read(lambda: self._get(**self._session_args(session_id, key)))
        return None if raw is None else json.loads(raw)

    async def set(self, session_id: str, key: str, value: Any) -> None:
        await self._write(lambda: self._set(**self._session_args(session_id, key, json.dumps(value))))

    async def incr(self, session_id: str, key: str, by: int = 1) -> int:
        return int(await self._write(lambda: self._incr(**self._session_args(session_id, key, by))))

    async def append(self, session_id: str, key: str, value: Any) -> int:
        return int(await self._write(lambda: self._append(**self._session_args(session_id, key, json.dumps(value)))))

    async def items(self, session_id: str) -> dict[str, Any]:
        flat = await self._read(lambda: self._items(**self._session_args(session_id)))
        return {flat[i]: json.loads(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def copy(self, source_id: str, target_id: str) -> int:
        args = self._session_args(target_id)
        args["keys"].append(self._key(source_id))
        return int(await self._write(lambda: self._copy(**args)))

    async def touch(self, session_id: str) -> None:
        await self._read(lambda: self._touch(**self._session_args(session_id)))

    async def count_sessions(self) -> int:
        return int(await self._read(lambda: self._count(keys=[self._index], args=[self.ttl_seconds])))

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except (*RETRYABLE, OSError):
            return False

    async def aclose(self) -> None:
        await self._redis.aclose()
