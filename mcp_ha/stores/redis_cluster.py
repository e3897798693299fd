"""The Redis store on Redis Cluster: where keys live, and how a quota holds across slots.

One Redis runs a script over any key. A cluster runs one only over keys of one slot, so the store's
keys are laid out by owner (`Layout`):

- everything of one session shares its id's hash tag, `{<sid>}`: its hash, op records, event log,
  and its own charges ledger (`<session key>:usage`), so every session script stays in one slot and
  sessions spread over the whole cluster;
- the live-session index is 16 shards (`<prefix>:sessions:{i<k>}`), refreshed from the session
  scripts' INDEX hint at most every `min(60, ttl/10)` s, and counted as their sum;
- a holder's open sessions and a payer's quota ledger share the payer's tag, `{p:<payer>}`;
- a claim has a tag of its own, with its own charges ledger beside it.

The quota (MAX_CLIENT_BYTES) across slots is a grant protocol (proven on a real cluster first): an
owner (a session, a claim) charges its own ledger exactly as one Redis charges a payer's, but within
a *grant* its payer's ledger gave it. A change past the grant applies nothing and answers `NEED`;
`Cluster.call` then asks the payer (`grant`, refused with LIMIT past the quota) and runs the change
again with what it got. So the payer's ledger, the sum of its owners' grants, bounds what they hold.
Grants only rise there; an owner lowers its own when it holds far less (LOWER hint, sent on as
`lower`, applied only if newer), and keeps its payer's entry alive while it lives (RENEW hint). A
lost LOWER over-counts (the safe side); a lost RENEW can under-count one owner until its next
renewal (at most LEASE/8 later).

`Cluster` is the client side: a `RedisCluster` with redis-py's own retries off (the store retries),
every FCALL sent to the node owning its first key (no COMMAND GETKEYS round trip), FCALL and WAIT on
one connection of that node (waiting for the replicas that primary has: replica_wait.py), and a
bound on calls in flight (redis-py's cluster pool refuses at once when full instead of queueing).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis.asyncio as redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, ResponseError, SlotNotCoveredError

from ..session_store import RESYNC, LimitExceeded, StoreUnavailable, over_quota, payer_of
from .replica_wait import ReplicaWait, online_replicas

log = logging.getLogger(__name__)

INDEX_SHARDS = 16
# Rounds of NEED and grant before a change gives up: one is the rule, more only under a race.
GRANT_ROUNDS = 4
# The bytes an owner's grant runs ahead of what it holds (at most), so most changes need no grant.
MAX_SLACK = 4096

# The payer's side, and the index shards: each function touches one slot. A payer's ledger is a hash
# (KEYS[1]: `total`, and per owner `b:`/`v:`/`x:` its bytes, grant version and expiry in ms) and a
# sorted set of owners by expiry (KEYS[2]), swept 16 at a time.
PAYER_FUNCTIONS = {
    "grant": """
local H, Z, m = KEYS[1], KEYS[2], ARGV[1]
local want, least, gv = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local lease, quota = tonumber(ARGV[5]), tonumber(ARGV[6])
local now = now_ms()
sweep(H, Z, now)
local b, v, x = entry(H, Z, m, now)
if gv < v then return {'STALE', fmt(v)} end
local total = tonumber(redis.call('HGET', H, 'total') or '0')
local new = b
if want > b then
  if total - b + want <= quota then new = want
  elseif least <= b then new = b
  elseif total - b + least <= quota then new = least
  else return {'LIMIT', fmt(total - b + least), fmt(quota)} end
end
local gx = math.max(x, now + lease)
redis.call('HSET', H, 'b:' .. m, fmt(new), 'v:' .. m, fmt(gv), 'x:' .. m, fmt(gx))
redis.call('ZADD', Z, fmt(gx), m)
if new ~= b then redis.call('HINCRBY', H, 'total', new - b) end
keep(H, Z)
return {'OK', fmt(new), fmt(gx)}
""",
    "lower": """
