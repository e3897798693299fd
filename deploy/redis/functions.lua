#!lua name=mcp_ha_41c4ef483134
redis.register_function{function_name='mcp_ha_41c4ef483134_get', callback=function(KEYS, ARGV)
local CLUSTER, HINTS, OWNER, PAYER, SLACK, LEASE, GRANT = false
local KEY_BYTES, ENTRY_BYTES, EVENT_BYTES = 384, 64, 16

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

touch()
return redis.call('HGET', KEYS[1], ARGV[3])

end, flags={'allow-oom'}}
redis.register_function{function_name='mcp_ha_41c4ef483134_items', callback=function(KEYS, ARGV)
local CLUSTER, HINTS, OWNER, PAYER, SLACK, LEASE, GRANT = false
local KEY_BYTES, ENTRY_BYTES, EVENT_BYTES = 384, 64, 16

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

touch()
return redis.call('HGETALL', KEYS[1])

end, flags={'allow-oom'}}
redis.register_function{function_name='mcp_ha_41c4ef483134_touch', callback=function(KEYS, ARGV)
local CLUSTER, HINTS, OWNER, PAYER, SLACK, LEASE, GRANT = false
local KEY_BYTES, ENTRY_BYTES, EVENT_BYTES = 384, 64, 16

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

touch()

end, flags={'allow-oom'}}
redis.register_function{function_name='mcp_ha_41c4ef483134_write', callback=function(KEYS, ARGV)
local CLUSTER, HINTS, OWNER, PAYER, SLACK, LEASE, GRANT = false
local KEY_BYTES, ENTRY_BYTES, EVENT_BYTES = 384, 64, 16

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

end}
redis.register_function{function_name='mcp_ha_41c4ef483134_count', callback=function(KEYS, ARGV)
local CLUSTER, HINTS, OWNER, PAYER, SLACK, LEASE, GRANT = false

local horizon = tonumber(redis.call('TIME')[1]) - tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', horizon)
return redis.call('ZCARD', KEYS[1])

end, flags={'allow-oom'}}
redis.register_function{function_name='mcp_ha_41c4ef483134_claim', callback=function(KEYS, ARGV)
local CLUSTER, HINTS, OWNER, PAYER, SLACK, LEASE, GRANT = false
local KEY_BYTES, ENTRY_BYTES, EVENT_BYTES = 384, 64, 16

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

end}
redis.register_function{function_name='mcp_ha_41c4ef483134_release', callback=function(KEYS, ARGV)
local CLUSTER, HINTS, OWNER, PAYER, SLACK, LEASE, GRANT = false
local KEY_BYTES, ENTRY_BYTES, EVENT_BYTES = 384, 64, 16

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

local set = redis.call('HGET', KEYS[1], 'u')
if CLUSTER then PAYER = redis.call('HGET', KEYS[1], 'p') end
redis.call('HDEL', KEYS[1], 'holder', 'u', 'p')
if set then uncharge(set, 'c' .. KEYS[1]) end

end, flags={'allow-oom'}}
redis.register_function{function_name='mcp_ha_41c4ef483134_open', callback=function(KEYS, ARGV)
local CLUSTER, HINTS, OWNER, PAYER, SLACK, LEASE, GRANT = false
local KEY_BYTES, ENTRY_BYTES, EVENT_BYTES = 384, 64, 16

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

end}
redis.register_function{function_name='mcp_ha_41c4ef483134_read_record', callback=function(KEYS, ARGV)
local CLUSTER, HINTS, OWNER, PAYER, SLACK, LEASE, GRANT = false

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

if redis.call('HEXISTS', KEYS[1], '.epoch') == 0 then return nil end
return record()

end, flags={'allow-oom'}}
redis.register_function{function_name='mcp_ha_41c4ef483134_update_record', callback=function(KEYS, ARGV)
local CLUSTER, HINTS, OWNER, PAYER, SLACK, LEASE, GRANT = false

if redis.call('HEXISTS', KEYS[1], '.epoch') == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1

end}
redis.register_function{function_name='mcp_ha_41c4ef483134_adopt', callback=function(KEYS, ARGV)
local CLUSTER, HINTS, OWNER, PAYER, SLACK, LEASE, GRANT = false
local KEY_BYTES, ENTRY_BYTES, EVENT_BYTES = 384, 64, 16

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

if redis.call('HEXISTS', KEYS[1], '.epoch') == 0 then return nil end
local epoch = redis.call('HINCRBY', KEYS[1], '.epoch', 1)
touch()
return {epoch, record()}

end}
redis.register_function{function_name='mcp_ha_41c4ef483134_end', callback=function(KEYS, ARGV)
local CLUSTER, HINTS, OWNER, PAYER, SLACK, LEASE, GRANT = false
local KEY_BYTES, ENTRY_BYTES, EVENT_BYTES = 384, 64, 16

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

end, flags={'allow-oom'}}
redis.register_function{function_name='mcp_ha_41c4ef483134_add_event', callback=function(KEYS, ARGV)
local CLUSTER, HINTS, OWNER, PAYER, SLACK, LEASE, GRANT = false
local KEY_BYTES, ENTRY_BYTES, EVENT_BYTES = 384, 64, 16

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

end}
redis.register_function{function_name='mcp_ha_41c4ef483134_events_after', callback=function(KEYS, ARGV)
local CLUSTER, HINTS, OWNER, PAYER, SLACK, LEASE, GRANT = false

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

end, flags={'allow-oom'}}
redis.register_function{function_name='mcp_ha_41c4ef483134_stream_since', callback=function(KEYS, ARGV)
local CLUSTER, HINTS, OWNER, PAYER, SLACK, LEASE, GRANT = false

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

end, flags={'allow-oom'}}
