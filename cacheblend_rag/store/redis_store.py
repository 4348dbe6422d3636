"""Shared chunk store on Redis: every worker process (or machine) pointed at one Redis reuses the others' chunks.

Entries are the bytes of `serialize_chunk` under `{namespace}:{chunk key}`, bounded by a byte budget with least
recently used eviction that this module keeps itself (see `RedisStore`). Redis is a cache here, never a
dependency of correctness: when it is unreachable, every call returns at once as a miss (or a dropped put) and the
outage is logged once, so the engine keeps serving from its local tiers and recomputes what they lack.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError
from .chunk_kv import ChunkKV
from .lazy import LazyChunkKV
from .serialize import CorruptEntryError, deserialize_chunk, header_length, parse_layout, serialize_chunk
from .stats import TierStats

logger = logging.getLogger(__name__)

# How much of an entry `open` fetches with its first call: enough for the header of any model we support.
_HEAD_BYTES = 64 * 1024

# Why the byte accounting lives in Redis and not in `maxmemory`: the server's own LRU is instance-wide (it would
# evict other applications' keys and count Redis' overheads), approximate, and configured by whoever runs the
# server. Instead four bookkeeping keys sit beside the entries, and Lua scripts update them atomically with the
# entries, so processes sharing the namespace agree on one budget:
#   {ns}:lru    sorted set, chunk key -> logical time of its last get/put (a shared counter, so no clock skew
#               between machines matters)
#   {ns}:sizes  hash, chunk key -> bytes of its value
#   {ns}:bytes  total bytes of the values
#   {ns}:clock  the logical clock
# These names cannot collide with chunk keys, which are sha256 hex digests. The scripts touch entry keys they
# were not passed (the eviction victims), which a single Redis allows; Redis Cluster would need the namespace
# as a hash tag.

# The value vanished behind our back (server-side maxmemory, a manual DEL): forget its bookkeeping too.
# Shared tail of the read scripts. KEYS: value, lru, sizes, bytes. ARGV[1]: chunk key.
_FORGET_VANISHED = """
local size = redis.call('HGET', KEYS[3], ARGV[1])
if size then
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('DECRBY', KEYS[4], size)
end
return false
"""

# KEYS: value, lru, sizes, bytes, clock. ARGV: chunk key.
_GET = (
    """
local v = redis.call('GET', KEYS[1])
if v then
  redis.call('ZADD', KEYS[2], 'XX', redis.call('INCR', KEYS[5]), ARGV[1])
  return v
end
"""
    + _FORGET_VANISHED
)

# KEYS: value, lru, sizes, bytes, clock. ARGV: chunk key, bytes wanted. -> {total length, the first bytes}, or false.
_OPEN = (
    """
local n = redis.call('STRLEN', KEYS[1])
if n > 0 then
  redis.call('ZADD', KEYS[2], 'XX', redis.call('INCR', KEYS[5]), ARGV[1])
  return {n, redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[2]) - 1)}
end
"""
    + _FORGET_VANISHED
)

# KEYS: value, lru, sizes, bytes, clock. ARGV: data, chunk key, budget, namespace prefix. Returns evictions.
_PUT = """
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
_DISCARD = """
redis.call('DEL', KEYS[1])
local size = redis.call('HGET', KEYS[3], ARGV[1])
if size then
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('DECRBY', KEYS[4], size)
end
return 0
"""


def _import_redis() -> Any:
    try:
        import redis
    except ImportError as exc:
        raise ImportError("the Redis tier needs redis-py; install it with `pip install 'redis>=5.0'`") from exc
    return redis