local H, Z, m, bytes, gv = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
sweep(H, Z, now)
local b, v, _, present = entry(H, Z, m, now)
if not present or gv <= v then return 0 end
redis.call('HSET', H, 'b:' .. m, fmt(bytes), 'v:' .. m, fmt(gv))
if bytes ~= b then redis.call('HINCRBY', H, 'total', bytes - b) end
return 1
""",
    "renew": """
local H, Z, m, lease = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2])
local now = now_ms()
sweep(H, Z, now)
local _, _, x, present = entry(H, Z, m, now)
if not present then return 0 end
local gx = math.max(x, now + lease)
redis.call('HSET', H, 'x:' .. m, fmt(gx))
redis.call('ZADD', Z, fmt(gx), m)
keep(H, Z)
return 1
""",
    # A holder's open sessions (KEYS[1], in its payer's slot): ARGV[1] the session, ARGV[2] the most,
    # ARGV[3] the TTL. The same refusal as one Redis's `open`.
    "admit": """
local now = tonumber(redis.call('TIME')[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]))
if redis.call('ZSCORE', KEYS[1], ARGV[1]) == false and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return redis.error_reply('LIMIT you hold ' .. ARGV[2] .. ' open sessions, the most you may; end some first')
end
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
""",
    "leave": """
return redis.call('ZREM', KEYS[1], ARGV[1])
""",
    # An index shard (KEYS[1]): ARGV[1] seen now, kept ARGV[2] seconds.
    "index": """
