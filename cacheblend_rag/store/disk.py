"""Local-disk chunk store: serialized entries in a `diskcache` directory, bounded by bytes, least recently used out.

Several processes on one machine may share a directory (diskcache coordinates them through SQLite). Values are
the bytes of `serialize_chunk`; the directory never holds pickles, and a pickled value planted in it is refused
rather than loaded.
"""

from __future__ import annotations

import functools
import logging
import os
import sqlite3
import threading
import time
from typing import Any

from ..errors import ConfigError
from .chunk_kv import ChunkKV
from .lazy import LazyChunkKV
from .serialize import CorruptEntryError, deserialize_chunk, header_length, parse_layout, serialize_chunk
from .stats import TierStats

logger = logging.getLogger(__name__)

# How long an operation waits on a SQLite lock held by another process before it counts as an error (a miss).
_SQLITE_TIMEOUT_S = 5.0


def _import_diskcache() -> Any:
    try:
        import diskcache
    except ImportError as exc:
        raise ImportError("the disk tier needs diskcache; install it with `pip install 'diskcache>=5.6'`") from exc
    return diskcache


@functools.cache
def _bytes_only_disk() -> type:
    """A diskcache `Disk` that stores and returns only `bytes`, so no value is ever unpickled."""
    diskcache = _import_diskcache()

    class BytesOnlyDisk(diskcache.Disk):
        def store(self, value: Any, read: bool, key: Any = diskcache.core.UNKNOWN) -> Any:
            if type(value) is not bytes:
                raise TypeError(f"the disk tier stores bytes only, got {type(value).__name__}")
            return super().store(value, read, key=key)

        def fetch(self, mode: int, filename: str | None, value: Any, read: bool) -> Any:
            if mode == diskcache.core.MODE_PICKLE:
                raise CorruptEntryError("a pickled value was found in the disk tier; it is not loaded")
            return super().fetch(mode, filename, value, read)

    return BytesOnlyDisk


