"""A SessionStore in Redis: the only module of the kit that imports redis.

Layout, with the default prefix `mcp`:

- `mcp:session:<id>`: one hash per session, a field per state entry, each
  value compact JSON text (`_json`: the same value, keys in the same order,
  is always the same text), and beside them the session's record for adoption (a
  field per record entry, named ".<entry>", and ".epoch", the ownership
  epoch), and the store's own bookkeeping in fields named "..<name>":
  `..b`, the bytes of the state's JSON texts (`max_state_bytes`; a state
  under 4 KB is measured instead, so a small session keeps no more), and
  `..#<entry>`, the length of a list over 1 KB that appends keep, so an
  append never decodes more than 1 KB. One small key per session: Redis keeps a hash of short fields in
  its compact listpack encoding, and one command reads, copies or expires
  the whole session.
- `mcp:sessions`: a sorted set of session ids scored by last-seen time (the
  Redis server's clock, so replicas never disagree). Counting live sessions
  trims and counts it: O(log n), never a SCAN.
- `mcp:ops:<id>:<n>`: the session's op records, one hash per span of
  `op_span` seconds (half the op TTL; n counts spans by the Redis server's
  clock), kept the op TTL past its span's end: for each keyed call, its
  digest and the result of each write it applied (for an `apply`, the result
  its caller chose), in fields named by `session_store.op_fields`, so a
  retried call applies each write once; `recall` reads them (one pipeline of
  HMGETs). Fields in a few shared keys, not a key per call: a keyed write
  costs ~290 bytes of Redis (a key of its own cost ~640).
- `mcp:events:<id>`: the session's event log for resumable SSE streams, a
  list of "<position> <stream length> <stream><message>", trimmed to the
  last `max_events` within `max_log_bytes` on every add (`...:bytes` beside
  it holds the bytes its entries take) and kept the event TTL after the latest.
  A list, not a Redis stream: a stream preallocates a 4 KB node, ten times
  what a short call's events take.
- `mcp:holder:<sha256 of the holder>`: a sorted set of the sessions and
  handles a holder (a principal, or a client address) opened, scored by when,
  for `max_sessions_per_holder`; ending one with its holder removes it.
- `mcp:claim:<sha256 of the name>`: a hash whose `holder` field says who
  claimed the name (`claim`), expiring with the claim, and `u` the usage set
  it is charged to.
- `mcp:usage:<blake2b of the holder>` and `...:bytes`: what a holder is
  charged (`max_bytes_per_holder`): a sorted set of the keys charged to it,
  scored by when they expire, and a hash of each one's bytes and their
  `total` (`_USAGE`). A session records the holder it is charged to in `..h`.
- `mcp:events`: a pub/sub channel: each event added publishes "<session id>
  <stream id>", for the replays waiting on that stream (`watch(events=True)`).
- `mcp:changes`: a pub/sub channel, not a key. Every write publishes the
  changed session's id on it from inside its script (no extra round trip),
  and `publish` sends other messages; `watch` subscribes to it.

Every operation is one Lua script (or one read command): the change, the
sliding TTL and the index update happen atomically in one round trip, so 200
concurrent increments end at exactly 200 and no reader sees half a copy.
Every write (`set`, `incr`, `append`, `delete`, `copy`, `apply`) is the
same script, `_WRITE`: replay, fence, change, record. `apply` runs the
single writes' own Lua functions over staged entries: it compares each
expected entry's stored text with the expected value's JSON text (Conflict
on any difference), checks every write against the entries as the writes
before it left them (TypeError, nothing applied), and only then changes the
hash. Counters are added in Lua exactly, as 64-bit integers (HINCRBY's
range and its rules for what is an integer), not in Lua's doubles.

Retries: redis-py's own retry is switched off, because retrying a write
after a timeout can apply it twice. Reads, and writes that carry an op (which
the script replays instead of applying twice), are retried by stamina on the
connection errors named below, bounded in attempts and in time. The time
bound (`retry_seconds`) is meant to outlast a Sentinel failover, so a call
caught by one waits for the new primary instead of failing. It counts from
the first failure of the outage, not from each call's start: once Redis has
been gone that long, every call fails at once, and none is still waiting
when the replica's health check gives up on Redis (mcp_ha/health.py) and HAProxy
cuts what is left on it.

High availability of Redis itself: given `sentinels`, the store asks them
for the current primary of `master_name` whenever it connects, so after a
failover it reconnects to the new primary without a replica restart.
Replication is asynchronous, so a failover can lose the primary's last
writes; with `wait_replicas=N` every state write (an `apply` and a
`delete` included), session record and adoption is acknowledged only once
N replicas have it (Redis WAIT), or all the primary has online while it has
fewer (after a failover, until the old primary is back as its replica:
replica_wait.py; on a cluster, per primary), and otherwise fails with StoreUnavailable, which a
retry with the same op replays. Event logs and TTL touches are not waited for: losing one costs a
stream resumption or a few seconds of TTL, not state.

Credentials: `username`/`password` authenticate every connection to Redis
(an ACL user limited to what this module sends; docs/security.md), and
`sentinel_username`/`sentinel_password` the connections to the sentinels,
which keep their own users. Credentials in `url` serve as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar, Unpack, cast

import redis.asyncio as redis
import stamina
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import ClusterError, NoPermissionError, OutOfMemoryError, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..session_store import (
    ENTRY_BYTES,
    EVENT_BYTES,
    KEY_BYTES,
    OWNER,
    WRITE_OPERATIONS,
    Conflict,
    Fenced,
    LimitExceeded,
    Op,
    OpReused,
    SessionStore,
    StoreFull,
    StoreLimits,
    StoreUnavailable,
    Write,
    check_key,
    event_position,
    mint_event_id,
    op_fields,
    op_span,
    payer_of,
)
from .redis_cluster import PAYER_FUNCTIONS, PAYER_HELPERS, Cluster, FeedLost, FeedWatch, Layout
from .replica_wait import ReplicaWait, online_replicas

T = TypeVar("T")
log = logging.getLogger(__name__)

# On a cluster also: a slot with no primary yet (a failover), a key mid-move, redirections run out.
RETRYABLE = (RedisConnectionError, RedisTimeoutError, ClusterError, TryAgainError)
# The change feed (`watch`) pings its channel this often, and gives up on one silent this long.
WATCH_PING_SECONDS = 1.0
WATCH_SILENCE_SECONDS = 5.0

# Quotas (session_store's module docstring): what a holder is charged, in two keys. The usage set,
# `<prefix>:usage:<payer>`, holds the keys charged to it, each behind a letter saying what of the key
# it counts ('s' a session's state, 'r' its record, 'o' a call's op records, 'e' an event log, 'c' a
# claim), scored by when the key expires (ms, the Redis server's clock); the hash beside it
# (`...:bytes`) holds each one's bytes, and their `total`. Every charge first looks at up to 8 charges
# whose time has passed: one whose key is gone is freed, one whose key a read kept (its TTL slid) is
# timed again by its real expiry. So a charge lasts as long as what it counts, and finding what
# expired costs O(log n) per call, never a scan. A charge is noted (`charge`), checked against the
# quota (`over`: nothing has changed yet), then committed with the write (`commit`).
# A session's usage keys are named from the payer its hash records (`..h`), and a claim's from its
# `u`, not passed in KEYS: on one Redis primary (Sentinel too) a script reaches every key; the ACL
# still bounds them to the kit's prefix. On Redis Cluster (CLUSTER; redis_cluster.py) an owner (a
# session, a claim: OWNER, its key) is charged in a ledger of its own, in its own slot, within the
# grant its payer (PAYER) gave it: past it, a change applies nothing and answers NEED, and the
# client asks the payer's ledger for more (GRANT, what came back) and runs it again. What is to be
# done in other slots once a function returns goes back with its result (HINTS).
_USAGE = (
    f"local KEY_BYTES, ENTRY_BYTES, EVENT_BYTES = {KEY_BYTES}, {ENTRY_BYTES}, {EVENT_BYTES}\n"
    + """
local function key_bytes(name) return KEY_BYTES + 3 * #name end
local function entry_bytes(name, length)
  if length == 0 then return 0 end
  return #name + length + ENTRY_BYTES
end
local function fmt(n) return string.format('%.0f', n) end
local function hint(...) HINTS[#HINTS + 1] = {...} end
-- A payer's usage set, named beside the session index (KEYS[2] of the session scripts: '<prefix>:sessions');
-- on a cluster, the owner's own ledger.
local function usage_set(index, payer)
  if CLUSTER then
    PAYER = payer
    return OWNER .. ':usage'
  end
  return string.sub(index, 1, -9) .. 'usage:' .. payer
end
-- Whom a session is charged to: '..h', else (an authenticated session, which keeps no '..h') its owner's
-- digest, the `.owner` entry without its JSON quotes. False for nobody.
local function payer_of(hash)
  local payer = redis.call('HGET', hash, '..h')
  if payer then return payer end
  local owner = redis.call('HGET', hash, '.owner')
  return owner and string.sub(owner, 2, -2)
end
-- Keeps `key` at least `ms` longer.
local function outlive(key, ms)
  if redis.call('PTTL', key) < ms then redis.call('EXPIRE', key, math.ceil(ms / 1000) + 1) end
end
local function grouped(n)
  local text, k = fmt(n), 1
  while k > 0 do text, k = string.gsub(text, '^(%d+)(%d%d%d)', '%1,%2') end
  return text
end
local function usage(set, quota)
  local t = redis.call('TIME')
  local u = {set = set, bytes = set .. ':bytes', quota = tonumber(quota), delta = 0, changes = {},
    now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)}
  local freed = 0
  for _, member in ipairs(redis.call('ZRANGE', set, '-inf', u.now, 'BYSCORE', 'LIMIT', 0, 8)) do
    local left = redis.call('PTTL', string.sub(member, 2))
    if left > 0 then
      redis.call('ZADD', set, u.now + left, member)
      outlive(set, left)
      outlive(u.bytes, left)
    else
      freed = freed + tonumber(redis.call('HGET', u.bytes, member) or '0')
      redis.call('ZREM', set, member)
      redis.call('HDEL', u.bytes, member)
    end
  end
  if freed > 0 then redis.call('HINCRBY', u.bytes, 'total', -freed) end
  if CLUSTER then
    -- The quota here is the owner's grant: raised by what a NEED brought back, if it is the answer to
    -- one asked since the owner last lowered it (a late answer to an older one may only raise it too).
    local g = redis.call('HMGET', u.bytes, 'grant', 'gv', 'lv', 'gx')
    local grant, gv, lv, gx = tonumber(g[1]) or 0, tonumber(g[2]), tonumber(g[3]) or 0, tonumber(g[4]) or 0
    local changed = false
    if GRANT[4] ~= '' and (not gv or tonumber(GRANT[4]) > gv) then gv, changed = tonumber(GRANT[4]), true end
    if GRANT[1] ~= '' and gv and tonumber(GRANT[2]) > lv and tonumber(GRANT[2]) <= gv then
      grant, gx, changed = math.max(grant, tonumber(GRANT[1])), math.max(gx, tonumber(GRANT[3])), true
    end
    if changed then
      redis.call('HSET', u.bytes, 'grant', fmt(grant), 'gv', fmt(gv), 'gx', fmt(gx))
      outlive(u.bytes, LEASE)
    end
    u.quota, u.gv = grant, gv
  end
  return u
