"""The Lua scripts of the batch store: each runs whole on the Redis server, so the checks and
writes in it are one atomic step whichever gateways call it at once."""

# The Redis server's own clock in ms: every gateway reads the same one, so leases never
# depend on the gateways' clocks agreeing.
NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: batch, todo, leased, owner, res, req. ARGV: gateway, lease_ms, how many.
# Takes expired leases first (a dead gateway's lines), then lines never claimed, in run
# order; returns index, request, index, request, ...
CLAIM = NOW + """
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' then return {} end
local expires = tonumber(redis.call('HGET', KEYS[1], 'expires_at') or '0')
if expires > 0 and now >= expires * 1000 then return {} end
local room = tonumber(ARGV[3])
local out = {}
local function take(idx)
  if redis.call('HEXISTS', KEYS[5], idx) == 1 then
    redis.call('ZREM', KEYS[3], idx)
    redis.call('HDEL', KEYS[4], idx)
    return
  end
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[2]), idx)
  redis.call('HSET', KEYS[4], idx, ARGV[1])
  table.insert(out, idx)
  table.insert(out, redis.call('HGET', KEYS[6], idx))
  room = room - 1
end
for _, idx in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, room)) do
  take(idx)
end
while room > 0 do
  local idx = redis.call('LPOP', KEYS[2])
  if not idx then break end
  take(idx)
end
return out
"""

# KEYS: leased, owner. ARGV: gateway, lease_ms, index... Returns the indices no longer ours.
RENEW = NOW + """
local lost = {}
for i = 3, #ARGV do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[1] then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[i])
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""

# KEYS: batch, res, leased, owner. ARGV: gateway, index, line, ok, prompt, cached, completion
# tokens. The first result of a line is kept, any later one dropped: one line per custom_id.
COMPLETE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'completed' or status == 'expired' or status == 'cancelled'
   or status == 'failed' then return 0 end
local written = redis.call('HSETNX', KEYS[2], ARGV[2], ARGV[3])
if written == 1 or redis.call('HGET', KEYS[4], ARGV[2]) == ARGV[1] then
  redis.call('ZREM', KEYS[3], ARGV[2])
  redis.call('HDEL', KEYS[4], ARGV[2])
end
if written == 0 then return 0 end
if ARGV[4] == '1' then
  redis.call('HINCRBY', KEYS[1], 'completed', 1)
  redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[5])
  redis.call('HINCRBY', KEYS[1], 'cached_tokens', ARGV[6])
  redis.call('HINCRBY', KEYS[1], 'completion_tokens', ARGV[7])
else
  redis.call('HINCRBY', KEYS[1], 'failed', 1)
end
return 1
"""

# KEYS: todo, leased, owner. ARGV: gateway, index... Lines this gateway gives back unrun.
RELEASE = """
for i = 2, #ARGV do
  if redis.call('HGET', KEYS[3], ARGV[i]) == ARGV[1] then
    redis.call('ZREM', KEYS[2], ARGV[i])
    redis.call('HDEL', KEYS[3], ARGV[i])
    redis.call('LPUSH', KEYS[1], ARGV[i])
  end
end
return 1
"""

# KEYS: leased. Leases not yet lapsed.
LIVE = NOW + "return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')"

# KEYS: batch. ARGV: allowed statuses (comma-separated), then field, value, ...
TRANSITION = """
local status = redis.call('HGET', KEYS[1], 'status')
for s in string.gmatch(ARGV[1], '[^,]+') do
  if s == status then
    for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
    return 1
  end
end
return 0
"""

# KEYS: batch, res. ARGV: index, line, index, line, ... The error lines of lines that never
# ran (the batch expired or was cancelled), each written only if the line has no result.
FILL = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'finalizing' and status ~= 'cancelling' then return 0 end
local n = 0
for i = 1, #ARGV, 2 do
  n = n + redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1])
end
if n > 0 then redis.call('HINCRBY', KEYS[1], 'failed', n) end
return n
"""

# KEYS: lock. ARGV: gateway.
UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
