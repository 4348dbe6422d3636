"""A chunk store made of tiers, fastest first: looked up in order, promoted on a hit, written through on a put.

The usual stack is process memory, then local disk, then a Redis shared by every worker; `build_store` makes it.
Each tier keeps its own budget and LRU order; this class only routes calls and counts hits per tier.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

from ..errors import ConfigError
from .base import ChunkStore, StoreStats
from .chunk_kv import ChunkKV
from .memory import MemoryStore


class TieredStore:
    """Chains chunk stores. `get` asks each tier in order; a hit in tier i is copied into tiers 0..i-1 so the
    next lookup is served by the fastest one. `put` writes to every tier, so a chunk evicted from memory can
    still come back from disk or Redis, and other workers see it.

    `names` label the tiers in `hits_by_tier` (default: each tier's `name` attribute, else its class name).
    """

    def __init__(self, tiers: Sequence[ChunkStore], names: Sequence[str] | None = None) -> None:
        if not tiers:
            raise ConfigError("TieredStore needs at least one tier, got none")
        if names is None:
            names = [getattr(t, "name", type(t).__name__) for t in tiers]
        if len(names) != len(tiers):
            raise ConfigError(f"got {len(names)} names for {len(tiers)} tiers; give one name per tier")
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be distinct, got {list(names)}; pass `names=` to tell them apart")
        self.tiers: tuple[ChunkStore, ...] = tuple(tiers)
        self.names: tuple[str, ...] = tuple(names)
        self.stats = StoreStats()  # of the whole stack: a hit in any tier is a hit
        self.hits_by_tier: dict[str, int] = dict.fromkeys(self.names, 0)
        self._lock = threading.Lock()

    def get(self, key: str) -> ChunkKV | None:
        for i, tier in enumerate(self.tiers):
            kv = tier.get(key)
            if kv is None:
                continue
            for upper in self.tiers[:i]:
                upper.put(kv)
            with self._lock:
                self.stats.hits += 1
                self.stats.bytes_read += kv.nbytes
                self.hits_by_tier[self.names[i]] += 1
            return kv
        with self._lock:
            self.stats.misses += 1
        return None

    def put(self, kv: ChunkKV) -> None:
        for tier in self.tiers:
            tier.put(kv)
        with self._lock:
            self.stats.puts += 1

    def discard(self, key: str) -> None:
        for tier in self.tiers:
            discard = getattr(tier, "discard", None)
            if discard is not None:
                discard(key)

    def tier_stats(self) -> dict[str, StoreStats]:
        """Each tier's own counters, by tier name."""
        return {name: getattr(tier, "stats", StoreStats()) for name, tier in zip(self.names, self.tiers, strict=True)}

    def __contains__(self, key: object) -> bool:
        return any(key in tier for tier in self.tiers)

    def __len__(self) -> int:
        """Entries in the fullest tier: a lower bound on the distinct chunks stored (write-through makes the
        largest tier hold nearly all of them)."""
        return max(len(tier) for tier in self.tiers)


def build_store(
    memory_bytes: int = 2 * 1024**3,
    disk_dir: str | os.PathLike[str] | None = None,
    disk_bytes: int = 20 * 1024**3,
    redis_url: str | None = None,
    redis_bytes: int = 8 * 1024**3,
    redis_namespace: str = "cacheblend-rag",
) -> TieredStore:
    """Memory, then disk if `disk_dir` is given, then Redis if `redis_url` is given.

    Always a `TieredStore`, even of memory alone, so that callers read `hits_by_tier` the same way everywhere.
    """
    tiers: list[ChunkStore] = [MemoryStore(memory_bytes)]
    names = ["memory"]
    if disk_dir is not None:
        from .disk import DiskStore

        tiers.append(DiskStore(disk_dir, disk_bytes))
        names.append("disk")
    if redis_url is not None:
        from .redis_store import RedisStore

        tiers.append(RedisStore(redis_url, redis_bytes, redis_namespace))
        names.append("redis")
    return TieredStore(tiers, names)
