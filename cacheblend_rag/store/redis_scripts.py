"""The Lua scripts of the Redis tier: each reads or changes an entry and its byte bookkeeping atomically."""

# Why the byte accounting lives in Redis and not in `maxmemory`: the server's own LRU is instance-wide (it would
# evict other applications' keys and count Redis' overheads), approximate, and configured by whoever runs the
# server. Instead four bookkeeping keys sit beside the entries, and Lua scripts update them atomically with the
# entries, so processes sharing a namespace agree on one budget (per shard, whose tag is written <tag> here):
#   <tag>:lru    sorted set, chunk key -> logical time of its last get/put (a shared counter, so no clock skew
#               between machines matters)
#   <tag>:sizes  hash, chunk key -> bytes of its value
#   <tag>:bytes  total bytes of the values
#   <tag>:clock  the logical clock
# These names cannot collide with chunk keys, which are sha256 hex digests. The scripts touch entry keys they
# were not passed (the eviction victims). Redis Cluster allows that only within the slot of the keys passed, so
# every key of one shard starts with the same hash tag `{...}` (see `RedisStore`): a shard lives in one slot.

# The value vanished behind our back (server-side maxmemory, a manual DEL): forget its bookkeeping too.
# Shared tail of the read scripts. KEYS: value, lru, sizes, bytes. ARGV[1]: chunk key.
_FORGET = """
local size = redis.call('HGET', KEYS[3], ARGV[1])
if size then
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('DECRBY', KEYS[4], size)
end
"""
FORGET_VANISHED = _FORGET + "return false\n"

# A read moves the entry to the most recently used end. That is a write, which a Redis at `maxmemory` under
# `noeviction` refuses (OOM): `pcall` lets the read answer anyway, leaving the entry's LRU place as it was.
_TOUCH = """
  local clock = redis.pcall('INCR', KEYS[5])
  if type(clock) == 'number' then
    redis.pcall('ZADD', KEYS[2], 'XX', clock, ARGV[1])
  end
"""

# KEYS: value, lru, sizes, bytes, clock. ARGV: chunk key.
GET = (
    """
local v = redis.call('GET', KEYS[1])
if v then
"""
    + _TOUCH
    + """  return v
end
"""
    + FORGET_VANISHED
)

# KEYS: value, lru, sizes, bytes, clock. ARGV: chunk key, bytes wanted. -> {total length, the first bytes}, or false.
OPEN = (
    """
local n = redis.call('STRLEN', KEYS[1])
if n > 0 then
"""
    + _TOUCH
    + """  return {n, redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[2]) - 1)}
end
"""
    + FORGET_VANISHED
)

# KEYS: value, lru, sizes, bytes, clock. ARGV: data, chunk key, budget, namespace prefix. Returns evictions.
PUT = """
local new = string.len(ARGV[1])
local old = tonumber(redis.call('HGET', KEYS[3], ARGV[2]) or '0')
redis.call('SET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[2], new)
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[5]), ARGV[2])
local total = redis.call('INCRBY', KEYS[4], new - old)
local budget = tonumber(ARGV[3])
local evicted = 0
while total > budget do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if (not oldest) or oldest == ARGV[2] then break end
  local size = tonumber(redis.call('HGET', KEYS[3], oldest) or '0')
  redis.call('DEL', ARGV[4] .. oldest)
  redis.call('HDEL', KEYS[3], oldest)
  redis.call('ZREM', KEYS[2], oldest)
  total = redis.call('DECRBY', KEYS[4], size)
  evicted = evicted + 1
end
return evicted
"""

# KEYS: value, lru, sizes, bytes. ARGV: chunk key.
DISCARD = "redis.call('DEL', KEYS[1])\n" + _FORGET + "return 0\n"

# KEYS: lru, sizes, bytes, clock. ARGV: the value key prefix. Deletes every entry the bookkeeping lists, then it.
CLEAR = """
local names = redis.call('HKEYS', KEYS[2])
for _, name in ipairs(names) do
  redis.call('DEL', ARGV[1] .. name)
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
return #names
"""
