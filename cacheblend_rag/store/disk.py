"""Local-disk chunk store: serialized entries in a `diskcache` directory, bounded by bytes, least recently used out.

Several processes on one machine may share a directory (diskcache coordinates them through SQLite). Values are
the bytes of `serialize_chunk`; the directory never holds pickles, and a pickled value planted in it is refused
rather than loaded.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time

from ..errors import ConfigError
from .base import Hit
from .chunk_kv import ChunkKV
from .codec import NATIVE, KVCodec, get_codec
from .disk_files import import_diskcache, safe_bytes_disk
from .lazy import LazyChunkKV
from .serialize import CorruptEntryError, header_length, parse_layout, serialize_chunk
from .stats import TierStats

logger = logging.getLogger(__name__)

# How long an operation waits on a SQLite lock held by another process before it counts as an error (a miss).
_SQLITE_TIMEOUT_S = 5.0


def _open_cache(directory: str, budget_bytes: int) -> object:
    """diskcache's Cache over `directory`, or one ConfigError naming the folder and the fix."""
    diskcache = import_diskcache()
    try:
        return diskcache.Cache(
            directory,
            timeout=_SQLITE_TIMEOUT_S,
            disk=safe_bytes_disk(),
            size_limit=budget_bytes,
            eviction_policy="least-recently-used",
            # diskcache evicts up to `cull_limit` least recently used entries whenever a set leaves the directory
            # over budget; its default of ten can throw out the entry just written when the cache holds few.
            cull_limit=1,
        )
    except (OSError, sqlite3.Error, diskcache.Timeout) as exc:
        if os.path.exists(directory) and not os.path.isdir(directory):
            fix = "it is a file; give a folder path"
        elif isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
            fix = "its cache.db is damaged; delete the folder (it holds only a cache) or give another one"
        else:
            fix = "make it writable by this user, or give another folder"
        raise ConfigError(f"the disk tier folder {directory!r} cannot be used ({exc}): {fix}") from exc


def check_disk_dir(directory: str | os.PathLike[str]) -> None:
    """Open and close the disk tier's folder once, so a bad folder is reported before a model loads."""
    _open_cache(os.fspath(directory), 0).close()  # type: ignore[attr-defined]