end
-- Notes `member`'s charge from now on, for `ttl` seconds: `bytes`; or, with `grow`, what it is
-- charged now plus `grow`, where `bytes` (a number, or a function working it out) is what it is
-- charged when it has no charge yet or its key is `fresh` (new).
local function charge(u, member, bytes, ttl, grow, fresh)
  u.changes[#u.changes + 1] = {member = member, bytes = bytes, ms = tonumber(ttl) * 1000, grow = grow, fresh = fresh}
end
-- Reads what the noted members are charged now (one HMGET), works out their new charges, and
-- answers the refusal when they would take the holder past its quota; nil otherwise.
local function over(u)
  local fields = {'total'}
  for i, change in ipairs(u.changes) do fields[i + 1] = change.member end
  local charged = redis.call('HMGET', u.bytes, unpack(fields))
  local total = tonumber(charged[1]) or 0
  for i, change in ipairs(u.changes) do
    local old = tonumber(charged[i + 1]) or 0
    if change.grow then
      local from = old
      if change.fresh or old == 0 then
        from = type(change.bytes) == 'function' and change.bytes() or change.bytes
      end
      change.bytes = from + change.grow
    end
    u.delta = u.delta + change.bytes - old
  end
  if u.delta > 0 and total + u.delta > u.quota then
    if CLUSTER then
      -- A new ledger's versions start at the server's time in microseconds, above any earlier one's.
      local gv = (u.gv or u.now * 1000) + 1
      redis.call('HSET', u.bytes, 'gv', fmt(gv))
      outlive(u.bytes, LEASE)
      return redis.error_reply('NEED ' .. PAYER .. ' ' .. OWNER .. ' ' .. fmt(total + u.delta + SLACK) .. ' '
        .. fmt(total + u.delta) .. ' ' .. fmt(gv))
    end
    return redis.error_reply("LIMIT this client's stored data would take " .. grouped(total + u.delta)
      .. ' bytes; the store keeps at most ' .. grouped(u.quota) .. ' per client (MAX_CLIENT_BYTES)')
  end
end
-- On a cluster, once an owner's charges changed or were read: a grant far above what it holds is
-- lowered here at once (LOWER tells the payer, whose entry only takes a newer version), and the
-- payer's entry for it kept alive while the owner lives (RENEW, optimistically noted here).
local function settle(bytes, now)
  local g = redis.call('HMGET', bytes, 'total', 'grant', 'gv', 'gx', 'rn')
  local total, grant = tonumber(g[1]) or 0, tonumber(g[2]) or 0
  if grant - total > 2 * SLACK then
    local gv = (tonumber(g[3]) or now * 1000) + 1
    grant = total + SLACK
    redis.call('HSET', bytes, 'grant', fmt(grant), 'gv', fmt(gv), 'lv', fmt(gv))
    hint('LOWER', PAYER, OWNER, fmt(grant), fmt(gv))
  end
  local gx, rn = tonumber(g[4]) or 0, tonumber(g[5]) or 0
  if grant > 0 and gx - now < LEASE * 0.75 and now - rn > LEASE / 8 then
    redis.call('HSET', bytes, 'gx', fmt(now + LEASE), 'rn', fmt(now))
    hint('RENEW', PAYER, OWNER)
  end
end
-- Whether this script has kept a payer's usage keys as long as what it charged them (commit).
local usage_kept = false
local function commit(u)
  local fields, scores, longest = {}, {}, 0
  for i, change in ipairs(u.changes) do
    fields[2 * i - 1], fields[2 * i] = change.member, change.bytes
    scores[2 * i - 1], scores[2 * i] = u.now + change.ms, change.member
    longest = math.max(longest, change.ms)
  end
  redis.call('HSET', u.bytes, unpack(fields))
  redis.call('ZADD', u.set, unpack(scores))
  if u.delta ~= 0 then redis.call('HINCRBY', u.bytes, 'total', u.delta) end
  outlive(u.set, longest)
  outlive(u.bytes, longest)
  usage_kept = true
  if CLUSTER then settle(u.bytes, u.now) end
end
local function uncharge(set, member)
  local bytes = set .. ':bytes'
  local had = tonumber(redis.call('HGET', bytes, member) or '0')
  if had > 0 then
    redis.call('HDEL', bytes, member)
    redis.call('ZREM', set, member)
    redis.call('HINCRBY', bytes, 'total', -had)
    if CLUSTER then
      local t = redis.call('TIME')
      settle(bytes, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
    end
  end
end
"""
)

# Shared by every script: slide the TTL of the session's hash, and index it
# as seen now (the Redis server's clock, so replicas agree). Its payer's usage
# keys are kept as long, so a charge outlives what it counts however long
# reads keep a session.
# KEYS[1] session hash, KEYS[2] index; ARGV[1] id, ARGV[2] ttl.
_TOUCH = (
    _USAGE
    + """
local function touch()
  local now = redis.call('TIME')[1]
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  if CLUSTER then
    -- The index is in other slots: asked to note the session (INDEX) at most every min(60, ttl/10) s,
    -- by the server's clock, so the fleet asks once; an unknown id at every call, as one Redis indexes it.
    local seen = redis.call('HGET', KEYS[1], '..ix')
    if not seen or now - tonumber(seen) > math.min(60, tonumber(ARGV[2]) / 10) then
      if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], '..ix', now) end
      hint('INDEX', ARGV[1])
    end
  else
    redis.call('ZADD', KEYS[2], now, ARGV[1])
    redis.call('EXPIRE', KEYS[2], ARGV[2])
  end
  local payer = not usage_kept and payer_of(KEYS[1])
  if payer then
    local set = usage_set(KEYS[2], payer)
    outlive(set, ARGV[2] * 1000)
    outlive(set .. ':bytes', ARGV[2] * 1000)
    if CLUSTER then settle(set .. ':bytes', tonumber(now) * 1000) end
  end
end
"""
)

_GET = (
    _TOUCH
    + """
touch()
return redis.call('HGET', KEYS[1], ARGV[3])
"""
)

_ITEMS = (
    _TOUCH
    + """
touch()
return redis.call('HGETALL', KEYS[1])
"""
)

_TOUCH_ONLY = (
    _TOUCH
    + """
touch()
"""
)

# Integers as HINCRBY reads and writes them (64-bit, no leading zeros, no
# '+'), kept exact: Lua's numbers are doubles, exact only to 2^53, so an
# integer is held as two limbs of nine digits, each with the number's sign.
_INTEGERS = """
local LIMB = 1e9
local function fits(high, low)
  if high > 0 or low > 0 then return high < 9223372036 or (high == 9223372036 and low <= 854775807) end
  return high > -9223372036 or (high == -9223372036 and low >= -854775808)
end
-- An integer's text as its limbs; nil for anything HINCRBY would refuse.
local function integer(text)
  if text == '0' then return 0, 0 end
  local sign, digits = string.match(text, '^(%-?)([1-9]%d*)$')
  if not digits or #digits > 19 then return nil end
  local high, low = tonumber(string.sub(digits, 1, -10)) or 0, tonumber(string.sub(digits, -9))
  if sign == '-' then high, low = 0 - high, 0 - low end
  if not fits(high, low) then return nil end
  return high, low
end
local function add(high, low, by_high, by_low)
  high, low = high + by_high, low + by_low
  if low >= LIMB then high, low = high + 1, low - LIMB
  elseif low <= -LIMB then high, low = high - 1, low + LIMB end
  if high > 0 and low < 0 then high, low = high - 1, low + LIMB
  elseif high < 0 and low > 0 then high, low = high + 1, low - LIMB end
  return high, low
end
local function integer_text(high, low)
  if high == 0 then return string.format('%.0f', low) end
  return string.format(high < 0 and '-%.0f%09.0f' or '%.0f%09.0f', math.abs(high), math.abs(low))
