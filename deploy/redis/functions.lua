#!lua name=mcp_ha_6f569ec3995f
redis.register_function{function_name='mcp_ha_6f569ec3995f_get', callback=function(KEYS, ARGV)

local function touch()
  local now = redis.call('TIME')[1]
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  redis.call('ZADD', KEYS[2], now, ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
end

touch()
return redis.call('HGET', KEYS[1], ARGV[3])

end, flags={'allow-oom'}}
redis.register_function{function_name='mcp_ha_6f569ec3995f_items', callback=function(KEYS, ARGV)

local function touch()
  local now = redis.call('TIME')[1]
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  redis.call('ZADD', KEYS[2], now, ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
end

touch()
return redis.call('HGETALL', KEYS[1])

end, flags={'allow-oom'}}
redis.register_function{function_name='mcp_ha_6f569ec3995f_touch', callback=function(KEYS, ARGV)

local function touch()
  local now = redis.call('TIME')[1]
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  redis.call('ZADD', KEYS[2], now, ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
end

touch()

end, flags={'allow-oom'}}
redis.register_function{function_name='mcp_ha_6f569ec3995f_write', callback=function(KEYS, ARGV)

local function touch()
  local now = redis.call('TIME')[1]
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  redis.call('ZADD', KEYS[2], now, ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
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

local staged, staged_order = nil, {}
local max_bytes, max_items = tonumber(ARGV[8]), tonumber(ARGV[9])
local function value(field)
  if staged and staged[field] ~= nil then return staged[field] end
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
-- Changes an entry (text false: removes it), and its list length (count nil: unknown).
local function put(field, text, count)
  if staged then
    for _, name in ipairs({field, '..#' .. field}) do
      if staged[name] == nil then staged_order[#staged_order + 1] = name end
    end
    staged[field] = text
    staged['..#' .. field] = count and tostring(count) or false
    return nil
  end
  local new_size = state_size() - redis.call('HSTRLEN', KEYS[1], field) + (text and #text or 0)
  if max_bytes and new_size > max_bytes and new_size > state_size() then return too_large(new_size) end
  set_field(field, text)
  set_field('..#' .. field, count and tostring(count) or false)
  record_size(new_size)
  return nil
end
-- Each answers its result as JSON text, or nil and the error.
local write = {}
function write.set(field, text)
  local refused = put(field, text)
  if refused then return nil, refused end
  return 'null'
end
function write.delete(field)
  local existed = value(field) and 'true' or 'false'
  local refused = put(field, false)
  if refused then return nil, refused end
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
  local refused = put(field, text)
  if refused then return nil, refused end
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
  local refused = put(field, updated, #updated > 1024 and count or nil)
  if refused then return nil, refused end
  return tostring(count)
end

if ARGV[5] ~= '' then
  local recorded = redis.call('HGET', KEYS[3], '.digest')
  if recorded and recorded ~= ARGV[5] then
    return redis.error_reply('OPREUSED the idempotency key belongs to another call')
  end
  local done = redis.call('HGET', KEYS[3], ARGV[6])
  if done then
    -- A write of its own, so a WAIT after this replay covers the write it
    -- replays, which may have been made on another connection.
    touch()
    return {done, 1}
  end
end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[1], '.epoch') ~= ARGV[3] then
  return redis.error_reply('FENCED the session has a newer owner')
end
local op, result, failed = ARGV[7], nil, nil
if write[op] then
  result, failed = write[op](ARGV[10], ARGV[11])
  if failed then return failed end
elseif op == 'apply' then
  local expected = tonumber(ARGV[11])
  for i = 12, 11 + 2 * expected, 2 do
    local wanted, current = ARGV[i + 1], redis.call('HGET', KEYS[1], ARGV[i])
    local unchanged
    if wanted == '' then unchanged = not current or current == 'null' else unchanged = current == wanted end
    if not unchanged then return redis.error_reply('CONFLICT an entry changed since it was read') end
  end
  staged = {}
  for i = 12 + 2 * expected, #ARGV, 3 do
    if not write[ARGV[i]] then return redis.error_reply('ERR unknown write ' .. ARGV[i]) end
    local _, refused = write[ARGV[i]](ARGV[i + 1], ARGV[i + 2])
    if refused then return refused end
  end
  local new_size = state_size()
  for _, field in ipairs(staged_order) do
    if string.sub(field, 1, 2) ~= '..' then
      new_size = new_size - redis.call('HSTRLEN', KEYS[1], field) + (staged[field] and #staged[field] or 0)
    end
  end
  if max_bytes and new_size > max_bytes and new_size > state_size() then return too_large(new_size) end
  for _, field in ipairs(staged_order) do set_field(field, staged[field]) end
  record_size(new_size)
  result = ARGV[10]
elseif op == 'copy' then
  -- State only (the source's record stays its own), in chunks, so unpack()
  -- stays far below Lua's stack limit.
  -- Lists' lengths go along ('..#' fields), and a target's stale ones go.
  local flat, state, new_size, entries = redis.call('HGETALL', KEYS[4]), {}, state_size(), 0
  for i = 1, #flat, 2 do
    local name = flat[i]
    if string.sub(name, 1, 1) ~= '.' or string.sub(name, 1, 3) == '..#' then
      state[#state + 1] = name
      state[#state + 1] = flat[i + 1]
    end
    if string.sub(name, 1, 1) ~= '.' then
      entries = entries + 1
      new_size = new_size - redis.call('HSTRLEN', KEYS[1], name) + #flat[i + 1]
      redis.call('HDEL', KEYS[1], '..#' .. name)
    end
  end
  if max_bytes and new_size > max_bytes and new_size > state_size() then return too_large(new_size) end
  for i = 1, #state, 200 do
    redis.call('HSET', KEYS[1], unpack(state, i, math.min(i + 199, #state)))
  end
  record_size(new_size)
  result = tostring(entries)
else
  return redis.error_reply('ERR unknown operation ' .. op)
end
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[3], '.digest', ARGV[5], ARGV[6], result)
  redis.call('EXPIRE', KEYS[3], ARGV[4])
end
touch()
redis.call('PUBLISH', KEYS[5], ARGV[1])
return {result, 0}

end}
redis.register_function{function_name='mcp_ha_6f569ec3995f_count', callback=function(KEYS, ARGV)

local horizon = tonumber(redis.call('TIME')[1]) - tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', horizon)
return redis.call('ZCARD', KEYS[1])

end, flags={'allow-oom'}}
redis.register_function{function_name='mcp_ha_6f569ec3995f_claim', callback=function(KEYS, ARGV)

local held = redis.call('HGET', KEYS[1], 'holder')
if held and held ~= ARGV[1] then return held end
redis.call('HSET', KEYS[1], 'holder', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return ARGV[1]

end}
redis.register_function{function_name='mcp_ha_6f569ec3995f_open', callback=function(KEYS, ARGV)

local function touch()
  local now = redis.call('TIME')[1]
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  redis.call('ZADD', KEYS[2], now, ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
end

local now = tonumber(redis.call('TIME')[1])
local horizon = now - tonumber(ARGV[2])
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', horizon)
  if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[3]) then
    return redis.error_reply('LIMIT this server holds ' .. ARGV[3] .. ' sessions, the most it may')
  end
end
if ARGV[5] ~= '' then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', horizon)
  if redis.call('ZSCORE', KEYS[3], ARGV[1]) == false and redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[4]) then
    return redis.error_reply('LIMIT you hold ' .. ARGV[4] .. ' open sessions, the most you may; end some first')
  end
  redis.call('ZADD', KEYS[3], now, ARGV[1])
  redis.call('EXPIRE', KEYS[3], ARGV[2])
end
redis.call('HSET', KEYS[1], '.epoch', 1, unpack(ARGV, 6))
touch()
return 1

end}
redis.register_function{function_name='mcp_ha_6f569ec3995f_read_record', callback=function(KEYS, ARGV)

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
redis.register_function{function_name='mcp_ha_6f569ec3995f_update_record', callback=function(KEYS, ARGV)

if redis.call('HEXISTS', KEYS[1], '.epoch') == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1

end}
redis.register_function{function_name='mcp_ha_6f569ec3995f_adopt', callback=function(KEYS, ARGV)

local function touch()
  local now = redis.call('TIME')[1]
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  redis.call('ZADD', KEYS[2], now, ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
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
redis.register_function{function_name='mcp_ha_6f569ec3995f_end', callback=function(KEYS, ARGV)

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

redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('HEXISTS', KEYS[1], '.epoch') == 0 then return 0 end
local names = {'.epoch'}
for _, name in ipairs(record_fields()) do
  if name ~= '.owner' then names[#names + 1] = name end
end
redis.call('HDEL', KEYS[1], unpack(names))
return 1

end, flags={'allow-oom'}}
redis.register_function{function_name='mcp_ha_6f569ec3995f_add_event', callback=function(KEYS, ARGV)

local t = redis.call('TIME')
local ms, n = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), 0
local last = redis.call('LINDEX', KEYS[1], -1)
if last then
  local last_ms, last_n = string.match(last, '^(%d+)-(%d+) ')
  if tonumber(last_ms) >= ms then ms, n = tonumber(last_ms), tonumber(last_n) + 1 end
end
local position = string.format('%.0f-%.0f', ms, n)
local entry = position .. ' ' .. #ARGV[3] .. ' ' .. ARGV[3] .. ARGV[4]
local length = redis.call('RPUSH', KEYS[1], entry)
local size = last and tonumber(redis.call('GET', KEYS[2]) or '0') or 0
size = size + #entry
while length > 1 and (length > tonumber(ARGV[1]) or size > tonumber(ARGV[5])) do
  size = size - #redis.call('LPOP', KEYS[1])
  length = length - 1
end
redis.call('SET', KEYS[2], size, 'EX', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('PUBLISH', KEYS[3], ARGV[6])
return position

end}
redis.register_function{function_name='mcp_ha_6f569ec3995f_events_after', callback=function(KEYS, ARGV)

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
