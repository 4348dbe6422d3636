"""Local-disk chunk store: serialized entries in a `diskcache` directory, bounded by bytes, least recently used out.

Several processes on one machine may share a directory (diskcache coordinates them through SQLite). Values are
the bytes of `serialize_chunk`; the directory never holds pickles, and a pickled value planted in it is refused
rather than loaded. What the tier distrusts, and where it is checked: the folder it is given (`disk_folder`: an
empty or new folder, or a store), the index `cache.db` (`disk_index`: planted schema objects and settings, reads
bounded in time) and the value files it names (`disk_files`: no symlink, FIFO or name outside the folder).
"""

from __future__ import annotations

import logging
import os
import sqlite3

from ...errors import ConfigError, CorruptEntryError, NonFiniteKVError
from ..base import Hit
from ..chunk_kv import ChunkKV
from ..codec import TIER_CODEC, KVCodec, get_codec
from ..layout import BaseReader, OpenEntry
from ..lazy import LazyChunkKV
from ..serialize import header_length, parse_layout
from ..stats import CountedTier
from .files import import_diskcache
from .folder import claim_folder, write_marker
from .index import DB_NAME, GuardedIndex, check_index, open_error
from .pause import WritePause, lasting_write_failure

logger = logging.getLogger(__name__)

# How long one call may wait on a SQLite lock held by another process, or work on one read, before it is an error.
_TIMEOUT_S = 5.0
# How long a full or read-only folder goes without a write attempt before the next one (`disk_pause`).
_WRITE_PAUSE_S = 60.0


def _expanded(directory: str | os.PathLike[str]) -> str:
    """The folder diskcache opens: it expands `~` and environment variables, so the checks must see the same."""
    return os.path.expandvars(os.path.expanduser(os.fspath(directory)))


def _open_index(directory: str, budget_bytes: int, timeout_s: float) -> tuple[GuardedIndex, BaseException | None]:
    """The guarded diskcache index over `directory`, or one ConfigError naming the folder, the reason and the fix.
    -> (index, None), or (an index opened for reads alone, the error) for a store whose filesystem is full: opening
    diskcache writes its settings, so the index opens on the first write that succeeds (`GuardedIndex`)."""
    diskcache = import_diskcache()
    needs_marker = claim_folder(directory)
    try:
        check_index(directory, timeout_s)
        index = GuardedIndex(directory, budget_bytes, timeout_s)
    except (OSError, sqlite3.Error, diskcache.Timeout) as exc:
        full = lasting_write_failure(exc) == "full"
        if not full or needs_marker or not os.path.isfile(os.path.join(directory, DB_NAME)):
            raise open_error(directory, exc, full=full) from exc
        try:  # a store on a full disk: what it holds is served; foreign tables are still refused
            check_index(directory, timeout_s, repair=False)
        except (OSError, sqlite3.Error) as again:
            raise open_error(directory, again, full=True) from again
        return GuardedIndex(directory, budget_bytes, timeout_s, opened=False), exc
    if needs_marker:
        try:
            write_marker(directory)
        except ConfigError:
            index.close()
            raise
    return index, None


def check_disk_dir(directory: str | os.PathLike[str]) -> None:
    """Open and close the disk tier's folder once, so a folder it refuses is reported before a model loads: the
    same checks as `DiskStore` (a new or empty folder, made a store, or a store; else a ConfigError with the fix)."""
    _open_index(_expanded(directory), 0, _TIMEOUT_S)[0].close()