end
"""

# Every write, in one script, in this order (answering {result, replayed}):
#   1. an op already applied (the session's op buckets, named from KEYS[3], hold its result)
#      is not applied again, and a call whose digest is not the recorded
#      one (the same key sent with another call) is refused;
#   2. a writer whose epoch is no longer the session's is refused (fencing);
#   3. for an apply, an entry whose JSON text is no longer the expected one
#      is a conflict ('' expects it absent, or null, which reads the same);
#   4. a change past the state's bound, or past the quota of the session's
#      payer (its state and the op's record, `_USAGE`), is refused;
#   5. the change, the op's result and their charges commit together, so a
#      replica that dies right after cannot leave a change without its record.
# ARGV[3] epoch or '', ARGV[4] op ttl, ARGV[5] the op's digest or '' (no op),
# ARGV[6] the write's field in the op bucket (session_store.op_fields: the
# digest's field, then the write), ARGV[7] the operation, ARGV[8] the
# most bytes the state may take, ARGV[9] the most items an append may make
# ('' for no bound), ARGV[10] the most bytes a holder's keys may take,
# ARGV[11..] the operation's arguments; KEYS[4] a copy's source; KEYS[5] the changes channel (a
# channel, not a key: named here so the script never builds a name), where
# the changed session's id is published once the change commits. The operations: 'set', 'incr',
# 'append' and 'delete' (ARGV[11] the entry, ARGV[12] the value, amount or
# item), 'copy', and 'apply': ARGV[11] the result to record, ARGV[12] how many
# expected entries follow as (entry, JSON text or ''), then the writes as
# (operation, entry, argument).
# The single writes and an apply's run through the same functions, which
# read an entry through value() and stage a change through put(), each
# seeing the ones before it; the hash changes only once every write passed
# and the whole change is within the bounds, so a refused write leaves
# nothing behind.
# Appends splice the new item (JSON text) into the stored JSON array, so
# nothing is decoded and re-encoded on the way (cjson would round floats).
_WRITE = (
    _TOUCH
    + _INTEGERS
    + """
local staged, staged_order = {}, {}
local max_bytes, max_items = tonumber(ARGV[8]), tonumber(ARGV[9])
local function value(field)
  if staged[field] ~= nil then return staged[field] end
  return redis.call('HGET', KEYS[1], field)
end
-- The state's size: '..b' holds the bytes of every entry's text, and
-- '..#<entry>' the length of a list over 1 KB that appends keep, so neither
-- a size check nor an append ever decodes more than 1 KB. A small state
-- (at most SMALL bytes in at most 64 entries) keeps no '..b' and is measured
-- entry by entry instead, cheap at that size: a small session stays as small
-- as it was.
local SMALL = 4096
local size, keep_size = nil, false
local function state_size()
  if size then return size end
  local stored = redis.call('HGET', KEYS[1], '..b')
  if stored then
    size, keep_size = tonumber(stored), true
    return size
  end
  local entries = 0
  size = 0
  for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
    if string.sub(name, 1, 1) ~= '.' then
      size, entries = size + redis.call('HSTRLEN', KEYS[1], name), entries + 1
    end
  end
  keep_size = size > SMALL or entries > 64
  return size
end
local function record_size(new_size)
  size = new_size
  if keep_size or new_size > SMALL then
    keep_size = true
    redis.call('HSET', KEYS[1], '..b', new_size)
  end
end
local function too_large(new_size)
  return redis.error_reply("LIMIT this session's state would take " .. string.format('%.0f', new_size)
    .. ' bytes; the store keeps at most ' .. ARGV[8])
end
local function set_field(field, text)
  if text then redis.call('HSET', KEYS[1], field, text) else redis.call('HDEL', KEYS[1], field) end