class DiskStore:
    """Chunk KV in a local directory, at most `budget_bytes` in all (values plus diskcache's ~32 KB index).

    `get` moves an entry to the most recently used end; `put` evicts the least recently used entries until the
    directory fits the budget again. A corrupt entry, or an index row this tier could not have written (a file
    name outside the folder, a symlink, a FIFO, text, a pickle), is deleted, logged and counted as a miss; an I/O
    or SQLite failure is logged and counted in `stats.errors`, and is also a miss (or a lost put), never an
    exception. Reads are bounded by the size the entry's header declares. Safe to share between threads and
    processes. An unusable folder (a file, not writable, a damaged index) is a ConfigError at construction.

    With `hmac_key`, entries are signed when written and entries without a valid signature are refused (misses).
    Entries are encoded with `codec` (`codec.py`); one written with another codec is a miss.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        budget_bytes: int = 20 * 1024**3,
        *,
        hmac_key: bytes | None = None,
        codec: str | KVCodec = NATIVE,
        name: str = "disk",
    ) -> None:
        if budget_bytes < 0:
            raise ConfigError(f"budget_bytes must be >= 0, got {budget_bytes}")
        diskcache = import_diskcache()
        self.name = name
        self.directory = os.fspath(directory)
        self.budget_bytes = budget_bytes
        self.hmac_key = hmac_key
        self.codec = get_codec(codec, "disk codec")
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._cache = _open_cache(self.directory, budget_bytes)
        # Failures of the backend itself, as opposed to bad data in it.
        self._backend_errors: tuple[type[BaseException], ...] = (OSError, sqlite3.Error, diskcache.Timeout)

    @property
    def nbytes(self) -> int:
        """Bytes the directory takes, as diskcache counts them for its size limit."""
        return self._cache.volume()

    def get(self, key: str) -> ChunkKV | None:
        lazy = self._read_header(key)
        if lazy is None:
            return None
        lazy.when_corrupt(lambda exc: self._drop_corrupt(key, exc))
        try:
            kv = lazy.materialize()  # bounded: the header's size was checked against the file's
        except CorruptEntryError:
            return None  # dropped and counted as a miss by the when_corrupt callback above
        self._count_hit(lazy.layout.total_bytes)
        return kv

    def open(self, key: str) -> Hit | None:
        """Like `get`, but read only the header now and each layer when it is asked for (pipelined loading).

        diskcache keeps values of 32 KB and more as files; those are opened and read by byte range. The open
        file stays readable even if another process evicts the entry meanwhile.
        """
        lazy = self._read_header(key)
        if lazy is None:
            return None
        self._count_hit(lazy.layout.total_bytes)
        lazy.when_corrupt(lambda exc: self._drop_corrupt(key, exc, was_hit=True))
        return Hit(lazy, self.name)

    def _read_header(self, key: str) -> LazyChunkKV | None:
        """The entry with only its header read and checked; None (counted) on a miss or a bad entry."""
        handle = None
        try:
            handle = self._cache.get(key, read=True)
            if handle is None:
                with self._lock:
                    self.stats.misses += 1
                return None
            if type(handle) is bytes:  # a small value kept inside SQLite: already in memory
                data = memoryview(handle)
                layout = parse_layout(data, key, len(data), codec=self.codec, hmac_key=self.hmac_key)
                reader, close = (lambda ranges: [data[a:b] for a, b in ranges]), None
            else:
                fd = handle.fileno()
                size = os.fstat(fd).st_size
                if size > max(self.budget_bytes, 1 << 20):
                    raise CorruptEntryError(f"entry {key[:12]} is {size} bytes, more than the tier's budget")
                head = os.pread(fd, 8, 0)
                head += os.pread(fd, header_length(head, key) - 8, 8)
                layout = parse_layout(head, key, size, codec=self.codec, hmac_key=self.hmac_key)
                reader, close = (lambda ranges: [os.pread(fd, b - a, a) for a, b in ranges]), handle.close
        except (CorruptEntryError, *self._backend_errors) as exc:
            if handle is not None and type(handle) is not bytes:
                handle.close()
            if isinstance(exc, CorruptEntryError):
                self._drop_corrupt(key, exc)
            else:
                self._count_error("get", key, exc)
            return None
        return LazyChunkKV(layout, reader, close=close)

    def _count_hit(self, nbytes: int) -> None:
        with self._lock:
            self.stats.hits += 1
            self.stats.bytes_read += nbytes

    def put(self, kv: ChunkKV) -> None:
        data = serialize_chunk(kv, codec=self.codec, hmac_key=self.hmac_key)
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
        try:
            self._cache.clear()
        except self._backend_errors as exc:
            self._count_error("clear", "*" * 12, exc)

    def flush(self) -> None:
        """Nothing to wait for: `put` writes through to the folder before it returns."""

    def close(self) -> None:
        self._cache.close()

    def __contains__(self, key: object) -> bool:
        try:
            return key in self._cache
        except self._backend_errors:
            return False

    def __len__(self) -> int:
        try:
            return len(self._cache)
        except self._backend_errors:
            return 0

    def _drop_corrupt(self, key: str, exc: CorruptEntryError, *, was_hit: bool = False) -> None:
        """Count a corrupt entry as a miss (taking back the hit `open` counted for it) and delete its row."""
        logger.warning("disk tier %s: dropping a corrupt entry (%s); it will be recomputed", self.directory, exc)
        with self._lock:
            self.stats.corrupt += 1
            self.stats.misses += 1
            if was_hit:
                self.stats.hits -= 1
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