class DiskStore(CountedTier):
    """Chunk KV in a local directory, at most `budget_bytes` of values and index (diskcache's `cache.db`), plus
    SQLite's log, which is checkpointed and cut back to 1 MiB (`disk_index.cache_settings`).

    `get` moves an entry to the most recently used end; `put` evicts the least recently used entries, one at a
    time, until the directory fits the budget again. A corrupt entry, or an index row this tier could not have
    written (a file name outside the folder, a symlink, a FIFO, text, a pickle, an inline value larger than it
    keeps inline), is deleted, logged and counted as a miss; an I/O or SQLite failure, a lock held by another
    process past `timeout_s`, or a schema object planted in the index, is logged and counted in `stats.errors`
    and is also a miss (or a lost put), never an exception or a hang. Reads are bounded by the size the entry's
    header declares. A hit `open` handed out and then discarded unread (the engine refusing its shape) is counted
    as a corrupt miss, not a hit. Safe to share between threads and processes.

    The folder must be new, empty, or a store (see `disk_folder`); anything else, or an unusable folder (a file,
    not writable, a damaged index), is a ConfigError at construction. A folder that fills up or turns read-only
    while the tier is open pauses its writes for `write_pause_s` seconds (`disk_pause`): puts are skipped and
    counted in `stats.skipped`, reads still serve what is stored, and each pause costs one failed write. A store
    whose filesystem is full already when it is opened opens the same way, its writes paused from the start.

    With `hmac_key`, entries are signed when written and entries without a valid signature are refused (misses).
    Entries are encoded with `codec` (`codec.py`). Each entry is kept under a name of the key, the codec and the
    signing key's digest (`serialize.stored_name`): a worker with another codec or signing key on the same folder
    keeps its own entries beside these, never reads or deletes them.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        budget_bytes: int = 20 * 1024**3,
        *,
        hmac_key: bytes | None = None,
        codec: str | KVCodec = TIER_CODEC,
        name: str = "disk",
        timeout_s: float = _TIMEOUT_S,
        write_pause_s: float = _WRITE_PAUSE_S,
    ) -> None:
        if budget_bytes < 0:
            raise ConfigError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        if not write_pause_s >= 0:
            raise ConfigError(f"write_pause_s must be >= 0 seconds, got {write_pause_s}")
        diskcache = import_diskcache()
        self.directory = _expanded(directory)
        super().__init__(name, f"disk tier {self.directory}", logger)
        self.budget_bytes = budget_bytes
        self.hmac_key = hmac_key
        self.timeout_s = timeout_s
        self.codec = get_codec(codec, "disk codec")
        self._index, full = _open_index(self.directory, budget_bytes, timeout_s)
        self._pause = WritePause(self.directory, write_pause_s)
        if full is not None:  # a full disk: start serving what is stored, with writes paused (one counted failure)
            self._count_failure(miss=False)
            self._pause.failed(full)
        # Failures of the backend itself, as opposed to bad data in it.
        self._backend_errors: tuple[type[BaseException], ...] = (OSError, sqlite3.Error, diskcache.Timeout)
        self._failed_calls = self._backend_errors

    @property
    def nbytes(self) -> int:
        """Bytes the directory takes, as diskcache counts them for its size limit (0 if the index fails)."""
        try:
            return self._index.volume()
        except self._backend_errors as exc:
            self._count_error("volume", "*" * 12, exc)
            return 0

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
        return self._hand_out(key, lazy)

    def _read_header(self, key: str) -> LazyChunkKV | None:
        """The entry with only its header read and checked (and its base's, for a dependent entry); None (counted)
        on a miss or a bad entry."""
        opened: list[OpenEntry | BaseReader] = []  # what must be closed if the entry turns out unusable
        try:
            entry = self._open_entry(key)
            if entry is None:
                self._count_miss()
                return None
            opened.append(entry)
            base = self._open_base(entry.layout.base) if entry.layout.base else None
            if base is not None:
                opened.append(base)
            lazy = LazyChunkKV(entry.layout, entry.read_ranges, close=entry.close, base=base)
        except (CorruptEntryError, *self._backend_errors) as exc:
            for reader in opened:
                reader.close()
            if isinstance(exc, CorruptEntryError):
                self._drop_corrupt(key, exc)
            else:
                self._count_error("get", key, exc)
            return None
        return lazy

    def _open_entry(self, key: str) -> OpenEntry | None:
        """The entry's header read and checked, its bytes left to read by range; None if it is not stored.
        Raises CorruptEntryError for a bad entry, and the backend's errors."""
        handle = None
        try:
            name = self.entry_name(key)
            inline, limit = self._index.inline_length(name), self._index.inline_limit
            if inline is not None and inline >= limit:  # checked before a byte of it is read
                raise CorruptEntryError(
                    f"entry {key[:12]} keeps {inline} bytes inside the index, where this tier keeps only values "
                    f"under {limit} bytes"
                )
            handle = None if inline is None else self._read(name)
            if handle is None:
                return None
            if type(handle) is bytes:  # a small value kept inside SQLite: already in memory
                data = memoryview(handle)
                layout = parse_layout(data, key, len(data), codec=self.codec, hmac_key=self.hmac_key)
                return OpenEntry(layout, lambda ranges: [data[a:b] for a, b in ranges], None)
            fd = handle.fileno()
            size = os.fstat(fd).st_size
            if size > max(self.budget_bytes, 1 << 20):
                raise CorruptEntryError(f"entry {key[:12]} is {size} bytes, more than the tier's budget")
            head = os.pread(fd, 8, 0)
            head += os.pread(fd, header_length(head, key) - 8, 8)
            layout = parse_layout(head, key, size, codec=self.codec, hmac_key=self.hmac_key)
            return OpenEntry(layout, lambda ranges: [os.pread(fd, b - a, a) for a, b in ranges], handle.close)
        except BaseException:
            if handle is not None and type(handle) is not bytes:
                handle.close()
            raise

    def _read(self, name: str) -> object:
        """The bytes or open value file of the entry kept as `name`, moved to the most recently used end unless
        writes are paused."""
        if not self._pause.paused:
            try:
                return self._index.read(name)
            except self._backend_errors as exc:
                if not self._pause.failed(exc):
                    raise
                self._count_error("LRU update", name, exc, miss=False)
        return self._index.peek(name)

    def _skipped(self) -> bool:
        """True (counted) when writes are paused: the caller makes none."""
        if not self._pause.paused:
            return False
        with self._lock:
            self.stats.skipped += 1
        return True

    def put(self, kv: ChunkKV) -> None:
        if self._skipped():
            return
        try:
            data = self._entry_bytes(kv)
        except NonFiniteKVError as exc:
            logger.warning("%s", exc)
            return
        try:
            if len(data) > self.budget_bytes:
                # Storing it would evict everything else and then itself; drop any older copy instead.
                self._index.delete(self.entry_name(kv.key))
                return
            evicted = self._index.put(self.entry_name(kv.key), data)  # a failed put deletes the value file it wrote
        except self._backend_errors as exc:
            self._count_error("put", kv.key, exc)
            self._pause.failed(exc)
            return
        with self._lock:
            self.stats.puts += 1
            self.stats.evictions += evicted
        self._pause.succeeded()

    def _base_read_failed(self, key: str, exc: BaseException) -> None:
        self._count_error("base read", key, exc, miss=False)

    def _delete(self, key: str) -> None:
        if self._skipped():
            return
        try:
            self._index.delete(self.entry_name(key))
        except self._backend_errors as exc:
            self._count_error("delete", key, exc)
            self._pause.failed(exc)

    def clear(self) -> None:
        try:
            self._index.clear()
        except self._backend_errors as exc:
            self._count_error("clear", "*" * 12, exc)

    def flush(self) -> None:
        """Nothing to wait for: `put` writes through to the folder before it returns."""

    def close(self) -> None:
        self._index.close()

    def _has_entry(self, key: str, name: str) -> bool:
        try:
            return self._index.inline_length(name) is not None
        except self._backend_errors:
            return False

    def __len__(self) -> int:
        try:
            return self._index.count()
        except self._backend_errors:
            return 0

    def _count_error(self, op: str, key: str, exc: BaseException, *, miss: bool | None = None) -> None:
        logger.warning("disk tier %s: %s of chunk %s failed: %s", self.directory, op, key[:12], exc)
        self._count_failure(miss=op == "get" if miss is None else miss)