class RedisStore:
    """Chunk KV in a Redis server, at most `budget_bytes` of values under `namespace`, least recently used out.

    All processes using one namespace share entries and one budget (the last `put` enforces its own
    `budget_bytes`, so give them the same). Unreachable Redis: each call is a miss or a dropped put, the outage
    is logged once, and the server is not asked again for `backoff_s` seconds, so requests do not queue on
    timeouts. A corrupt entry is deleted, logged and counted as a miss. Safe to share between threads.
    """

    name = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        budget_bytes: int = 8 * 1024**3,
        namespace: str = "cacheblend-rag",
        *,
        backoff_s: float = 5.0,
        connect_timeout_s: float = 0.5,
        read_timeout_s: float = 2.0,
    ) -> None:
        if budget_bytes < 0:
            raise ConfigError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if not namespace:
            raise ConfigError("namespace must be a non-empty string, got ''")
        if backoff_s < 0:
            raise ConfigError(f"backoff_s must be >= 0, got {backoff_s}")
        redis = _import_redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.budget_bytes = budget_bytes
        self.namespace = namespace
        self.backoff_s = backoff_s
        self.stats = TierStats()
        # No retries: redis-py's default retries with back-off would turn one outage into seconds per call.
        # The client connects lazily, so a server that is down at start-up is just an outage on the first call.
        self._client = redis.Redis.from_url(
            url,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=read_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        kw = self._client.connection_pool.connection_kwargs
        # For log lines: where, without any password the URL may carry.
        self.where = kw.get("path") or f"{kw.get('host')}:{kw.get('port')}/{kw.get('db', 0)}"
        self._outage_errors: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError)
        self._redis_error: type[BaseException] = redis.RedisError
        self._get_script = self._client.register_script(_GET)
        self._put_script = self._client.register_script(_PUT)
        self._discard_script = self._client.register_script(_DISCARD)
        self._open_script = self._client.register_script(_OPEN)
        self._lru, self._sizes = f"{namespace}:lru", f"{namespace}:sizes"
        self._bytes, self._clock = f"{namespace}:bytes", f"{namespace}:clock"
        self._lock = threading.Lock()
        self._down_until = 0.0  # time.monotonic() before which the server is not asked again
        self._in_outage = False

    @property
    def available(self) -> bool:
        """False while backing off after a failed call; the next call after the back-off tries again."""
        return time.monotonic() >= self._down_until

    @property
    def nbytes(self) -> int:
        """Bytes of the values in this namespace (Redis' own per-key overhead is not counted)."""
        return int(self._call("nbytes", lambda: self._client.get(self._bytes), None) or 0)

    def _value_key(self, key: str) -> str:
        return f"{self.namespace}:{key}"

    def _call(self, op: str, fn: Any, default: Any) -> Any:
        """Run one Redis operation; on failure log (once per outage), count, back off and return `default`."""
        if not self.available:
            return default
        try:
            result = fn()
        except self._outage_errors as exc:
            with self._lock:
                self.stats.errors += 1
                self._down_until = time.monotonic() + self.backoff_s
                first = not self._in_outage
                self._in_outage = True
            if first:
                logger.warning(
                    "Redis tier at %s is unreachable (%s: %s); serving from the other tiers, retrying every %.1f s",
                    self.where,
                    type(exc).__name__,
                    exc,
                    self.backoff_s,
                )
            return default
        except self._redis_error as exc:
            # The server answered with an error (out of memory, a wrong key type, ...): this call fails, the tier stays.
            with self._lock:
                self.stats.errors += 1
            logger.warning("Redis tier at %s: %s failed: %s", self.where, op, exc)
            return default
        if self._in_outage:
            with self._lock:
                recovered, self._in_outage = self._in_outage, False
            if recovered:
                logger.warning("Redis tier at %s is reachable again", self.where)
        return result

    def _keys(self, key: str) -> list[str]:
        return [self._value_key(key), self._lru, self._sizes, self._bytes, self._clock]

    def get(self, key: str) -> ChunkKV | None:
        data = self._call("get", lambda: self._get_script(keys=self._keys(key), args=[key]), None)
        if data is None:
            with self._lock:
                self.stats.misses += 1
            return None
        try:
            kv = deserialize_chunk(data, key)
        except CorruptEntryError as exc:
            self._drop_corrupt(key, exc)
            return None
        with self._lock:
            self.stats.hits += 1
            self.stats.bytes_read += len(data)
        return kv

    def open(self, key: str) -> LazyChunkKV | None:
        """Like `get`, but fetch only the header now and each layer (two GETRANGEs) when it is asked for.

        The entry can be evicted or replaced while its layers are read; a layer that then comes back short or
        different fails its check, and the engine recomputes the chunk.
        """
        found = self._call("open", lambda: self._open_script(keys=self._keys(key), args=[key, _HEAD_BYTES]), None)
        if not found:
            with self._lock:
                self.stats.misses += 1
            return None
        total, head = int(found[0]), bytes(found[1])
        value_key = self._value_key(key)
        try:
            need = header_length(head, key)
            if need > len(head):
                start = len(head)
                more = self._call("open", lambda: self._client.getrange(value_key, start, need - 1), None)
                if more is None:
                    return None  # the failure is logged and counted by _call
                head += more
            layout = parse_layout(head, key, total)
        except CorruptEntryError as exc:
            self._drop_corrupt(key, exc)
            return None

        def read_ranges(ranges: Sequence[tuple[int, int]]) -> list[bytes]:
            pipe = self._client.pipeline(transaction=False)
            for start, end in ranges:
                pipe.getrange(value_key, start, end - 1)
            return pipe.execute()

        with self._lock:
            self.stats.hits += 1
            self.stats.bytes_read += total
        return LazyChunkKV(layout, read_ranges, on_corrupt=lambda exc: self._drop_corrupt(key, exc))

    def _drop_corrupt(self, key: str, exc: CorruptEntryError) -> None:
        logger.warning(
            "Redis tier at %s: dropping a corrupt or unreadable entry (%s); it will be recomputed", self.where, exc
        )
        with self._lock:
            self.stats.corrupt += 1
            self.stats.misses += 1
        self.discard(key)

    def put(self, kv: ChunkKV) -> None:
        if not self.available:
            return  # skip serializing for a server we are not going to ask
        data = serialize_chunk(kv)
        if len(data) > self.budget_bytes:
            # Storing it would evict everything else and then itself; drop any older copy instead.
            self.discard(kv.key)
            return
        args = [data, kv.key, self.budget_bytes, f"{self.namespace}:"]
        evicted = self._call("put", lambda: self._put_script(keys=self._keys(kv.key), args=args), None)
        if evicted is not None:
            with self._lock:
                self.stats.puts += 1
                self.stats.evictions += int(evicted)

    def discard(self, key: str) -> None:
        self._call("discard", lambda: self._discard_script(keys=self._keys(key)[:4], args=[key]), None)

    def clear(self) -> None:
        """Delete every entry of this namespace and its bookkeeping (not other namespaces)."""

        def clear_namespace() -> None:
            batch = []
            for k in self._client.scan_iter(match=f"{self.namespace}:*", count=1000):
                batch.append(k)
                if len(batch) >= 1000:
                    self._client.delete(*batch)
                    batch.clear()
            if batch:
                self._client.delete(*batch)

        self._call("clear", clear_namespace, None)

    def close(self) -> None:
        self._client.close()

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        return bool(self._call("contains", lambda: self._client.exists(self._value_key(key)), 0))

    def __len__(self) -> int:
        return int(self._call("len", lambda: self._client.zcard(self._lru), 0))
