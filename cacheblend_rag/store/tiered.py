"""A chunk store made of tiers, fastest first: looked up in order, promoted on a hit, written through on a put.

The usual stack is process memory, then local disk, then a Redis shared by every worker; `build_store` makes it.
Each tier keeps its own budget and LRU order; this class only routes calls and counts hits per tier.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import ConfigError
from .base import ChunkStore, StoreStats
from .chunk_kv import ChunkKV
from .lazy import LazyChunkKV
from .memory import MemoryStore

logger = logging.getLogger(__name__)


class TieredStore:
    """Chains chunk stores. `get` asks each tier in order; a hit in tier i is copied into tiers 0..i-1 so the
    next lookup is served by the fastest one. `put` writes to every tier, so a chunk evicted from memory can
    still come back from disk or Redis, and other workers see it.

    `names` label the tiers in `hits_by_tier` (default: each tier's `name` attribute, else its class name).
    With `write_back` (the default), `put` stores into the first tier at once and into the others on a
    background thread, so a request never waits on disk or Redis; `flush()` waits for pending writes.
    """

    def __init__(
        self, tiers: Sequence[ChunkStore], names: Sequence[str] | None = None, *, write_back: bool = True
    ) -> None:
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
        self._writer = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="cacheblend-write-back")
            if write_back and len(self.tiers) > 1
            else None
        )
        self._pending: set[Future] = set()

    def lookup(self, key: str) -> tuple[ChunkKV | None, str | None]:
        """-> (the entry, the name of the tier that had it), or (None, None) on a miss everywhere."""
        kv, tier = self._find(key, lazy=False)
        assert not isinstance(kv, LazyChunkKV)
        return kv, tier

    def get(self, key: str) -> ChunkKV | None:
        return self.lookup(key)[0]

    def open(self, key: str) -> tuple[ChunkKV | LazyChunkKV | None, str | None]:
        """Like `lookup`, but a hit in a tier that can read by layer (disk, Redis) comes back as a `LazyChunkKV`
        whose layers are fetched as the loading pipeline asks for them. The chunk is promoted into the faster
        tiers once its last layer has been read, from the bytes already fetched."""
        return self._find(key, lazy=True)

    def _find(self, key: str, *, lazy: bool) -> tuple[ChunkKV | LazyChunkKV | None, str | None]:
        for i, tier in enumerate(self.tiers):
            opener = getattr(tier, "open", None) if lazy else None
            kv = opener(key) if opener is not None else tier.get(key)
            if kv is None:
                continue
            # Promotion goes to faster tiers only: cheap, and the next lookup needs it.
            upper = self.tiers[:i]
            if isinstance(kv, LazyChunkKV):
                if upper:
                    kv.on_complete = functools.partial(self._promote, upper)
            else:
                self._promote(upper, kv)
            with self._lock:
                self.stats.hits += 1
                self.stats.bytes_read += kv.nbytes
                self.hits_by_tier[self.names[i]] += 1
            return kv, self.names[i]
        with self._lock:
            self.stats.misses += 1
        return None, None

    @staticmethod
    def _promote(tiers: Sequence[ChunkStore], kv: ChunkKV) -> None:
        for tier in tiers:
            tier.put(kv)

    def put(self, kv: ChunkKV) -> None:
        self.tiers[0].put(kv)
        with self._lock:
            self.stats.puts += 1
        if self._writer is None:
            for tier in self.tiers[1:]:
                tier.put(kv)
            return
        future = self._writer.submit(self._write_lower, kv)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._written)

    def _write_lower(self, kv: ChunkKV) -> None:
        for name, tier in zip(self.names[1:], self.tiers[1:], strict=True):
            try:
                tier.put(kv)
            except Exception:  # a tier that raises must not lose the writes to the others
                logger.exception("writing chunk %s to the %s tier failed", kv.key[:12], name)

    def _written(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every background write has reached every tier."""
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.result(timeout=timeout)

    def close(self) -> None:
        """Finish pending writes and stop the writer thread."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def discard(self, key: str) -> None:
        for tier in self.tiers:
            discard = getattr(tier, "discard", None)
            if discard is not None:
                discard(key)

    def clear(self, tiers: Sequence[str] | None = None) -> None:
        """Delete every entry of the named tiers (default: all), after the pending background writes land, so
        none of them refills a tier just cleared. Counters are kept. Tiers shared with other processes (disk,
        Redis) are cleared for them too; `clear(["memory"])` frees this process's memory only."""
        names = list(self.names) if tiers is None else list(tiers)
        unknown = [n for n in names if n not in self.names]
        if unknown:
            raise ConfigError(f"no tier named {unknown} in this store; its tiers are {list(self.names)}")
        chosen = {name: self.tiers[self.names.index(name)] for name in names}
        for name, tier in chosen.items():
            if getattr(tier, "clear", None) is None:
                raise ConfigError(f"the {name} tier ({type(tier).__name__}) has no clear() method")
        self.flush()
        for tier in chosen.values():
            tier.clear()

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
    write_back: bool = True,
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
    return TieredStore(tiers, names, write_back=write_back)
