"""Shared chunk store on Redis or Redis Cluster: every worker (process or machine) pointed at one reuses the others'
chunks.

Entries are the bytes of `serialize_chunk`, bounded by a byte budget with least recently used eviction that this
module keeps itself (the Lua scripts in `redis_scripts`). Keys are split into `shards`; every key of a shard
(entries and bookkeeping) carries the shard's hash tag, `{namespace}` or `{namespace:i/n}`, so on a cluster each
shard lives in one slot and the scripts stay atomic, while different shards spread over the masters.
Redis is a cache here, never a dependency of correctness: when it is unreachable, every call returns at once as a
miss (or a dropped put) and the outage is logged once, so the engine keeps serving from its local tiers and
recomputes what they lack.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from ..config.checks import check_redis_url, mask_url
from ..errors import ConfigError, CorruptEntryError, EntryGoneError, NonFiniteKVError
from . import redis_scripts
from .base import Hit
from .chunk_kv import ChunkKV
from .codec import CODECS, TIER_CODEC, KVCodec, get_codec
from .layout import OpenEntry
from .lazy import LazyChunkKV
from .redis_connect import cluster_client, import_redis, split_cluster_flag
from .serialize import deserialize_chunk, header_length, parse_layout, stored_name
from .stats import CountedTier

logger = logging.getLogger(__name__)


class _CallFailed(Exception):
    """A Redis call failed (already logged and counted by `RedisStore._call`): a miss, nothing to delete."""


# How much of an entry `open` fetches with its first call: enough for the header of any model we support.
_HEAD_BYTES = 64 * 1024
_CLUSTER_SHARDS = 16  # default shards on a cluster: enough to spread over a few masters


class RedisStore(CountedTier):
    """Chunk KV in Redis, at most `budget_bytes` of values under `namespace`, least recently used out.

    All processes using one namespace share entries and one budget (the last `put` enforces its own
    `budget_bytes`, so give them all the same `budget_bytes` and `shards`). Each shard keeps `budget_bytes /
    shards` and its own LRU order. `cluster=True` (or `?cluster=1` in the URL) talks to a Redis Cluster through
    any of its nodes; it defaults to 16 shards there, 1 on a single server. Unreachable Redis: each call is a
    miss or a dropped put, the outage is logged once, and the server is not asked again for `backoff_s` seconds,
    so requests do not queue on timeouts. A corrupt entry (or, with `hmac_key`, a forged one) is deleted, logged
    and counted as a miss. Entries are encoded with `codec` (`codec.py`) and kept under a name of the key, the codec
    and the signing key's digest (`serialize.stored_name`), so a worker with another codec or signing key keeps its
    own entries beside these. Safe to share between threads.
    """

    _failed_calls = (_CallFailed,)

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        budget_bytes: int = 8 * 1024**3,
        namespace: str = "cacheblend-rag",
        *,
        cluster: bool | None = None,
        shards: int | None = None,
        hmac_key: bytes | None = None,
        codec: str | KVCodec = TIER_CODEC,
        name: str = "redis",
        backoff_s: float = 5.0,
        connect_timeout_s: float = 0.5,
        read_timeout_s: float = 2.0,
    ) -> None:
        if budget_bytes < 0:
            raise ConfigError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if not namespace or any(c in namespace for c in "{}"):
            raise ConfigError(f"namespace must be a non-empty string without braces, got {namespace!r}")
        if backoff_s < 0:
            raise ConfigError(f"backoff_s must be >= 0, got {backoff_s}")
        check_redis_url(url)
        url, url_cluster = split_cluster_flag(url)
        cluster = url_cluster if cluster is None else cluster
        shards = (_CLUSTER_SHARDS if cluster else 1) if shards is None else shards
        if type(shards) is not int or shards < 1:
            raise ConfigError(f"shards must be an integer >= 1, got {shards!r}")
        redis = import_redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # For log lines: where, without any password the URL may carry.
        where = urlsplit(url)
        self.where = (where.hostname or where.path) + (f":{where.port}" if where.port else "") + where.path
        super().__init__(name, f"Redis tier at {self.where}", logger)
        self.budget_bytes = budget_bytes
        self.namespace = namespace
        self.cluster = cluster
        self.shards = shards
        self.hmac_key = hmac_key
        self.codec = get_codec(codec, "redis codec")
        self.backoff_s = backoff_s
        # No retries: redis-py's default retries with back-off would turn one outage into seconds per call.
        # The client connects lazily, so a server that is down at start-up is just an outage on the first call.
        timeouts = {"socket_connect_timeout": connect_timeout_s, "socket_timeout": read_timeout_s}
        if cluster:
            self._client = cluster_client(redis, url, timeouts)
        else:
            try:
                self._client = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **timeouts)
            except ValueError as exc:  # a part redis-py cannot read, e.g. a database that is not a number
                raise ConfigError(f"redis_url {mask_url(url)!r} cannot be used ({exc}): check it against "
                                  "redis://[[user]:password@]host:port/db") from None  # fmt: skip
        self._outage_errors: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError)
        self._redis_error: type[BaseException] = redis.RedisError
        scripts = {
            "get": redis_scripts.GET,
            "open": redis_scripts.OPEN,
            "put": redis_scripts.PUT,
            "discard": redis_scripts.DISCARD,
            "clear": redis_scripts.CLEAR,
        }
        self._scripts = {op: self._client.register_script(script) for op, script in scripts.items()}
        self._down_until = 0.0  # time.monotonic() before which the server is not asked again
        self._in_outage = False

    # -- key layout -----------------------------------------------------------------------------------------

    def _tag(self, shard: int) -> str:
        return f"{{{self.namespace}}}" if self.shards == 1 else f"{{{self.namespace}:{shard}/{self.shards}}}"

    def _shard(self, key: str) -> int:
        return zlib.crc32(key.encode()) % self.shards

    def value_key(self, key: str) -> str:
        """The Redis key that holds chunk `key`'s bytes (under its stored name: key, codec, signing key's digest)."""
        return f"{self._tag(self._shard(key))}:{self.entry_name(key)}"

    def _bookkeeping(self, shard: int) -> list[str]:
        tag = self._tag(shard)
        return [f"{tag}:lru", f"{tag}:sizes", f"{tag}:bytes", f"{tag}:clock"]

    def _keys(self, key: str) -> list[str]:
        return [self.value_key(key), *self._bookkeeping(self._shard(key))]

    @property
    def available(self) -> bool:
        """False while backing off after a failed call; the next call after the back-off tries again."""
        return time.monotonic() >= self._down_until

    @property
    def nbytes(self) -> int:
        """Bytes of the values in this namespace (Redis' own per-key overhead is not counted)."""

        def total() -> int:
            return sum(int(self._client.get(self._bookkeeping(i)[2]) or 0) for i in range(self.shards))

        return int(self._call("nbytes", total, 0))

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
                why = f"{type(exc).__name__}: {exc}"
                logger.warning("Redis tier at %s is unreachable (%s); serving from the other tiers, retrying every "
                               "%.1f s", self.where, why, self.backoff_s)  # fmt: skip
            return default
        except self._redis_error as exc:
            # The server answered with an error (out of memory, a wrong key type, ...): this call fails, the tier stays.
            self._count_failure(miss=False)
            logger.warning("Redis tier at %s: %s failed: %s", self.where, op, exc)
            return default
        if self._in_outage:
            with self._lock:
                recovered, self._in_outage = self._in_outage, False
            if recovered:
                logger.warning("Redis tier at %s is reachable again", self.where)
        return result

    def get(self, key: str) -> ChunkKV | None:
        data = self._call("get", lambda: self._scripts["get"](keys=self._keys(key), args=[self.entry_name(key)]), None)
        if data is None:
            self._count_miss()
            return None
        base = None
        try:
            head = parse_layout(data, key, len(data), codec=self.codec, hmac_key=self.hmac_key)
            base = self._open_base(head.base) if head.base else None
            kv = deserialize_chunk(data, key, codec=self.codec, hmac_key=self.hmac_key, base=base)
        except _CallFailed:
            self._count_miss()
            return None
        except CorruptEntryError as exc:
            self._drop_corrupt(key, exc)
            return None
        finally:
            if base is not None:
                base.close()
        self._count_hit(len(data))
        return kv

    def open(self, key: str) -> Hit | None:
        """Like `get`, but fetch only the header now and each layer (two GETRANGEs) when it is asked for; an entry
        coded against a base (`layout.py`) has the base's header fetched too, and its layers beside its own.

        The entry can be evicted or replaced while its layers are read; a layer that then comes back short or
        different fails its check, and the engine recomputes the chunk.
        """
        try:
            entry = self._open_entry(key)
            if entry is None:
                self._count_miss()
                return None
            base = self._open_base(entry.layout.base) if entry.layout.base else None
            # OrphanedEntryError when the base is gone or was replaced
            lazy = LazyChunkKV(entry.layout, entry.read_ranges, base=base)
        except _CallFailed:
            self._count_miss()
            return None
        except CorruptEntryError as exc:
            self._drop_corrupt(key, exc)
            return None
        return self._hand_out(key, lazy)

    def _open_entry(self, key: str) -> OpenEntry | None:
        """The entry's header fetched and checked, and a reader of its byte ranges; None if it is not stored.
        Raises CorruptEntryError, and `_CallFailed` when a call fails (logged and counted by `_call`)."""
        args = [self.entry_name(key), _HEAD_BYTES]
        found = self._call("open", lambda: self._scripts["open"](keys=self._keys(key), args=args), _CallFailed)
        if found is _CallFailed:
            raise _CallFailed
        if not found:
            return None
        value_key = self.value_key(key)
        if not isinstance(found, list) or len(found) != 2 or not isinstance(found[1], bytes):
            raise CorruptEntryError(f"entry {key[:12]} is not a string value")
        total, head = int(found[0]), found[1]
        need = header_length(head, key)
        if need > len(head):
            start = len(head)
            more = self._call("open", lambda: self._client.getrange(value_key, start, need - 1), None)
            if more is None:
                raise _CallFailed
            head += more
        layout = parse_layout(head, key, total, codec=self.codec, hmac_key=self.hmac_key)

        def read_ranges(ranges: Sequence[tuple[int, int]]) -> list[bytes]:
            pipe = self._client.pipeline(transaction=False)
            for start, end in ranges:
                pipe.getrange(value_key, start, end - 1)
            out = pipe.execute()
            if any(len(got) < end - start for got, (start, end) in zip(out, ranges, strict=False)):
                # shorter than the entry that was opened: Redis evicted it (maxmemory) or another worker replaced it
                if not self._call("exists", lambda: self._client.exists(value_key), 1):
                    self._delete(key)  # gone: forget its bookkeeping too (a replaced entry is left as it is)
                raise EntryGoneError(f"entry {key[:12]} went away while its layers were read")
            return out

        return OpenEntry(layout, read_ranges)

    def put(self, kv: ChunkKV) -> None:
        if not self.available:
            return  # skip serializing for a server we are not going to ask
        try:
            data = self._entry_bytes(kv)
        except NonFiniteKVError as exc:
            logger.warning("%s", exc)
            return
        budget = self.budget_bytes // self.shards
        if len(data) > budget:
            # Storing it would evict everything else and then itself; drop any older copy instead.
            self._delete(kv.key)
            return
        keys, name = self._keys(kv.key), self.entry_name(kv.key)
        args = [data, name, budget, keys[0].removesuffix(name)]
        evicted = self._call("put", lambda: self._scripts["put"](keys=keys, args=args), None)
        if evicted is not None:
            with self._lock:
                self.stats.puts += 1
                self.stats.evictions += int(evicted)

    def _base_read_failed(self, key: str, exc: BaseException) -> None:
        """Nothing to count: `_call` counted the failed call."""

    def _delete(self, key: str) -> None:
        keys, name = self._keys(key)[:4], self.entry_name(key)
        self._call("discard", lambda: self._scripts["discard"](keys=keys, args=[name]), None)

    def clear(self) -> None:
        """Delete every entry of this namespace and its bookkeeping (not other namespaces), shard by shard."""
        for shard in range(self.shards):
            prefix = self._tag(shard) + ":"
            keys = self._bookkeeping(shard)
            self._call("clear", lambda k=keys, p=prefix: self._scripts["clear"](keys=k, args=[p]), None)

    def flush(self) -> None:
        """Nothing to wait for: `put` has stored the entry (or given up on it) before it returns."""

    def close(self) -> None:
        self._client.close()

    def codecs_holding(self, key: str) -> frozenset[str]:
        """`CountedTier.codecs_holding` in one round trip: the names of every codec share the key's shard."""
        tag = self._tag(self._shard(key))
        names = {codec: stored_name(key, c, self.hmac_key) for codec, c in CODECS.items()}

        def exists() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for name in names.values():
                pipe.exists(f"{tag}:{name}")
            return pipe.execute()

        found = self._call("contains", exists, [0] * len(names))
        return frozenset(codec for codec, n in zip(names, found, strict=True) if n)

    def _has_entry(self, key: str, name: str) -> bool:
        path = f"{self._tag(self._shard(key))}:{name}"
        return bool(self._call("contains", lambda: self._client.exists(path), 0))

    def __len__(self) -> int:
        def count() -> int:
            return sum(int(self._client.zcard(self._bookkeeping(i)[0])) for i in range(self.shards))

        return int(self._call("len", count, 0))
