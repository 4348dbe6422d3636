"""A chunk store made of tiers, fastest first: looked up in order, promoted on a hit, written through on a put.

The usual stack is process memory, then local disk, then a Redis shared by every worker; `build_store` makes it.
Each tier keeps its own budget and eviction order; this class only routes calls and counts hits per tier.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import ConfigError, CorruptEntryError
from .base import ChunkReader, ChunkStore, Hit, StoreStats
from .chunk_kv import ChunkKV
from .codec import NATIVE, TIER_CODEC, KVCodec
from .memory import MemoryStore

logger = logging.getLogger(__name__)


class TieredStore:
    """Chains chunk stores. `get` asks each tier in order; a hit in tier i is copied into tiers 0..i-1 so the
    next lookup is served by the fastest one. `put` writes to every tier, so a chunk evicted from memory can
    still come back from disk or Redis, and other workers see it.

    `names` label the tiers in `hits_by_tier` and in `Hit.tier` (default: each tier's `name`). With
    `write_back` (the default), `put` stores into the first tier at once and into the others on a background
    thread, so a request never waits on disk or Redis; `flush()` waits for pending writes. Until a chunk's
    background write lands, a lookup the first tier misses (it kept no room for the chunk, or evicted it) is
    served from the copy being written, as computed (before the lower tiers' codec), and counted as a hit of
    the second tier: the next request never recomputes a chunk only because its write is still under way. A
    stack is itself a `ChunkStore`: it can be a tier of another stack, or be passed to the engine like any
    single tier.
    """

    def __init__(
        self,
        tiers: Sequence[ChunkStore],
        names: Sequence[str] | None = None,
        *,
        write_back: bool = True,
        name: str = "tiered",
    ) -> None:
        if not tiers:
            raise ConfigError("TieredStore needs at least one tier, got none")
        not_stores = [type(t).__name__ for t in tiers if not isinstance(t, ChunkStore)]
        if not_stores:
            raise ConfigError(
                f"every tier must implement the ChunkStore protocol (cacheblend_rag.store.base), got {not_stores}"
            )
        if names is None:
            names = [t.name for t in tiers]
        if len(names) != len(tiers):
            raise ConfigError(f"got {len(names)} names for {len(tiers)} tiers; give one name per tier")
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be distinct, got {list(names)}; pass `names=` to tell them apart")
        self.name = name
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
        self._writing: dict[str, ChunkKV] = {}  # chunks on their way to the lower tiers, by key
        # Hits of lower tiers handed out by `open` and not read whole yet: (tier name, weak reader) by key.
        self._unread: dict[str, tuple[str, weakref.ref]] = {}

    def get(self, key: str) -> ChunkKV | None:
        hit = self._find(key, lazy=False)
        return None if hit is None else hit.kv.materialize()

    def open(self, key: str) -> Hit | None:
        """The first tier's hit, named after that tier. A hit in a tier that can read by layer (disk, Redis) has
        its layers fetched as the loading pipeline asks for them; the chunk is promoted into the faster tiers
        once its last layer has been read, from the bytes already fetched."""
        return self._find(key, lazy=True)

    def _find(self, key: str, *, lazy: bool) -> Hit | None:
        for i, tier in enumerate(self.tiers):
            if i == 1:
                with self._lock:
                    writing = self._writing.get(key)
                    if writing is not None:  # on its way down, held in memory: no disk or network read needed
                        self.stats.hits += 1
                        self.stats.bytes_read += writing.nbytes
                        self.hits_by_tier[self.names[1]] += 1
                        return Hit(writing, self.names[1])
            if lazy:
                found = tier.open(key)
                kv: ChunkReader | None = None if found is None else found.kv
            else:
                kv = tier.get(key)
            if kv is None:
                continue
            reader = weakref.ref(kv, functools.partial(self._forget, key))
            with self._lock:
                self.stats.hits += 1
                self.stats.bytes_read += kv.nbytes
                self.hits_by_tier[self.names[i]] += 1
                if lazy and i > 0:
                    self._unread[key] = (self.names[i], reader)
            # Promotion goes to faster tiers only: cheap, and the next lookup needs it. A chunk read by layer is
            # promoted from the bytes already fetched, once its last layer is in.
            if i > 0:
                kv.when_whole(functools.partial(self._read_whole, key, reader, self.tiers[:i]))
            kv.when_corrupt(functools.partial(self._unhit, key, self.names[i]))
            return Hit(kv, self.names[i])
        with self._lock:
            self.stats.misses += 1
        return None

    def _unhit(self, key: str, name: str, exc: CorruptEntryError | None = None) -> None:
        """A hit turned out corrupt, or was refused unread: it was a miss after all (the tier fixes its own counts)."""
        with self._lock:
            self.stats.hits -= 1
            self.stats.misses += 1
            self.hits_by_tier[name] -= 1
            self._unread.pop(key, None)

    def _forget(self, key: str, reader: weakref.ref) -> None:
        """`reader` was read whole, or dropped: forget it (unless a newer reader of the key took its place).

        No lock: this also runs from the garbage collector, possibly inside a section that holds `_lock`.
        """
        if self._unread.get(key, ("", None))[1] is reader:
            self._unread.pop(key, None)

    def _read_whole(self, key: str, reader: weakref.ref, tiers: Sequence[ChunkStore], kv: ChunkKV) -> None:
        self._forget(key, reader)
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
        with self._lock:
            self._writing[kv.key] = kv
            future = self._writer.submit(self._write_lower, kv)
            self._pending.add(future)
        future.add_done_callback(functools.partial(self._written, kv))

    def _write_lower(self, kv: ChunkKV) -> None:
        for name, tier in zip(self.names[1:], self.tiers[1:], strict=True):
            try:
                tier.put(kv)
            except Exception:  # a tier that raises must not lose the writes to the others
                logger.exception("writing chunk %s to the %s tier failed", kv.key[:12], name)

    def _written(self, kv: ChunkKV, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)
            if self._writing.get(kv.key) is kv:  # a newer put of the key keeps its own copy
                del self._writing[kv.key]

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every background write has reached every tier."""
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.result(timeout=timeout)
        for tier in self.tiers:
            tier.flush()

    @property
    def writes_back(self) -> bool:
        """Whether the lower tiers are written on a thread of this stack's own (`flush` waits for it)."""
        return self._writer is not None

    def after_fork_in_child(self) -> None:
        """In a forked child: the writer thread is the parent's (gone here, with what it had queued, which the
        parent writes); start a new one, with a fresh lock."""
        self._lock = threading.Lock()
        self._pending = set()
        self._writing = {}
        self._unread = {}
        if self._writer is not None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cacheblend-write-back")

    def close(self) -> None:
        """Finish pending writes, stop the writer thread and close every tier."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        for tier in self.tiers:
            tier.close()

    def discard(self, key: str) -> None:
        """Delete `key` from every tier. A hit `open` handed out from a lower tier and discarded before it was
        read whole (the engine refusing its shape or dtype) is counted as a miss, here and in that tier."""
        with self._lock:
            refused = self._unread.pop(key, None)
            self._writing.pop(key, None)
        if refused is not None:
            self._unhit(key, refused[0])
        for tier in self.tiers:
            tier.discard(key)

    def clear(self, tiers: Sequence[str] | None = None) -> None:
        """Delete every entry of the named tiers (default: all), after the pending background writes land, so
        none of them refills a tier just cleared. Counters are kept. Tiers shared with other processes (disk,
        Redis) are cleared for them too; `clear(["memory"])` frees this process's memory only."""
        names = list(self.names) if tiers is None else list(tiers)
        unknown = [n for n in names if n not in self.names]
        if unknown:
            raise ConfigError(f"no tier named {unknown} in this store; its tiers are {list(self.names)}")
        self.flush()
        for name in names:
            self.tiers[self.names.index(name)].clear()

    def tier_stats(self) -> dict[str, StoreStats]:
        """Each tier's own counters, by tier name."""
        return {name: tier.stats for name, tier in zip(self.names, self.tiers, strict=True)}

    def __contains__(self, key: object) -> bool:
        with self._lock:
            if key in self._writing:
                return True
        return any(key in tier for tier in self.tiers)

    def codecs_holding(self, key: str) -> frozenset[str]:
        return frozenset().union(*(tier.codecs_holding(key) for tier in self.tiers))

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
    hmac_key: bytes | str | None = None,
    kv_codec: str | KVCodec = TIER_CODEC,
    memory_codec: str | KVCodec = NATIVE,
    memory_eviction: str = "lfu",
) -> TieredStore:
    """Memory, then disk if `disk_dir` is given, then Redis if `redis_url` is given (`?cluster=1` for a cluster).

    Always a `TieredStore`, even of memory alone, so that callers read `hits_by_tier` the same way everywhere.
    `hmac_key` signs what the disk and Redis tiers write and refuses what they read unsigned or forged.
    `kv_codec` is how the disk and Redis tiers encode chunk KV, `memory_codec` how the memory tier keeps it, and
    `memory_eviction` which entry it evicts first ("lru" or "lfu", `eviction.py`).
    """
    key = hmac_key.encode() if isinstance(hmac_key, str) else hmac_key
    tiers: list[ChunkStore] = [MemoryStore(memory_bytes, codec=memory_codec, eviction=memory_eviction)]
    names = ["memory"]
    if disk_dir is not None:
        from .disk.tier import DiskStore

        tiers.append(DiskStore(disk_dir, disk_bytes, hmac_key=key, codec=kv_codec))
        names.append("disk")
    if redis_url is not None:
        from .redis_store import RedisStore

        tiers.append(RedisStore(redis_url, redis_bytes, redis_namespace, hmac_key=key, codec=kv_codec))
        names.append("redis")
    return TieredStore(tiers, names, write_back=write_back)