end
-- Stages an entry's change (text false: removes it), and its list length (count nil: unknown).
local function put(field, text, count)
  for _, name in ipairs({field, '..#' .. field}) do
    if staged[name] == nil then staged_order[#staged_order + 1] = name end
  end
  staged[field] = text
  staged['..#' .. field] = count and tostring(count) or false
end
-- Each answers its result as JSON text, or nil and the error.
local write = {}
function write.set(field, text)
  put(field, text)
  return 'null'
end
function write.delete(field)
  local existed = value(field) and 'true' or 'false'
  put(field, false)
  return existed
end
function write.incr(field, by)
  local high, low = integer(value(field) or '0')
  if not high then return nil, redis.error_reply('WRONGTYPE entry does not hold an integer') end
  local by_high, by_low = integer(by)
  if not by_high then return nil, redis.error_reply('ERR increment is not an integer or out of range') end
  high, low = add(high, low, by_high, by_low)
  if not fits(high, low) then return nil, redis.error_reply('ERR increment or decrement would overflow') end
  local text = integer_text(high, low)
  put(field, text)
  return text
end
function write.append(field, item)
  local current, updated, count = value(field), nil, nil
  if not current or current == '[]' then
    updated, count = '[' .. item .. ']', 1
  elseif string.sub(current, 1, 1) == '[' then
    updated = string.sub(current, 1, -2) .. ',' .. item .. ']'
    -- Decoded once for a list no append has counted yet (set whole, or
    -- stored before lengths were kept); counted from then on.
    count = tonumber(value('..#' .. field) or '') or #cjson.decode(current)
    count = count + 1
  else
    return nil, redis.error_reply('WRONGTYPE entry does not hold a list')
  end
  if max_items and count > max_items then
    return nil, redis.error_reply('LIMIT this list holds ' .. (count - 1) .. ' items, the most it may')
  end
  put(field, updated, #updated > 1024 and count or nil)
  return tostring(count)
end

-- A call's records live in the session's op buckets (KEYS[3] .. ':' .. n: the calls written in the
-- n-th span of `op_span` seconds, by the server's clock), each kept the op TTL past its span's end:
-- the bucket now, and those before it that can still hold a record of the last op TTL.
local bucket, bucket_ttl, digest_field
if ARGV[5] ~= '' then
  local ttl = tonumber(ARGV[4])
  local span, now = math.max(1, math.floor(ttl / 2)), tonumber(redis.call('TIME')[1])
  local n = math.floor(now / span)
  bucket, bucket_ttl = KEYS[3] .. ':' .. string.format('%d', n), (n + 1) * span + ttl - now
  local length = string.match(ARGV[6], '^%d+')
  digest_field = string.sub(ARGV[6], 1, #length + 1 + tonumber(length))
  for m = n, n - math.ceil(ttl / span), -1 do
    local found = redis.call('HMGET', KEYS[3] .. ':' .. string.format('%d', m), digest_field, ARGV[6])
    if found[1] and found[1] ~= ARGV[5] then
      return redis.error_reply('OPREUSED the idempotency key belongs to another call')
    end
    if found[2] then
      -- A write of its own, so a WAIT after this replay covers the write it
      -- replays, which may have been made on another connection.
      touch()
      return {found[2], 1}
    end
  end
end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[1], '.epoch') ~= ARGV[3] then
  return redis.error_reply('FENCED the session has a newer owner')
end
local op, result, copied = ARGV[7], nil, nil
if write[op] then
  local failed
  result, failed = write[op](ARGV[11], ARGV[12])
  if failed then return failed end
elseif op == 'apply' then
  local expected = tonumber(ARGV[12])
  for i = 13, 12 + 2 * expected, 2 do
    local wanted, current = ARGV[i + 1], redis.call('HGET', KEYS[1], ARGV[i])
    local unchanged
    if wanted == '' then unchanged = not current or current == 'null' else unchanged = current == wanted end
    if not unchanged then return redis.error_reply('CONFLICT an entry changed since it was read') end
  end
  for i = 13 + 2 * expected, #ARGV, 3 do
    if not write[ARGV[i]] then return redis.error_reply('ERR unknown write ' .. ARGV[i]) end
    local _, refused = write[ARGV[i]](ARGV[i + 1], ARGV[i + 2])
    if refused then return refused end
  end
  result = ARGV[11]
elseif op == 'copy' then
  -- State only (the source's record stays its own), with lists' lengths
  -- ('..#' fields); a target's stale lengths go.
  local flat, entries = redis.call('HGETALL', KEYS[4]), 0
  copied = {}
  for i = 1, #flat, 2 do
    local name = flat[i]
    if string.sub(name, 1, 1) ~= '.' or string.sub(name, 1, 3) == '..#' then
      copied[#copied + 1] = name
      copied[#copied + 1] = flat[i + 1]
    end
    if string.sub(name, 1, 1) ~= '.' then
      put(name, flat[i + 1])
      entries = entries + 1
    end
  end
  result = tostring(entries)
else
  return redis.error_reply('ERR unknown operation ' .. op)
end
-- What the change does to the state's size, and to what the state is charged.
local new_size, cost = state_size(), 0
for _, field in ipairs(staged_order) do
  if string.sub(field, 1, 2) ~= '..' then
    local old, new = redis.call('HSTRLEN', KEYS[1], field), staged[field] and #staged[field] or 0
    new_size = new_size - old + new
    cost = cost + entry_bytes(field, new) - entry_bytes(field, old)
  end
end
if max_bytes and new_size > max_bytes and new_size > state_size() then return too_large(new_size) end
local payer, u = payer_of(KEYS[1]), nil
if payer then
  u = usage(usage_set(KEYS[2], payer), ARGV[10])
  -- The state is charged as it grows, from its first charge: the key, and whatever state it holds.
  local function first_charge()
    local bytes = key_bytes(KEYS[1])
    for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
      if string.sub(name, 1, 1) ~= '.' then bytes = bytes + entry_bytes(name, redis.call('HSTRLEN', KEYS[1], name)) end
    end
    return bytes
  end
  charge(u, 's' .. KEYS[1], first_charge, ARGV[2], cost)
  if bucket then
    -- So is the op bucket, by the fields this write adds to it.
    local grow = entry_bytes(ARGV[6], #result)
    if redis.call('HEXISTS', bucket, digest_field) == 0 then grow = grow + entry_bytes(digest_field, #ARGV[5]) end
    charge(u, 'o' .. bucket, key_bytes(bucket), bucket_ttl, grow, redis.call('EXISTS', bucket) == 0)
  end
  local refused = over(u)
  if refused then return refused end
end
if copied then
  -- Lists' lengths go along, and a target's stale ones go; in chunks, so
  -- unpack() stays far below Lua's stack limit.
  for i = 1, #copied, 2 do
    if string.sub(copied[i], 1, 1) ~= '.' then redis.call('HDEL', KEYS[1], '..#' .. copied[i]) end
  end
  for i = 1, #copied, 200 do
    redis.call('HSET', KEYS[1], unpack(copied, i, math.min(i + 199, #copied)))
  end
else
  for _, field in ipairs(staged_order) do set_field(field, staged[field]) end
end
record_size(new_size)
if bucket then
  redis.call('HSET', bucket, digest_field, ARGV[5], ARGV[6], result)
  redis.call('EXPIRE', bucket, bucket_ttl)
end
if u then commit(u) end
touch()
redis.call(CLUSTER and 'SPUBLISH' or 'PUBLISH', KEYS[5], ARGV[1])
return {result, 0}
"""
)

# The record, flattened as field, value, ... (fields ".<entry>", without
# ".epoch"), read without reading the state.
_RECORD = """
local function record_fields()
  local names = {}
  for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
    if string.sub(name, 1, 1) == '.' and string.sub(name, 2, 2) ~= '.' and name ~= '.epoch' then
      names[#names + 1] = name
    end
  end
  return names
end
local function record()
  local names, flat = record_fields(), {}
  if #names == 0 then return flat end
  local values = redis.call('HMGET', KEYS[1], unpack(names))
  for i, name in ipairs(names) do
    flat[#flat + 1] = name
    flat[#flat + 1] = values[i]
  end
  return flat
end
"""

# Refused past ARGV[3] live sessions in all (KEYS[2], the index), or past
# ARGV[4] for the holder (KEYS[3], the sessions it opened, scored by when;
# ARGV[5] '' for no holder), or past the quota (ARGV[7]) of the session's
# payer: the one it records, else ARGV[6] ('' for none), to whom its record is
# charged from now on. ARGV[8..]: the record, flattened as field, value, ...
_OPEN = (
    _TOUCH
    + """
local now = tonumber(redis.call('TIME')[1])
local horizon = now - tonumber(ARGV[2])
-- On a cluster the index and the holder's sessions are in other slots: checked before (redis_cluster.py).
if redis.call('EXISTS', KEYS[1]) == 0 and not CLUSTER then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', horizon)
  if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[3]) then
    return redis.error_reply('LIMIT this server holds ' .. ARGV[3] .. ' sessions, the most it may')
  end
end
if ARGV[5] ~= '' and not CLUSTER then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', horizon)
  if redis.call('ZSCORE', KEYS[3], ARGV[1]) == false and redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[4]) then
    return redis.error_reply('LIMIT you hold ' .. ARGV[4] .. ' open sessions, the most you may; end some first')
  end
end
local payer, u, owned = payer_of(KEYS[1]) or (ARGV[6] ~= '' and ARGV[6]), nil, false
if payer then
  u = usage(usage_set(KEYS[2], payer), ARGV[7])
  local bytes = key_bytes(KEYS[1]) + entry_bytes('.epoch', 1)
  for i = 8, #ARGV, 2 do
    bytes = bytes + entry_bytes(ARGV[i], #ARGV[i + 1])
    if ARGV[i] == '.owner' and string.sub(ARGV[i + 1], 2, -2) == payer then owned = true end
  end
  if not owned then bytes = bytes + entry_bytes('..h', #payer) end
  charge(u, 'r' .. KEYS[1], bytes, ARGV[2])
  local refused = over(u)
  if refused then return refused end
end
if ARGV[5] ~= '' and not CLUSTER then
  redis.call('ZADD', KEYS[3], now, ARGV[1])
  redis.call('EXPIRE', KEYS[3], ARGV[2])
end
redis.call('HSET', KEYS[1], '.epoch', 1, unpack(ARGV, 8))
if payer then
  if not owned then redis.call('HSET', KEYS[1], '..h', payer) end
  commit(u)
end
touch()
return 1
"""
)

# Reads only: nil when the session has no record.
_READ_RECORD = (
    _RECORD
    + """
if redis.call('HEXISTS', KEYS[1], '.epoch') == 0 then return nil end
return record()
"""
)

# Only a recorded session's record, and never its owner (the caller drops it).
_UPDATE_RECORD = """
if redis.call('HEXISTS', KEYS[1], '.epoch') == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

_ADOPT = (
    _TOUCH
    + _RECORD
    + """
if redis.call('HEXISTS', KEYS[1], '.epoch') == 0 then return nil end
local epoch = redis.call('HINCRBY', KEYS[1], '.epoch', 1)
touch()
return {epoch, record()}
"""
)

# The owner stays: it guards the state, which stays too. The session leaves
# its holder's count (KEYS[2]); its payer (its usage keys named beside
# KEYS[3], the index) is charged what is left of the record, the owner and
# the payer's own entry, while the state lives: counted, never refused, for
# an end must work past the quota. ARGV[1] the session's id.
_END = (
    _USAGE
    + _RECORD
    + """
if not CLUSTER then redis.call('ZREM', KEYS[2], ARGV[1]) end
if redis.call('HEXISTS', KEYS[1], '.epoch') == 0 then return 0 end
local names = {'.epoch'}
for _, name in ipairs(record_fields()) do
  if name ~= '.owner' then names[#names + 1] = name end
end
redis.call('HDEL', KEYS[1], unpack(names))
-- Its event log and op records serve nobody now (a request naming an ended session gets 404, so
-- nothing resumes or replays them): they go at once, and so do their charges. KEYS[4] the log,
-- KEYS[5] its size, KEYS[6] what the op buckets are named after (_WRITE's KEYS[3]), ARGV[2] the op TTL.
local dropped = {KEYS[4], KEYS[5]}
local ttl = tonumber(ARGV[2])
local span = math.max(1, math.floor(ttl / 2))
local n = math.floor(tonumber(redis.call('TIME')[1]) / span)
for m = n + 1, n - math.ceil(ttl / span) - 1, -1 do dropped[#dropped + 1] = KEYS[6] .. ':' .. string.format('%d', m) end
for _, key in ipairs(dropped) do redis.call('EXPIRE', key, 0) end  -- EXPIRE, not DEL: the kit's ACL has no DEL
local payer = payer_of(KEYS[1])
if payer then
  local set = usage_set(KEYS[3], payer)
  local u = usage(set, 0)
  local left = key_bytes(KEYS[1]) + entry_bytes('.owner', redis.call('HSTRLEN', KEYS[1], '.owner'))
  left = left + entry_bytes('..h', redis.call('HSTRLEN', KEYS[1], '..h'))
  charge(u, 'r' .. KEYS[1], left, redis.call('PTTL', KEYS[1]) / 1000)
  over(u)
  commit(u)
  uncharge(set, 'e' .. KEYS[4])
  for i = 3, #dropped do uncharge(set, 'o' .. dropped[i]) end
end
return 1
"""
)

# Take KEYS[1] for ARGV[1] for ARGV[2] seconds unless someone else holds it; the holder after.
# Charged, within ARGV[3] bytes, to the usage set it records (`u`: the first one it was charged to),
# else to KEYS[2] when ARGV[4] is '1' (a holder was given), else to nobody: its key, its holder, and
# ARGV[5] bytes more (what the caller keeps elsewhere while the claim lasts).
_CLAIM = (
    _USAGE
    + """
local held = redis.call('HGET', KEYS[1], 'holder')
if held and held ~= ARGV[1] then return held end
local set, u = redis.call('HGET', KEYS[1], 'u') or (ARGV[4] == '1' and KEYS[2]), nil
if set then
  u = usage(set, ARGV[3])
  charge(u, 'c' .. KEYS[1], key_bytes(KEYS[1]) + #ARGV[1] + tonumber(ARGV[5]), ARGV[2])
  local refused = over(u)
  if refused then return refused end
  redis.call('HSET', KEYS[1], 'u', set)
  if CLUSTER then redis.call('HSET', KEYS[1], 'p', PAYER) end
end
redis.call('HSET', KEYS[1], 'holder', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
if u then commit(u) end
return ARGV[1]
"""
)

# Drop the claim KEYS[1] (its last field gone, Redis drops the key), and its charge.
_RELEASE = (
    _USAGE
    + """
local set = redis.call('HGET', KEYS[1], 'u')
if CLUSTER then PAYER = redis.call('HGET', KEYS[1], 'p') end
redis.call('HDEL', KEYS[1], 'holder', 'u', 'p')
if set then uncharge(set, 'c' .. KEYS[1]) end
"""
)

# Trim what fell out of the TTL, then count what is left.

_COUNT = """
local horizon = tonumber(redis.call('TIME')[1]) - tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', horizon)
return redis.call('ZCARD', KEYS[1])
"""

# Positions are "<ms>-<n>": the Redis server's clock, and a count within the
# millisecond, never going back even if the clock does, so a position from an
# expired log cannot name an event of a later one.
# KEYS[1] the session's event log, KEYS[2] the bytes its entries take;
# ARGV[1] max events, ARGV[2] ttl, ARGV[3] stream id, ARGV[4] the message
# ('' for a priming event), ARGV[5] max bytes, ARGV[6] the session's id,
# published on KEYS[3] (the events channel) with the stream's, for replays waiting on that stream.
# The oldest entries go first, each add trimming what takes the log past its bounds: O(1)
# amortized. The log is charged to the session's payer (KEYS[4] the session's hash, KEYS[5] the
# index), within ARGV[7] bytes, as it is once the event is in and the oldest are out: what it would
# be is worked out first, so a refused event changes nothing.
_ADD_EVENT = (
    _USAGE
    + """
local t = redis.call('TIME')
local ms, n = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), 0
local last = redis.call('LINDEX', KEYS[1], -1)
if last then
  local last_ms, last_n = string.match(last, '^(%d+)-(%d+) ')
  if tonumber(last_ms) >= ms then ms, n = tonumber(last_ms), tonumber(last_n) + 1 end
end
local position = string.format('%.0f-%.0f', ms, n)
local entry = position .. ' ' .. #ARGV[3] .. ' ' .. ARGV[3] .. ARGV[4]
local length = (last and redis.call('LLEN', KEYS[1]) or 0) + 1
local size = last and tonumber(redis.call('GET', KEYS[2]) or '0') or 0
local trimmed = 0
size = size + #entry
while length > 1 and (length > tonumber(ARGV[1]) or size > tonumber(ARGV[5])) do
  size = size - #redis.call('LINDEX', KEYS[1], trimmed)
  trimmed, length = trimmed + 1, length - 1
end
local payer, u = payer_of(KEYS[4]), nil
if payer then
  u = usage(usage_set(KEYS[5], payer), ARGV[7])
  charge(u, 'e' .. KEYS[1], key_bytes(KEYS[1]) + key_bytes(KEYS[2]) + size + length * EVENT_BYTES, ARGV[2])
  local refused = over(u)
  if refused then return refused end
end
redis.call('RPUSH', KEYS[1], entry)
if trimmed > 0 then redis.call('LPOP', KEYS[1], trimmed) end
redis.call('SET', KEYS[2], size, 'EX', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[2])
if u then commit(u) end
redis.call(CLUSTER and 'SPUBLISH' or 'PUBLISH', KEYS[3], ARGV[6] .. ' ' .. ARGV[3])
return position
"""
)

# The stream of the event at position ARGV[1] and that stream's later events,
# from this one session's log only; nil when the event is not there.
_EVENTS_AFTER = """
local found, events = nil, {}
for _, entry in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  local position, length, from = string.match(entry, '^(%S+) (%d+) ()')
  length = tonumber(length)
  local stream = string.sub(entry, from, from + length - 1)
  if found then
    if stream == found then
      local message = string.sub(entry, from + length)
      events[#events + 1] = {position, message ~= '' and message or false}
    end
  elseif position == ARGV[1] then
    found = stream
  end
end
if not found then return false end
return {found, events}
"""

# For a replay following stream ARGV[2]: that stream's events after position ARGV[1] (an event of any
# stream), and the log's latest position; false when the log no longer holds ARGV[1]. Positions only
# grow along the list, so it is walked from its end back to ARGV[1], in chunks that double: the cost is
# what was added since, not the log.
_STREAM_SINCE = """
local want_ms, want_n = string.match(ARGV[1], '^(%d+)-(%d+)$')
want_ms, want_n = tonumber(want_ms), tonumber(want_n)
local later, found, done, last, chunk = {}, false, false, -1, 4
while not done do
  local entries = redis.call('LRANGE', KEYS[1], last - chunk + 1, last)
  for i = #entries, 1, -1 do
    local ms, n = string.match(entries[i], '^(%d+)-(%d+) ')
    ms, n = tonumber(ms), tonumber(n)
    if ms < want_ms or (ms == want_ms and n <= want_n) then
      found = string.sub(entries[i], 1, #ARGV[1] + 1) == ARGV[1] .. ' '
      done = true
      break
    end
    later[#later + 1] = entries[i]
  end
  done = done or #entries < chunk
  last, chunk = last - chunk, chunk * 2
end
if not found then return false end
local events = {}
for i = #later, 1, -1 do
  local position, length, from = string.match(later[i], '^(%S+) (%d+) ()')
  length = tonumber(length)
  if string.sub(later[i], from, from + length - 1) == ARGV[2] then
    local message = string.sub(later[i], from + length)
    events[#events + 1] = {position, message ~= '' and message or false}
  end
end
local latest = later[1] and string.match(later[1], '^(%S+) ') or ARGV[1]
return {latest, events}
"""


# Every script above as one Redis Functions library, so the kit's Redis user
# needs FCALL only, never EVAL or SCRIPT LOAD: it cannot run Lua of its own.
# Named by a digest of its code, so replicas of two kit versions call each
# their own during a rolling upgrade. Functions are kept by Redis (RDB, AOF)
# and replicated, so a replica promoted by Sentinel has them too.
_FUNCTIONS = {
    "get": _GET,
    "items": _ITEMS,
    "touch": _TOUCH_ONLY,
    "write": _WRITE,
    "count": _COUNT,
    "claim": _CLAIM,
    "release": _RELEASE,
    "open": _OPEN,
    "read_record": _READ_RECORD,
    "update_record": _UPDATE_RECORD,
    "adopt": _ADOPT,
    "end": _END,
    "add_event": _ADD_EVENT,
    "events_after": _EVENTS_AFTER,
    "stream_since": _STREAM_SINCE,
}
# Run even past maxmemory: reads (whose TTL touch changes nothing's size), counting, ending
# sessions and releasing claims (which free memory). Every other function is refused there before it starts: StoreFull.
_ALLOW_OOM = ("get", "items", "touch", "count", "read_record", "end", "release", "events_after", "stream_since")
# On Redis Cluster (redis_cluster.py): the functions that charge an owner or touch a session, which
# take the grant protocol's arguments first and answer their hints beside their result; where each
# has its owner's key and the channel it publishes to (no key: named in KEYS on one Redis only).
_GRANTED = ("get", "items", "touch", "write", "claim", "release", "open", "adopt", "end", "add_event")
_OWNER_AT = {"add_event": 4}
_CHANNEL_AT = {"write": 5, "add_event": 3}
_SINGLE_HEAD = "local CLUSTER, HINTS, OWNER, PAYER, SLACK, LEASE, GRANT = false\n"
LIBRARY = (
    "mcp_ha_"
    + hashlib.sha256((_SINGLE_HEAD + "".join(_FUNCTIONS.values())).encode() + repr(_ALLOW_OOM).encode()).hexdigest()[
        :12
    ]
)


def _cluster_callback(name: str, body: str) -> str:
    if name not in _GRANTED:
        return f"function(KEYS, ARGV)\nlocal CLUSTER = true\n{body}\nend"
    channel = f"KEYS[{_CHANNEL_AT[name]}] = A[1]\n" if name in _CHANNEL_AT else ""
    return (
        "function(K, A)\n"
        "local CLUSTER, HINTS, KEYS, ARGV = true, {}, K, {}\n"
        f"local OWNER, PAYER = K[{_OWNER_AT.get(name, 1)}], A[2] ~= '' and A[2] or nil\n"
        "local GRANT, SLACK, LEASE = {A[3], A[4], A[5], A[6]}, tonumber(A[7]), tonumber(A[8])\n"
        "for i = 9, #A do ARGV[i - 8] = A[i] end\n"
        f"{channel}"
        f"local result = (function()\n{body}\nend)()\n"
        "if type(result) == 'table' and result.err then return result end\n"
        "if result == nil then result = false end\n"
        "return {result, HINTS}\n"
        "end"
    )


def functions_library(*, cluster: bool = False) -> str:
    """The library's code, for `FUNCTION LOAD REPLACE` by an admin (stack.py, compose, Kubernetes); with
    `cluster`, the one for Redis Cluster (each primary loads it), with the payer's functions too."""
    return _library(CLUSTER_LIBRARY if cluster else LIBRARY, cluster=cluster)


def _library(library: str, *, cluster: bool) -> str:
    # Each script's body becomes a function whose parameters are named KEYS and ARGV, so it runs unchanged.
    parts = [f"#!lua name={library}"]
    for name, body in _FUNCTIONS.items():
        flags = ", flags={'allow-oom'}" if name in _ALLOW_OOM else ""
        callback = _cluster_callback(name, body) if cluster else f"function(KEYS, ARGV)\n{_SINGLE_HEAD}{body}\nend"
        parts.append(f"redis.register_function{{function_name='{library}_{name}', callback={callback}{flags}}}")
    if cluster:
        for name, body in PAYER_FUNCTIONS.items():
            callback = f"function(KEYS, ARGV)\n{PAYER_HELPERS}{body}\nend"
            parts.append(f"redis.register_function{{function_name='{library}_{name}', callback={callback}}}")
    return "\n".join(parts) + "\n"


# Named by a digest of all its code: its own wrappers and the payer's functions are the cluster's only.
CLUSTER_LIBRARY = "mcp_ha_c_" + hashlib.sha256(_library("", cluster=True).encode()).hexdigest()[:12]


NOT_LOADED = (
    f"the kit's Redis functions ({LIBRARY}) are not loaded, and this Redis user may not load them: "
    "load them as an admin with `python -m mcp_ha.stores.redis_store --functions | redis-cli -x FUNCTION LOAD REPLACE` "
    "(stack.py, docker compose and the Kubernetes manifests do)"
)


class _Function:
    """One function of the library, called like a registered script: `f(keys=..., args=...)`."""

    def __init__(self, store: RedisSessionStore, name: str) -> None:
        self.store = store
        self.short = name
        self.name = f"{LIBRARY}_{name}"

    async def __call__(
        self, *, keys: Sequence[Any] = (), args: Sequence[Any] = (), payer: str = "", durable: bool = False
    ) -> Any:
        if (cluster := self.store._cluster) is not None:
            store = self.store
            wait = (store._wait_replicas, store._wait_timeout_ms) if durable and store._wait_replicas else None
            # The session's own channel of the feed: in its slot, so its script may SPUBLISH to it.
            base = {"write": "changes", "add_event": "events"}.get(self.short)
            channel = "" if base is None else cluster.layout.feed(base, keys[0])

            def run() -> Awaitable[Any]:
                if self.short not in _GRANTED:
                    return cluster.fcall(self.short, keys, args, wait=wait)
                return cluster.call(self.short, keys, args, channel=channel, payer=payer, wait=wait)

            try:
                return await run()
            except ResponseError as exc:
                if not _missing(exc):
                    raise
            # A primary without the library (one added by hand): loaded if this user may, else NOT_LOADED.
            await self.store.load_functions()
            return await run()
        try:
            return await self.store._redis.fcall(self.name, len(keys), *keys, *args)
        except ResponseError as exc:
            if not _missing(exc):
                raise
        await self.store.load_functions()
        return await self.store._redis.fcall(self.name, len(keys), *keys, *args)


def _missing(result: object) -> bool:
    return isinstance(result, ResponseError) and "function not found" in str(result).lower()


def _json(value: Any) -> str:
    """The JSON text the store keeps: compact, and always the same for the same value (key order kept),
    so an apply's expected value compares with a stored one as text."""
    return json.dumps(value, separators=(",", ":"))


# An apply's expected value for an entry that must be absent (or null): no JSON text is empty.
_ABSENT = ""


def _write_argument(operation: str, argument: Any) -> Any:
    if operation in ("set", "append"):
        return _json(argument)
    if operation == "incr":
        return argument
    if operation == "delete":
        return ""
    raise ValueError(f"unknown write operation {operation!r}; one of {WRITE_OPERATIONS}")


def _flat_record(record: dict[str, Any]) -> list[str]:
    return [item for name, value in record.items() for item in (f".{name}", _json(value))]


def _record_of(flat: list[str]) -> dict[str, Any]:
    return {flat[i][1:]: json.loads(flat[i + 1]) for i in range(0, len(flat), 2)}


class _BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """Sentinel's discovery of the primary, with the same bounded, queueing pool as without Sentinel."""


def _socket_options(timeout_seconds: float) -> dict[str, Any]:
    """Every connection's, to Redis or to a Sentinel: bounded by the timeout, and no retries of
    redis-py's own (the store's are stamina's)."""
    return {
        "socket_timeout": timeout_seconds,
        "socket_connect_timeout": timeout_seconds,
        "retry": Retry(NoBackoff(), 0),
    }


def _pool_options(timeout_seconds: float, max_connections: int) -> dict[str, Any]:
    """A bounded pool that makes a burst of calls queue for a connection (up to the timeout) instead of
    failing or opening one per call."""
    return {
        "max_connections": max_connections,
        "timeout": timeout_seconds,
        "decode_responses": True,
        **_socket_options(timeout_seconds),
    }


def _sentinel(sentinels: Sequence[tuple[str, int]], timeout_seconds: float, credentials: dict[str, Any]) -> Sentinel:
    options = _socket_options(timeout_seconds) | credentials
    # redis-py's Sentinel.__init__ is unannotated.
    return Sentinel(list(sentinels), sentinel_kwargs=options)  # type: ignore[no-untyped-call]


class RedisSessionStore(SessionStore):
    def __init__(
        self,
        url: str | None = None,
        *,
        sentinels: Sequence[tuple[str, int]] = (),
        cluster_nodes: Sequence[tuple[str, int]] = (),
        master_name: str = "mymaster",
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
        prefix: str = "mcp",
        timeout_seconds: float = 2.0,
        retry_attempts: int | None = None,
        retry_seconds: float = 4.0,
        max_connections: int = 64,
        username: str | None = None,
        password: str | None = None,
        sentinel_username: str | None = None,
        sentinel_password: str | None = None,
        **limits: Unpack[StoreLimits],
    ) -> None:
        """Either `url` (one Redis), `sentinels` (host, port pairs) with `master_name`, or `cluster_nodes`
        (host, port pairs of a Redis Cluster's nodes: any that answer; redis_cluster.py). `limits`:
        SessionStore's TTLs, max_events and on_replay."""
        super().__init__(**limits)
        if [bool(url), bool(sentinels), bool(cluster_nodes)].count(True) != 1:
            raise ValueError("give exactly one of a Redis url, sentinels and cluster nodes")
        if wait_replicas < 0:
            raise ValueError("wait_replicas must be 0 or more")
        self._prefix = prefix
        self._index = f"{prefix}:sessions"
        self._changes = f"{prefix}:changes"
        self._events = f"{prefix}:events"
        # Retries come at most every 0.5 s (wait_max below): enough of them to fill the window.
        self._retry_attempts = retry_attempts if retry_attempts is not None else 5 + math.ceil(2 * retry_seconds)
        self._retry_seconds = retry_seconds
        # When the current outage began, as calls saw it; None while Redis answers.
        self._failing_since: float | None = None
        self._wait_replicas = wait_replicas
        self._wait_timeout_ms = wait_timeout_ms
        # What writes wait for on the primary (`_waited`); a cluster keeps one per primary instead.
        self._replicas = ReplicaWait(wait_replicas, self._online_replicas)
        # Only when given: redis-py would let a None here override credentials in the url.
        credentials = {k: v for k, v in (("username", username), ("password", password)) if v is not None}
        self._layout = Layout(prefix) if cluster_nodes else None
        self._cluster = (
            None
            if self._layout is None
            else Cluster(
                cluster_nodes,
                layout=self._layout,
                library=CLUSTER_LIBRARY,
                timeout_seconds=timeout_seconds,
                max_connections=max_connections,
                ttl_seconds=self.ttl_seconds,
                quota=self.max_bytes_per_holder,
                options=credentials,
            )
        )
        sentinel_credentials = {"username": sentinel_username, "password": sentinel_password}
        self._sentinel = _sentinel(sentinels, timeout_seconds, sentinel_credentials) if sentinels else None
        self._redis = self._client(url, master_name, _pool_options(timeout_seconds, max_connections) | credentials)
        self._bind_functions()

    def _client(self, url: str | None, master_name: str, options: dict[str, Any]) -> redis.Redis | RedisCluster:
        if self._cluster is not None:
            return self._cluster.redis
        if self._sentinel is not None:
            primary: redis.Redis = self._sentinel.master_for(
                master_name, connection_pool_class=_BlockingSentinelPool, **options
            )
            return primary
        return redis.Redis.from_pool(redis.BlockingConnectionPool.from_url(str(url), **options))

    def _bind_functions(self) -> None:
        """The library's functions, each called like a registered script (`_Function`)."""
        f = functools.partial(_Function, self)
        self._get, self._items, self._touch = f("get"), f("items"), f("touch")
        self._write_script, self._count, self._claim = f("write"), f("count"), f("claim")
        self._release = f("release")
        self._open, self._read_record = f("open"), f("read_record")
        self._update_record = f("update_record")
        self._adopt, self._end = f("adopt"), f("end")
        self._add_event, self._events_after = f("add_event"), f("events_after")
        self._stream_since = f("stream_since")

    async def load_functions(self) -> None:
        """Load the library (a user with `+function|load` may; the kit's own may not): NOT_LOADED otherwise."""
        try:
            if self._cluster is not None:
                await self._cluster.load(functions_library(cluster=True))
            else:
                await self._redis.function_load(functions_library(), replace=True)
        except NoPermissionError as exc:
            raise StoreUnavailable(NOT_LOADED) from exc

    def _keys(self, session_id: str) -> list[str]:
        """The session's hash and the index; on a cluster the hash twice (the index is in other slots)."""
        if self._layout is not None:
            return [self._layout.session(session_id)] * 2
        return [f"{self._prefix}:session:{session_id}", self._index]

    async def _call(self, call: Callable[[], Awaitable[T]]) -> T:
        """Once, no retry: for writes, which a retry after a timeout could apply twice."""
        try:
            result = await call()
            self._failing_since = None
            return result
        except RETRYABLE as exc:
            await self._mark_outage()
            raise StoreUnavailable(f"redis: {exc}") from exc
        except OutOfMemoryError as exc:
            raise StoreFull(f"redis: {exc}") from exc
        except ResponseError as exc:
            message = str(exc)
            if message.startswith("FENCED"):
                raise Fenced(message) from exc
            if message.startswith("OPREUSED"):
                raise OpReused(message) from exc
            if message.startswith("CONFLICT"):
                raise Conflict(message) from exc
            if message.startswith("LIMIT"):
                raise LimitExceeded(message.removeprefix("LIMIT ")) from exc
            if "WRONGTYPE" in message or "not an integer" in message:
                raise TypeError(message) from exc
            raise

    async def _mark_outage(self) -> float:
        """Notes an outage under way (from now, if none was); the seconds calls may still retry in it."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
            if isinstance(self._redis, redis.Redis):  # a cluster's client keeps its nodes' connections itself
                # A restarted Redis closed every connection; one left idle in the pool would fail the first
                # call made on it after Redis is back, and a write fails without a retry (CI lost an event
                # this way). Those not in use now connect afresh when next taken.
                with contextlib.suppress(*RETRYABLE, OSError):
                    await self._redis.connection_pool.disconnect(inuse_connections=False)
        if self._wait_replicas:
            # Perhaps a failover: a new primary is asked what replicas it has before a write waits there.
            if self._cluster is not None:
                self._cluster.forget_replicas()
            else:
                self._replicas.forget()
        return self._failing_since + self._retry_seconds - now

    async def _read(self, call: Callable[[], Awaitable[T]]) -> T:
        """Retried on connection errors: reads, and writes that are idempotent, are safe to repeat."""
        if self._cluster is not None:
            call = functools.partial(self._cluster.guarded, call)
        try:
            # The first attempt outside stamina: setting up its retry context on
            # every call cost ~6% of a replica's CPU (py-spy, increment_counter load).
            result = await call()
            self._failing_since = None
            return result
        except OutOfMemoryError as exc:
            # A read's script slides the TTL: a write Redis refuses past maxmemory.
            raise StoreFull(f"redis: {exc}") from exc
        except RETRYABLE as exc:
            budget = await self._mark_outage()
            if self._retry_attempts <= 1 or budget <= 0:
                raise StoreUnavailable(f"redis: {exc}") from exc
        try:
            async for attempt in stamina.retry_context(
                on=RETRYABLE,
                attempts=self._retry_attempts - 1,
                timeout=budget,
                wait_initial=0.05,
                wait_max=0.5,
            ):
                with attempt:
                    result = await call()
                    self._failing_since = None
                    return result
        except RETRYABLE as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        raise AssertionError("unreachable: stamina either returns or raises")

    async def _write(
        self,
        session_id: str,
        operation: str,
        *args: Any,
        epoch: int | None,
        op: Op | None,
        source: str | None = None,
        max_items: int | None = None,
    ) -> Any:
        keys = self._keys(session_id)
        keys.append(self._ops_key(session_id) if op is not None else keys[0])
        keys.append(await self._source(source, session_id) if source is not None else keys[0])
        if self._cluster is None:
            keys.append(self._changes)
        argv = [
            session_id,
            self.ttl_seconds,
            "" if epoch is None else epoch,
            self.op_ttl_seconds,
            "" if op is None else op.digest,
            "" if op is None else op_fields(op)[1],
            operation,
            self.max_state_bytes,
            "" if max_items is None else max_items,
            self.max_bytes_per_holder,
            *args,
        ]

        # With an op the script replays instead of applying twice, so even a
        # write whose reply was lost to a timeout is safe to send again.
        def once() -> Awaitable[Any]:
            return self._durable(self._write_script, keys, argv)

        result, replayed = await self._call(lambda: self._read(once)) if op is not None else await self._call(once)
        if replayed and op is not None:  # only a write with an op can be replayed
            self.replayed(op)
        return json.loads(result)

    def _ops_key(self, session_id: str) -> str:
        """What the session's op buckets are named after (`_WRITE`)."""
        if self._layout is not None:
            return self._layout.ops(session_id)
        return f"{self._prefix}:ops:{session_id}"

    async def _source(self, source_id: str, target_id: str) -> str:
        """A copy's source as the write reads it: on a cluster, a snapshot put beside the target first
        (kept 30 s), since a write reaches one slot only."""
        if self._layout is None or self._cluster is None:
            return f"{self._prefix}:session:{source_id}"
        flat = await self._read(lambda: self._items(keys=self._keys(source_id), args=[source_id, self.ttl_seconds]))
        snapshot = self._layout.copy(target_id, secrets.token_hex(8))
        if flat:
            await self._read(lambda: self._cluster.fcall("stash", [snapshot], [30, *flat]))  # type: ignore[union-attr]
        return snapshot

    def _durable(self, function: _Function, keys: list[str], args: list[Any], *, payer: str = "") -> Awaitable[Any]:
        """A function that changes what a failover must not lose: waited for when wait_replicas is set.
        `payer`: whom a claim is charged to (a cluster asks it for grants)."""
        if self._cluster is not None:
            return function(keys=keys, args=args, payer=payer, durable=True)
        if self._wait_replicas:
            return self._waited(function, keys, args)
        return function(keys=keys, args=args)

    async def _waited(self, function: _Function, keys: list[str], args: list[Any]) -> Any:
        """The function and WAIT on one connection, so WAIT covers this write."""
        wanted = await self._replicas.wanted()
        for attempt in range(2):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.fcall(function.name, len(keys), *keys, *args)
                pipe.wait(wanted, self._wait_timeout_ms)
                result, acknowledged = await pipe.execute(raise_on_error=False)
            if not _missing(result):
                break
            if attempt:
                raise StoreUnavailable(NOT_LOADED)
            await self.load_functions()
        if isinstance(result, Exception):
            raise result  # FENCED, OPREUSED, ...: mapped by _call
        if isinstance(acknowledged, Exception):
            # e.g. WAIT sent to a server demoted a moment ago: a failover, retried like one.
            raise RedisConnectionError(f"redis: WAIT failed: {acknowledged}")
        await self._replicas.check(acknowledged, wanted, self._wait_timeout_ms)
        return result

    async def _online_replicas(self) -> int | None:
        return online_replicas(await self._redis.info("replication"))

    async def get(self, session_id: str, key: str) -> Any | None:
        args = [session_id, self.ttl_seconds, check_key(key)]
        raw = await self._read(lambda: self._get(keys=self._keys(session_id), args=args))
        return None if raw is None else json.loads(raw)

    async def set(
        self, session_id: str, key: str, value: Any, *, epoch: int | None = None, op: Op | None = None
    ) -> None:
        await self._write(session_id, "set", check_key(key), _json(value), epoch=epoch, op=op)

    async def incr(
        self, session_id: str, key: str, by: int = 1, *, epoch: int | None = None, op: Op | None = None
    ) -> int:
        # _write answers the JSON the function returned: here the new count.
        return cast(int, await self._write(session_id, "incr", check_key(key), by, epoch=epoch, op=op))

    async def append(
        self,
        session_id: str,
        key: str,
        value: Any,
        *,
        max_items: int | None = None,
        epoch: int | None = None,
        op: Op | None = None,
    ) -> int:
        length = await self._write(
            session_id, "append", check_key(key), _json(value), epoch=epoch, op=op, max_items=max_items
        )
        return cast(int, length)  # the list's new length

    async def delete(self, session_id: str, key: str, *, epoch: int | None = None, op: Op | None = None) -> bool:
        return cast(bool, await self._write(session_id, "delete", check_key(key), epoch=epoch, op=op))

    async def apply(
        self,
        session_id: str,
        writes: Sequence[Write],
        *,
        expect: Mapping[str, Any],
        result: Any,
        epoch: int | None = None,
        op: Op | None = None,
    ) -> Any:
        expected = [
            item
            for key, value in expect.items()
            for item in (check_key(key), _ABSENT if value is None else _json(value))
        ]
        staged = [
            item
            for operation, key, argument in writes
            for item in (operation, check_key(key), _write_argument(operation, argument))
        ]
        return await self._write(
            session_id, "apply", _json(result), len(expect), *expected, *staged, epoch=epoch, op=op
        )

    async def recall(self, session_id: str, op: Op) -> tuple[bool, Any]:
        # The buckets `_WRITE` looks in, by this machine's clock, and one more each side for its skew.
        span, base, fields = op_span(self.op_ttl_seconds), self._ops_key(session_id), op_fields(op)
        now = int(time.time()) // span
        buckets = [f"{base}:{n}" for n in range(now + 1, now - math.ceil(self.op_ttl_seconds / span) - 2, -1)]

        def read() -> Awaitable[list[Any]]:
            pipe = self._redis.pipeline(transaction=False)
            for bucket in buckets:
                pipe.hmget(bucket, fields)
            return pipe.execute()

        done = None
        for digest, result in await self._read(read):
            if digest is not None and digest != op.digest:
                raise OpReused(op.call)
            done = done if result is None else result
        return (False, None) if done is None else (True, json.loads(done))

    async def items(self, session_id: str) -> dict[str, Any]:
        flat = await self._read(lambda: self._items(keys=self._keys(session_id), args=[session_id, self.ttl_seconds]))
        return {flat[i]: json.loads(flat[i + 1]) for i in range(0, len(flat), 2) if not flat[i].startswith(".")}

    async def copy(self, source_id: str, target_id: str, *, epoch: int | None = None, op: Op | None = None) -> int:
        return cast(int, await self._write(target_id, "copy", epoch=epoch, op=op, source=source_id))  # keys copied

    async def touch(self, session_id: str) -> None:
        await self._read(lambda: self._touch(keys=self._keys(session_id), args=[session_id, self.ttl_seconds]))

    def _holder_key(self, holder: str) -> str:
        if self._layout is not None:
            return self._layout.holder(holder)
        return f"{self._prefix}:holder:{hashlib.sha256(holder.encode()).hexdigest()}"

    async def count_sessions(self, *, holder: str | None = None) -> int:
        if holder is None and self._layout is not None and self._cluster is not None:
            # The shards' sum; a session is noted at most every min(60, ttl/10) s, so it counts that long more.
            horizon = self.ttl_seconds + min(60, self.ttl_seconds // 10)
            shards = self._layout.shards()
            return await self._read(lambda: self._cluster.count(shards, horizon))  # type: ignore[union-attr]
        key = self._index if holder is None else self._holder_key(holder)
        return int(await self._read(lambda: self._count(keys=[key], args=[self.ttl_seconds])))

    async def open_session(self, session_id: str, record: dict[str, Any], *, holder: str | None = None) -> int:
        if self._cluster is not None:
            return await self._open_on_cluster(session_id, record, holder)
        holder_key = "" if holder is None else self._holder_key(holder)
        keys = [*self._keys(session_id), holder_key or self._keys(session_id)[0]]
        args = [
            session_id,
            self.ttl_seconds,
            self.max_sessions,
            self.max_sessions_per_holder,
            holder_key,
            "" if holder is None else payer_of(holder),
            self.max_bytes_per_holder,
            *_flat_record(record),
        ]
        # Retried safely: a retry finds the session it opened (and its holder's count unchanged).
        return int(await self._call(lambda: self._read(lambda: self._durable(self._open, keys, args))))

    async def _open_on_cluster(self, session_id: str, record: dict[str, Any], holder: str | None) -> int:
        """One Redis's `open` in three steps, each in its own slots: the live sessions counted (a bound
        that concurrent opens may pass by as many as they are), the holder's sessions admitted, then the
        session opened, its holder's place given back if that is refused."""
        assert self._cluster is not None
        cluster = self._cluster
        if await self.session_record(session_id) is None and await self.count_sessions() >= self.max_sessions:
            raise LimitExceeded(f"this server holds {self.max_sessions} sessions, the most it may")
        holder_key = self._holder_key(holder) if holder is not None else ""
        admit = [session_id, self.max_sessions_per_holder, self.ttl_seconds]
        if holder_key:
            await self._call(lambda: self._read(lambda: cluster.fcall("admit", [holder_key], admit)))
        args = [session_id, self.ttl_seconds, self.max_sessions, self.max_sessions_per_holder, holder_key]
        args += ["" if holder is None else payer_of(holder), self.max_bytes_per_holder, *_flat_record(record)]
        keys = self._keys(session_id) + self._keys(session_id)[:1]
        try:
            return int(await self._call(lambda: self._read(lambda: self._durable(self._open, keys, args))))
        except BaseException:
            if holder_key:
                with contextlib.suppress(Exception):
                    await cluster.fcall("leave", [holder_key], [session_id])
            raise

    async def session_record(self, session_id: str) -> dict[str, Any] | None:
        flat = await self._read(lambda: self._read_record(keys=self._keys(session_id)[:1]))
        return None if flat is None else _record_of(flat)

    async def update_record(self, session_id: str, entries: dict[str, Any]) -> bool:
        flat = _flat_record({name: value for name, value in entries.items() if name != OWNER})
        if not flat:
            return await self.session_record(session_id) is not None
        keys = self._keys(session_id)[:1]
        return bool(await self._read(lambda: self._durable(self._update_record, keys, flat)))

    async def adopt_session(self, session_id: str) -> tuple[dict[str, Any], int] | None:
        # Not retried: each call advances the epoch.
        args = [session_id, self.ttl_seconds]
        found = await self._call(lambda: self._durable(self._adopt, self._keys(session_id), args))
        return None if found is None else (_record_of(found[1]), int(found[0]))

    async def end_session(self, session_id: str, *, holder: str | None = None) -> bool:
        events = self._events_key(session_id)
        dropped = [events, f"{events}:bytes", self._ops_key(session_id)]
        args = [session_id if holder is not None else "", self.op_ttl_seconds]
        if self._cluster is not None:
            cluster, keys = self._cluster, self._keys(session_id) * 2
            ended = await self._read(lambda: self._end(keys=[*keys[:3], *dropped], args=args))
            if holder is not None:
                holder_key = self._holder_key(holder)
                await self._read(lambda: cluster.fcall("leave", [holder_key], [session_id]))
            return bool(ended)
        keys = [
            self._keys(session_id)[0],
            self._holder_key(holder) if holder is not None else self._index,
            self._index,
            *dropped,
        ]
        # Without a holder, ZREM from the index: the session's state (and its place there) lives on.
        return bool(await self._read(lambda: self._end(keys=keys, args=args)))

    async def owner(self, session_id: str) -> str | None:
        key = self._keys(session_id)[0]
        raw = await self._read(lambda: self._redis.hget(key, ".owner"))
        return None if raw is None else json.loads(raw)

    def _events_key(self, session_id: str) -> str:
        if self._layout is not None:
            return self._layout.events(session_id)
        return f"{self._prefix}:events:{session_id}"

    async def add_event(self, session_id: str, stream_id: str, message: str | None) -> str:
        args = [
            self.max_events,
            self.event_ttl_seconds,
            stream_id,
            message or "",
            self.max_log_bytes,
            session_id,
            self.max_bytes_per_holder,
        ]
        keys = [
            self._events_key(session_id),
            f"{self._events_key(session_id)}:bytes",
            # On a cluster a key of the session's stands in for the channel (the function names it).
            self._events if self._cluster is None else self._keys(session_id)[0],
            *self._keys(session_id),  # its payer, and the prefix to name its usage keys by
        ]
        # Once, never retried: a retry after a lost reply would log the event
        # twice, and a resumed stream would deliver it twice.
        position = await self._call(lambda: self._add_event(keys=keys, args=args))
        return mint_event_id(session_id, position)

    async def events_after(self, session_id: str, event_id: str) -> tuple[str, list[tuple[str, str | None]]] | None:
        position = event_position(session_id, event_id)
        if position is None:
            return None  # malformed or another session's: nothing to ask Redis
        found = await self._read(lambda: self._events_after(keys=[self._events_key(session_id)], args=[position]))
        if found is None:
            return None
        stream_id, events = found
        return stream_id, [(mint_event_id(session_id, entry), message) for entry, message in events]

    async def stream_since(
        self, session_id: str, stream_id: str, event_id: str
    ) -> tuple[str, list[tuple[str, str | None]]] | None:
        position = event_position(session_id, event_id)
        if position is None:
            return None
        keys, args = [self._events_key(session_id)], [position, stream_id]
        found = await self._read(lambda: self._stream_since(keys=keys, args=args))
        if found is None:
            return None
        latest, events = found
        return mint_event_id(session_id, latest), [(mint_event_id(session_id, at), message) for at, message in events]

    def _claim_key(self, name: str) -> str:
        if self._layout is not None:
            return self._layout.claim(name)
        return f"{self._prefix}:claim:{hashlib.sha256(name.encode()).hexdigest()}"

    async def claim(
        self, name: str, claimant: str, ttl_seconds: int, *, holder: str | None = None, charge: int = 0
    ) -> bool:
        key = self._claim_key(name)
        payer = "" if holder is None else payer_of(holder)
        # On a cluster a claim is charged in a ledger of its own beside it, within its payer's grant.
        ledger = f"{key}:usage" if self._cluster is not None else f"{self._prefix}:usage:{payer}"
        keys = [key, key if holder is None else ledger]
        args = [claimant, ttl_seconds, self.max_bytes_per_holder, "" if holder is None else "1", charge]
        # Replayed safely: a retry by the same claimant finds its own claim.
        held = await self._call(lambda: self._read(lambda: self._durable(self._claim, keys, args, payer=payer)))
        return bool(held == claimant)

    async def release(self, name: str) -> None:
        key = self._claim_key(name)
        await self._read(lambda: self._durable(self._release, [key], []))

    async def claimed(self, name: str) -> str | None:
        key = self._claim_key(name)
        held = await self._read(lambda: self._redis.hget(key, "holder"))
        return None if held is None else held.decode() if isinstance(held, bytes) else str(held)

    async def publish(self, message: str) -> None:
        if self._cluster is not None:
            # Any channel of the feed reaches every watch: slot 0's (the slot of an empty name), without
            # naming all 16384 on every publish.
            channel = self._cluster.layout.feed("changes", "")
            await self._call(lambda: self._cluster.spublish(channel, message))  # type: ignore[union-attr]
            return
        await self._call(lambda: self._redis.publish(self._changes, message))

    @asynccontextmanager
    async def watch(self, *, events: bool = False) -> AsyncIterator[AsyncIterator[str]]:
        if self._cluster is not None:
            async with self._watch_cluster("events" if events else "changes") as messages:
                yield messages
            return
        # A connection of its own for as long as the watch lasts (pub/sub holds it).
        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        heard = [time.monotonic()]

        async def keep_alive() -> None:
            # A quiet channel is pinged (its PONG counts as heard), so a primary that vanished without
            # closing the connection (its host gone) is noticed within WATCH_SILENCE_SECONDS, not never.
            # The read itself blocks with no timeout: redis-py can swallow a cancellation that lands
            # in a read with one, and the watch could then never be stopped.
            while True:
                await asyncio.sleep(WATCH_PING_SECONDS)
                if time.monotonic() - heard[0] > WATCH_SILENCE_SECONDS and pubsub.connection is not None:
                    await pubsub.connection.disconnect()  # the blocked read fails: the feed is lost
                    return
                with contextlib.suppress(*RETRYABLE):
                    await pubsub.ping()

        pinger: asyncio.Task[None] | None = None
        try:
            try:
                await pubsub.subscribe(self._events if events else self._changes)
            except RETRYABLE as exc:
                raise StoreUnavailable(f"redis: {exc}") from exc
            pinger = asyncio.get_running_loop().create_task(keep_alive())
            yield self._messages(pubsub, heard)
        finally:
            if pinger is not None:
                pinger.cancel()
            with contextlib.suppress(*RETRYABLE):
                await pubsub.aclose()  # type: ignore[no-untyped-call]  # redis-py's PubSub.aclose is unannotated

    @asynccontextmanager
    async def _watch_cluster(self, base: str) -> AsyncIterator[AsyncIterator[str]]:
        assert self._cluster is not None
        feed = FeedWatch(self._cluster, base, ping_seconds=WATCH_PING_SECONDS, silence_seconds=WATCH_SILENCE_SECONDS)
        try:
            try:
                await feed.start()
            except (*RETRYABLE, FeedLost) as exc:
                raise StoreUnavailable(f"redis: {exc}") from exc
            yield self._feed_messages(feed)
        finally:
            await feed.aclose()

    @staticmethod
    async def _feed_messages(feed: FeedWatch) -> AsyncIterator[str]:
        try:
            async for message in feed.messages():
                yield message
        except FeedLost as exc:
            raise StoreUnavailable(f"redis: feed lost: {exc}") from exc

    @staticmethod
    async def _messages(pubsub: PubSub, heard: list[float]) -> AsyncIterator[str]:
        try:
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
                heard[0] = time.monotonic()
                if message is not None and message["type"] == "message":
                    yield message["data"]
        except RETRYABLE as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc

    async def ping(self) -> bool:
        try:
            # On a cluster every primary: one that does not answer leaves sessions unserved.
            await (self._cluster.ping() if self._cluster is not None else self._redis.ping())
        except (*RETRYABLE, OSError):
            await self._mark_outage()
            return False
        # An outage can end with no call to notice: the next one gets the whole window again.
        self._failing_since = None
        return True

    async def memory(self) -> tuple[int, int] | None:
        try:
            if self._cluster is not None:
                return await self._cluster.memory()
            info = await self._redis.info("memory")
        except (*RETRYABLE, ResponseError):  # unreachable, or a user without +info
            return None
        return int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))

    async def aclose(self) -> None:
        await self._redis.aclose()
        if self._sentinel is not None:
            await self._sentinel.aclose()


if __name__ == "__main__":
    import sys

    if sys.argv[1:] not in (["--functions"], ["--functions", "--cluster"]):
        sys.exit(
            "usage: python -m mcp_ha.stores.redis_store --functions [--cluster]   (prints the library for "
            "FUNCTION LOAD REPLACE; with --cluster, the one each primary of a Redis Cluster loads)"
        )
    sys.stdout.write(functions_library(cluster="--cluster" in sys.argv))