redis.call('ZADD', KEYS[1], redis.call('TIME')[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
""",
    # A copy's source, put beside its target (KEYS[1], in the target's slot) for the write that copies it.
    "stash": """
for i = 2, #ARGV, 200 do
  redis.call('HSET', KEYS[1], unpack(ARGV, i, math.min(i + 199, #ARGV)))
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
""",
}
PAYER_HELPERS = """
local function fmt(n) return string.format('%.0f', n) end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function drop(H, Z, m)
  local b = tonumber(redis.call('HGET', H, 'b:' .. m) or '0')
  redis.call('HDEL', H, 'b:' .. m, 'v:' .. m, 'x:' .. m)
  redis.call('ZREM', Z, m)
  if b ~= 0 then redis.call('HINCRBY', H, 'total', -b) end
end
local function sweep(H, Z, now)
  for _, m in ipairs(redis.call('ZRANGE', Z, '-inf', '(' .. fmt(now), 'BYSCORE', 'LIMIT', 0, 16)) do drop(H, Z, m) end
end
-- Both keys live as long as the entry that lives longest.
local function keep(H, Z)
  local top = redis.call('ZRANGE', Z, 0, 0, 'REV', 'WITHSCORES')
  if top[2] then
    local seconds = math.ceil((tonumber(top[2]) - now_ms()) / 1000) + 1
    redis.call('EXPIRE', H, seconds)
    redis.call('EXPIRE', Z, seconds)
  end
end
local function entry(H, Z, m, now)
  local e = redis.call('HMGET', H, 'b:' .. m, 'v:' .. m, 'x:' .. m)
  if e[1] and tonumber(e[3]) < now then
    drop(H, Z, m)
    return 0, 0, 0, false
  end
  return tonumber(e[1]) or 0, tonumber(e[2]) or 0, tonumber(e[3]) or 0, e[1] ~= false
end
"""


@functools.cache
def slot_tags() -> tuple[str, ...]:
    """For each slot of a cluster, a short hash tag in it. A session's feed channel is named by its slot's
    tag: in its slot, so its script may SPUBLISH to it, and one of 16384 a watcher can name in advance."""
    tags: list[str | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
    left, n = REDIS_CLUSTER_HASH_SLOTS, 0
    while left:
        tag = format(n, "x")
        slot = key_slot(tag.encode())
        if tags[slot] is None:
            tags[slot] = tag
            left -= 1
        n += 1
    return tuple(t for t in tags if t is not None)


def _tag(text: str) -> str:
    """A hash tag no key name can end early: `}` cannot occur in what it wraps."""
    return "{" + text.replace("}", "%7D") + "}"


class Layout:
    """Every key of the store on a cluster, each owner's in its own slot."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def session(self, session_id: str) -> str:
        return f"{self.prefix}:session:{_tag(session_id)}"

    def ops(self, session_id: str) -> str:
        return f"{self.prefix}:ops:{_tag(session_id)}"

    def events(self, session_id: str) -> str:
        return f"{self.prefix}:events:{_tag(session_id)}"

    def copy(self, target_id: str, nonce: str) -> str:
        return f"{self.prefix}:copy:{_tag(target_id)}:{nonce}"

    def shard(self, session_id: str) -> str:
        k = int.from_bytes(hashlib.blake2b(session_id.encode(), digest_size=2).digest()) % INDEX_SHARDS
        return f"{self.prefix}:sessions:{{i{k}}}"

    def shards(self) -> list[str]:
        return [f"{self.prefix}:sessions:{{i{k}}}" for k in range(INDEX_SHARDS)]

    def holder(self, holder: str) -> str:
        return f"{self.prefix}:holder:{_tag('p:' + payer_of(holder))}:{hashlib.sha256(holder.encode()).hexdigest()}"

    def payer(self, payer: str) -> tuple[str, str]:
        ledger = f"{self.prefix}:usage:{_tag('p:' + payer)}"
        return ledger, ledger + ":z"

    def feed(self, base: str, key: str) -> str:
        """The channel of feed `base` (changes, events) that the owner of `key` publishes to: its slot's."""
        return f"{self.prefix}:{base}:{{{slot_tags()[key_slot(key.encode())]}}}"

    def feeds(self, base: str) -> list[str]:
        """Every channel of feed `base`: one per slot."""
        return [f"{self.prefix}:{base}:{{{tag}}}" for tag in slot_tags()]

    def claim(self, name: str) -> str:
        return f"{self.prefix}:claim:{_tag(hashlib.sha256(name.encode()).hexdigest())}"


T = TypeVar("T")


def as_outage(exc: BaseException) -> RedisConnectionError | None:
    """The ConnectionError an outage of nodes is, where redis-py raises something else; None for any other
    error. No node answering: its own RedisClusterException; a slot nobody serves: SlotNotCoveredError; a
    write on a connection to a node just killed: uvloop's RuntimeError ("the handler is closed"), or
    redis-py finding its writer gone (AttributeError on None). Retried as one Redis down is."""
    if isinstance(exc, SlotNotCoveredError) or (
        isinstance(exc, RedisClusterException) and "cannot be connected" in str(exc)
    ):
        return RedisConnectionError(f"no cluster node serves this: {exc}")
    if isinstance(exc, RuntimeError | AttributeError) and ("closed" in str(exc) or "NoneType" in str(exc)):
        return RedisConnectionError(f"a connection to a cluster node was closed: {exc}")
    return None


class Cluster:
    """The store's connection to a Redis Cluster, and the grant protocol's client side."""

    def __init__(
        self,
        nodes: Sequence[tuple[str, int]],
        *,
        layout: Layout,
        library: str,
        timeout_seconds: float,
        max_connections: int,
        ttl_seconds: int,
        quota: int,
        options: dict[str, Any],
    ) -> None:
        self.layout = layout
        self.library = library
        self.timeout_seconds = timeout_seconds
        self.ttl_seconds = ttl_seconds
        self.quota = quota
        self.slack = max(1, min(MAX_SLACK, quota // 64))
        # A payer's entry for an owner lives this long unless renewed (RENEW, at three quarters of it).
        self.lease_ms = 2 * ttl_seconds * 1000
        # A feed's connection to one node (FeedWatch) is made with the same options.
        self.node_options: dict[str, Any] = {
            "decode_responses": True,
            "socket_timeout": timeout_seconds,
            "socket_connect_timeout": timeout_seconds,
            "retry": Retry(NoBackoff(), 0),
            **options,
        }
        self.redis = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in nodes],
            # Room above the calls in flight (below) for pub/sub connections, which share a node's pool.
            max_connections=max_connections + 8,
            require_full_coverage=False,
            # A MOVED only patches the slot it names: rebuilding the whole map on the fifth one closes
            # connections other calls are using (seen under a slot move).
            reinitialize_steps=0,
            **self.node_options,
        )
        self._in_flight = asyncio.Semaphore(max_connections)
        # What waited writes wait for on each primary, by node name (replica_wait.py).
        self._replicas: dict[str, ReplicaWait] = {}

    async def _bounded(self, command: Any, node: ClusterNode | None = None) -> Any:
        try:
            async with asyncio.timeout(self.timeout_seconds):
                await self._in_flight.acquire()
        except TimeoutError:
            raise RedisConnectionError(f"no connection free within {self.timeout_seconds:g} s") from None
        try:
            return await command
        except (RuntimeError, AttributeError) as exc:
            # The node's idle connections are dropped too, so the retry does not take a dead one again.
            if (error := as_outage(exc)) is None:
                raise
            if node is not None:
                with contextlib.suppress(Exception):
                    await node.disconnect_free_connections()
            raise error from exc
        finally:
            self._in_flight.release()

    async def fcall(
        self, name: str, keys: Sequence[Any], args: Sequence[Any], *, wait: tuple[int, int] | None = None
    ) -> Any:
        """One function of the library on the node that owns `keys[0]`; with `wait` (replicas, ms), WAIT
        on the same connection, so it covers this write."""
        node = await self._node_of(keys[0])
        command = ("FCALL", f"{self.library}_{name}", len(keys), *keys, *args)
        if wait is None:
            return await self._bounded(self.redis.execute_command(*command, target_nodes=node), node)
        replicas = self._replicas.get(node.name)
        if replicas is None:
            replicas = self._replicas[node.name] = ReplicaWait(
                wait[0], functools.partial(self._online_replicas, node), primary=node.name
            )
        wanted = await replicas.wanted()
        pipe = self.redis.pipeline(transaction=False)
        pipe.execute_command(*command, target_nodes=node)
        pipe.execute_command("WAIT", wanted, wait[1], target_nodes=node)
        result, acknowledged = await self._bounded(pipe.execute(raise_on_error=False), node)
        if isinstance(result, Exception):
            raise result
        if isinstance(acknowledged, Exception):
            raise RedisConnectionError(f"redis: WAIT failed: {acknowledged}")
        await replicas.check(acknowledged, wanted, wait[1])
        return result

    async def _online_replicas(self, node: ClusterNode) -> int | None:
        # A command of its own, not in the pipeline: its connection error is what has redis-py ask for the
        # slot map again (a failed pipeline, its retries off, does not), so after a primary dies for good
        # the count before the next write finds the promoted one instead of the dead one forever.
        info = await self._bounded(self.redis.execute_command("INFO", "replication", target_nodes=node), node)
        return online_replicas(info)

    def forget_replicas(self) -> None:
        """Perhaps a failover: each primary is asked what replicas it has before its next waited write."""
        for replicas in self._replicas.values():
            replicas.forget()

    async def call(
        self,
        name: str,
        keys: Sequence[Any],
        args: Sequence[Any],
        *,
        channel: str = "",
        payer: str = "",
        wait: tuple[int, int] | None = None,
    ) -> Any:
        """A session or claim function, its grant asked for as it needs one, its hints acted on."""
        grant: list[Any] = ["", "", "", ""]  # granted, its version, the payer entry's expiry, a floor
        for _ in range(GRANT_ROUNDS):
            head = [channel, payer, *grant, self.slack, self.lease_ms]
            try:
                result, hints = await self.fcall(name, keys, [*head, *args], wait=wait)
            except ResponseError as exc:
                if not str(exc).startswith("NEED "):
                    raise
                grant = await self._granted(str(exc).split(), wait)
                continue
            await self.hints(hints)
            return result
        raise StoreUnavailable(f"redis: no grant for a change within {GRANT_ROUNDS} rounds (a race kept winning)")

    async def _granted(self, need: list[str], wait: tuple[int, int] | None) -> list[Any]:
        """Ask the payer for what NEED <payer> <owner> <want> <least> <version> names: the arguments
        of the change's next run."""
        _, payer, owner, want, least, version = need
        keys = list(self.layout.payer(payer))
        answer = await self.fcall("grant", keys, [owner, want, least, version, self.lease_ms, self.quota], wait=wait)
        if answer[0] == "LIMIT":
            raise LimitExceeded(over_quota(int(answer[1]), int(answer[2])))
        if answer[0] == "STALE":
            return ["", "", "", answer[1]]
        return [answer[1], version, answer[2], ""]

    async def hints(self, hints: list[list[str]]) -> None:
        """What a function asked to be done beside it, in other slots: best effort, for each is safe to
        lose (an index entry is refreshed by a later call, a LOWER over-counts, a RENEW is asked again)."""
        for hint in hints:
            try:
                match hint:
                    case ["INDEX", session_id]:
                        await self.fcall("index", [self.layout.shard(session_id)], [session_id, self.ttl_seconds])
                    case ["LOWER", payer, owner, grant, version]:
                        await self.fcall("lower", list(self.layout.payer(payer)), [owner, grant, version])
                    case ["RENEW", payer, owner]:
                        await self.fcall("renew", list(self.layout.payer(payer)), [owner, self.lease_ms])
            except (RedisConnectionError, ResponseError, StoreUnavailable):
                continue

    async def _slot_map(self) -> None:
        """The slot map, asked for again when a failure said it changed (else a no-op)."""
        try:
            await self.redis.initialize()
        except RedisClusterException as exc:
            raise as_outage(exc) or exc from exc

    async def _node_of(self, key: Any) -> ClusterNode:
        """The primary serving `key`'s slot now."""
        await self._slot_map()
        try:
            node = self.redis.get_node_from_key(key)
        except SlotNotCoveredError as exc:
            raise as_outage(exc) or exc from exc
        if node is None:
            raise RedisConnectionError(f"no primary serves the slot of {key!r} now")
        return node

    async def guarded(self, call: Callable[[], Awaitable[T]]) -> T:
        """`call` (a command on the cluster), with an outage raised as one (`as_outage`)."""
        try:
            return await call()
        except (RedisClusterException, RuntimeError, AttributeError) as exc:
            raise as_outage(exc) or exc from exc

    async def spublish(self, channel: str, message: str) -> None:
        node = await self._node_of(channel)
        await self._bounded(self.redis.execute_command("SPUBLISH", channel, message, target_nodes=node), node)

    async def count(self, keys: Sequence[str], horizon: int) -> int:
        counts = await asyncio.gather(*(self.fcall("count", [key], [horizon]) for key in keys))
        return sum(int(c) for c in counts)

    async def ping(self) -> None:
        await self._slot_map()
        await self.guarded(lambda: self.redis.ping(target_nodes=RedisCluster.PRIMARIES))

    async def memory(self) -> tuple[int, int]:
        """The fullest primary's used memory, and its maxmemory."""
        await self._slot_map()
        info = await self.guarded(lambda: self.redis.info("memory", target_nodes=RedisCluster.PRIMARIES))
        # One answer per primary, by node name (or one answer alone, from a cluster of one).
        nodes = list(info.values()) if all(isinstance(v, dict) for v in info.values()) else [info]
        fullest = max(nodes, key=lambda i: int(i.get("used_memory", 0)) / max(int(i.get("maxmemory", 0)), 1))
        return int(fullest.get("used_memory", 0)), int(fullest.get("maxmemory", 0))

    async def load(self, code: str) -> None:
        """The library on every primary (FUNCTION LOAD goes to each); replicas get it by replication."""
        await self.redis.function_load(code, replace=True)

    async def aclose(self) -> None:
        await self.redis.aclose()


class FeedLost(Exception):
    """A feed's connection to a node failed, fell silent, or could not keep up: messages may be lost."""


class FeedWatch:
    """One watch of a sharded feed (SSUBSCRIBE): a connection to each primary, subscribed to the channels
    of the slots it owns and read by a task of its own, into one bounded queue. A message goes to the
    primary owning its slot and that primary's replicas only, so its cost does not grow with the
    cluster. A channel its node drops because its slot moved away is subscribed again at the new owner.

    The watch keeps a slot map of its own (CLUSTER SLOTS): rebuilding the client's would close
    connections the store's calls are using. Per session, messages keep their order (one slot, one node
    at a time). What a session publishes while its slot moves, between its new owner taking it and the
    watch subscribing there, is missed: the watch yields RESYNC once subscribed there.
    """

    # Messages read but not yet taken; past it the watch is lost (its reader is far behind).
    BOUND = 10_000
    SUBSCRIBE_BATCH = 512
    # A moved channel is subscribed again at most this many times, this far apart, before the watch is lost.
    MOVE_ATTEMPTS = 100
    MOVE_RETRY_SECONDS = 0.1

    def __init__(self, cluster: Cluster, base: str, *, ping_seconds: float, silence_seconds: float) -> None:
        self.cluster = cluster
        self.base = f"{cluster.layout.prefix}:{base}"
        self.ping_seconds = ping_seconds
        self.silence_seconds = silence_seconds
        self._queue: asyncio.Queue[str | FeedLost] = asyncio.Queue()
        self._moved: asyncio.Queue[int] = asyncio.Queue()
        self._clients: dict[tuple[str, int], tuple[redis.Redis, PubSub]] = {}
        self._held: dict[int, tuple[str, int]] = {}  # slot -> the node subscribed to its channel
        self._attempts: dict[int, int] = {}
        self._moving: set[int] = set()  # slots subscribed again after a move, not yet confirmed
        self._heard: dict[tuple[str, int], float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._lost = False

    def _channel(self, slot: int) -> str:
        return f"{self.base}:{{{slot_tags()[slot]}}}"

    async def _owners(self) -> list[tuple[str, int] | None]:
        """Each slot's primary, as a node of the cluster answers now."""
        owners: list[tuple[str, int] | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        answer = await self.cluster.redis.execute_command("CLUSTER SLOTS")
        for (start, end), shard in answer.items():
            host, port = shard["primary"]
            owners[start : end + 1] = [(host, int(port))] * (end + 1 - start)
        return owners

    async def start(self) -> None:
        owners = await self._owners()
        by_node: dict[tuple[str, int], list[int]] = {}
        for slot, node in enumerate(owners):
            if node is None:
                raise FeedLost(f"slot {slot} has no primary")
            by_node.setdefault(node, []).append(slot)
        for node, slots in by_node.items():
            await self._subscribe(node, slots)
        self._spawn(self._move())
        self._spawn(self._keep_alive())

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _subscribe(self, node: tuple[str, int], slots: Sequence[int]) -> None:
        if node not in self._clients:
            client = redis.Redis(host=node[0], port=node[1], **self.cluster.node_options)
            pubsub = client.pubsub()
            self._clients[node] = (client, pubsub)
            await pubsub.connect()  # type: ignore[no-untyped-call]  # redis-py's PubSub.connect is unannotated
            self._heard[node] = time.monotonic()
            self._spawn(self._read(node, pubsub))
        connection = self._clients[node][1].connection
        assert connection is not None
        # One channel a command (SSUBSCRIBE refuses channels of two slots), sent in batches, unanswered:
        # the confirmations arrive among the messages, which the reader skips.
        for start in range(0, len(slots), self.SUBSCRIBE_BATCH):
            batch = slots[start : start + self.SUBSCRIBE_BATCH]
            for slot in batch:
                self._held[slot] = node
            await connection.send_packed_command(
                connection.pack_commands([("SSUBSCRIBE", self._channel(slot)) for slot in batch])
            )

    def _lose(self, why: str) -> None:
        if not self._lost:
            self._lost = True
            self._queue.put_nowait(FeedLost(why))

    def _dropped(self, slot: int, node: tuple[str, int]) -> None:
        if self._held.get(slot) == node:
            del self._held[slot]
            self._moving.add(slot)
            self._moved.put_nowait(slot)

    async def _read(self, node: tuple[str, int], pubsub: PubSub) -> None:
        try:
            while True:
                try:
                    response = await pubsub.parse_response(block=True)
                except ResponseError as exc:
                    # An SSUBSCRIBE at a node that does not own the slot (any more): MOVED <slot> <node>.
                    words = str(exc).split()
                    if words[:1] != ["MOVED"]:
                        raise
                    self._dropped(int(words[1]), node)
                    continue
                self._heard[node] = time.monotonic()
                if not isinstance(response, list) or not response:
                    continue  # a PONG
                kind = response[0]
                if kind == "smessage":
                    if self._queue.qsize() >= self.BOUND:
                        self._lose(f"{self.BOUND} messages unread")
                        return
                    self._queue.put_nowait(response[2])
                elif kind == "ssubscribe":
                    slot = key_slot(str(response[1]).encode())
                    self._attempts.pop(slot, None)
                    if slot in self._moving:
                        # Heard again at the slot's new owner: what it published before is missed.
                        self._moving.discard(slot)
                        self._queue.put_nowait(RESYNC)
                elif kind == "sunsubscribe":
                    # Never asked for: the node lost the channel's slot.
                    self._dropped(key_slot(str(response[1]).encode()), node)
        except Exception as exc:  # the connection failed: whatever it carried next is lost
            self._lose(f"{node[0]}:{node[1]}: {exc!r}")

    async def _move(self) -> None:
        while True:
            slots = {await self._moved.get()}
            while not self._moved.empty():
                slots.add(self._moved.get_nowait())
            if any(self._attempts.get(slot, 0) for slot in slots):
                await asyncio.sleep(self.MOVE_RETRY_SECONDS)
            for slot in slots:
                self._attempts[slot] = self._attempts.get(slot, 0) + 1
                if self._attempts[slot] > self.MOVE_ATTEMPTS:
                    self._lose(f"slot {slot}'s channel found no new owner in {self.MOVE_ATTEMPTS} attempts")
                    return
            try:
                owners = await self._owners()
            except Exception as exc:  # asked again, within MOVE_ATTEMPTS
                log.debug("no slot map: %r", exc)
                owners = [None] * REDIS_CLUSTER_HASH_SLOTS
            by_node: dict[tuple[str, int], list[int]] = {}
            for slot in slots:
                node = owners[slot]
                if node is None:
                    self._moved.put_nowait(slot)
                else:
                    by_node.setdefault(node, []).append(slot)
            for node, moved in by_node.items():
                try:
                    await self._subscribe(node, moved)
                except Exception:  # not reachable yet: again, within MOVE_ATTEMPTS
                    for slot in moved:
                        self._held.pop(slot, None)
                        self._moved.put_nowait(slot)

    async def _keep_alive(self) -> None:
        # A quiet node is pinged (its PONG counts as heard), so one that vanished without closing the
        # connection is noticed within silence_seconds, not never.
        while True:
            await asyncio.sleep(self.ping_seconds)
            now = time.monotonic()
            holding = set(self._held.values())
            for node, (_, pubsub) in list(self._clients.items()):
                if node not in holding:
                    continue  # it holds nothing now (its slots moved away)
                if now - self._heard.get(node, now) > self.silence_seconds:
                    self._lose(f"{node[0]}:{node[1]} silent for {self.silence_seconds:g} s")
                    return
                with contextlib.suppress(Exception):
                    await pubsub.ping()

    async def messages(self) -> Any:
        while True:
            item = await self._queue.get()
            if isinstance(item, FeedLost):
                raise item
            yield item

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        for client, pubsub in self._clients.values():
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call]  # redis-py's PubSub.aclose is unannotated
            with contextlib.suppress(Exception):
                await client.aclose()
        self._clients.clear()