class DiskStore:
    """Chunk KV in a local directory, at most `budget_bytes` in all (values plus diskcache's ~32 KB index).

    `get` moves an entry to the most recently used end; `put` evicts the least recently used entries until the
    directory fits the budget again. A corrupt entry is deleted, logged and counted as a miss; an I/O or SQLite
    failure is logged and counted in `stats.errors`, and is also a miss (or a lost put), never an exception.
    Safe to share between threads and processes.
    """

    name = "disk"

    def __init__(self, directory: str | os.PathLike[str], budget_bytes: int = 20 * 1024**3) -> None:
        if budget_bytes < 0:
            raise ConfigError(f"budget_bytes must be >= 0, got {budget_bytes}")
        diskcache = _import_diskcache()
        self.directory = os.fspath(directory)
        self.budget_bytes = budget_bytes
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._cache = diskcache.Cache(
            self.directory,
            timeout=_SQLITE_TIMEOUT_S,
            disk=_bytes_only_disk(),
            size_limit=budget_bytes,
            eviction_policy="least-recently-used",
            # diskcache evicts up to `cull_limit` least recently used entries whenever a set leaves the directory
            # over budget; its default of ten can throw out the entry just written when the cache holds few.
            cull_limit=1,
        )
        # Failures of the backend itself, as opposed to bad data in it.
        self._backend_errors: tuple[type[BaseException], ...] = (OSError, sqlite3.Error, diskcache.Timeout)

    @property
    def nbytes(self) -> int:
        """Bytes the directory takes, as diskcache counts them for its size limit."""
        return self._cache.volume()

    def get(self, key: str) -> ChunkKV | None:
        try:
            data = self._cache.get(key)
            if data is None:
                with self._lock:
                    self.stats.misses += 1
                return None
            if type(data) is not bytes:
                raise CorruptEntryError(f"entry {key[:12]} holds a {type(data).__name__}, not bytes")
            kv = deserialize_chunk(data, key)
        except CorruptEntryError as exc:
            self._drop_corrupt(key, exc)
            return None
        except self._backend_errors as exc:
            self._count_error("get", key, exc)
            return None
        with self._lock:
            self.stats.hits += 1
            self.stats.bytes_read += len(data)
        return kv

    def open(self, key: str) -> LazyChunkKV | None:
        """Like `get`, but read only the header now and each layer when it is asked for (pipelined loading).

        diskcache keeps values of 32 KB and more as files; those are opened and read by byte range. The open
        file stays readable even if another process evicts the entry meanwhile.
        """
        handle = None
        try:
            handle = self._cache.get(key, read=True)
            if handle is None:
                with self._lock:
                    self.stats.misses += 1
                return None
            if type(handle) is bytes:  # a small value kept inside SQLite: already in memory
                data = memoryview(handle)
                layout = parse_layout(data, key, len(data))
                reader, close = (lambda ranges: [data[a:b] for a, b in ranges]), None
            else:
                fd = handle.fileno()
                size = os.fstat(fd).st_size
                head = os.pread(fd, 8, 0)
                head += os.pread(fd, header_length(head, key) - 8, 8)
                layout = parse_layout(head, key, size)
                reader, close = (lambda ranges: [os.pread(fd, b - a, a) for a, b in ranges]), handle.close
        except (CorruptEntryError, *self._backend_errors) as exc:
            if handle is not None and type(handle) is not bytes:
                handle.close()
            if isinstance(exc, CorruptEntryError):
                self._drop_corrupt(key, exc)
            else:
                self._count_error("get", key, exc)
            return None
        with self._lock:
            self.stats.hits += 1
            self.stats.bytes_read += layout.total_bytes
        return LazyChunkKV(layout, reader, close=close, on_corrupt=lambda exc: self._drop_corrupt(key, exc))

    def put(self, kv: ChunkKV) -> None:
        data = serialize_chunk(kv)
        try:
            if len(data) > self.budget_bytes:
                # Storing it would evict everything else and then itself; drop any older copy instead.
                self._cache.delete(kv.key)
                return
            with self._lock:
                before = len(self._cache) + int(kv.key not in self._cache)
                self._cache.set(kv.key, data)
                self._evict_to_budget()
                self.stats.puts += 1
                # Another process sharing the directory can skew this count; it is informative only.
                self.stats.evictions += max(0, before - len(self._cache))
        except self._backend_errors as exc:
            self._count_error("put", kv.key, exc)

    def _evict_to_budget(self) -> None:
        """Evict least recently used entries one by one until the directory fits the budget.

        The `set` above already evicted one; more are needed only when the new entry outweighs its victim.
        diskcache's public `cull()` removes ten at a time, so this uses its internal one-entry step (diskcache 5.x).
        """
        while self._cache.volume() > self.budget_bytes and len(self._cache) > 0:
            with self._cache._transact() as (sql, cleanup):
                self._cache._cull(time.time(), sql, cleanup, limit=1)

    def discard(self, key: str) -> None:
        try:
            self._cache.delete(key)
        except self._backend_errors as exc:
            self._count_error("discard", key, exc)

    def clear(self) -> None:
        self._cache.clear()

    def close(self) -> None:
        self._cache.close()

    def __contains__(self, key: object) -> bool:
        try:
            return key in self._cache
        except self._backend_errors:
            return False

    def __len__(self) -> int:
        return len(self._cache)

    def _drop_corrupt(self, key: str, exc: CorruptEntryError) -> None:
        logger.warning("disk tier %s: dropping a corrupt entry (%s); it will be recomputed", self.directory, exc)
        with self._lock:
            self.stats.corrupt += 1
            self.stats.misses += 1
        try:
            self._cache.delete(key)
        except self._backend_errors as del_exc:
            self._count_error("delete", key, del_exc)

    def _count_error(self, op: str, key: str, exc: BaseException) -> None:
        logger.warning("disk tier %s: %s of chunk %s failed: %s", self.directory, op, key[:12], exc)
        with self._lock:
            self.stats.errors += 1
            if op == "get":
                self.stats.misses += 1
