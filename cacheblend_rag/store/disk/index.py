"""The disk tier's guard on diskcache's SQLite index, `cache.db`, which whoever can write the folder can edit.

diskcache obeys what it finds there: its `Settings` rows become attributes, constructor arguments and per-connection
pragmas (a `locking_mode` that locks every other process out, a text where a number belongs), and SQLite runs any
trigger or view stored in it on the tier's own calls. So before diskcache opens the index, `check_index`:

- refuses (ConfigError) tables diskcache never makes, and a `Cache` or `Settings` table of another definition:
  the database is not a diskcache index, and its data is left as it is;
- drops every trigger, view and index diskcache never makes (diskcache re-creates its own);
- deletes `Settings` rows diskcache never writes and recounts the entry count and volume from the `Cache` table.

Then `cache_settings` passes every setting explicitly, so no stored value is used, and `GuardedIndex` calls diskcache
through its public API only, adding what that API lacks. Each change is one `Cache.transact()` that first checks,
under its write lock, that no schema object was planted since (one makes the call fail until the folder is opened
again). Before diskcache opens a thread's connection, which applies the `sqlite_*` rows of `Settings` as pragmas,
those rows must be the tier's and no `cache.db*` a symlink; the tier's pragmas are set on it again. Reads that must
not write run on the tier's own read-only connection, interrupted after `timeout_s`; they name columns of the
`Cache` table, which `_reference_schema` checks the installed diskcache makes. Eviction is the tier's own.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from ...errors import ConfigError
from .files import import_diskcache, safe_bytes_disk

DB_NAME = "cache.db"
_PROGRESS_STEPS = 1000  # SQLite VM steps between two deadline checks (well under a millisecond)
_SCHEMA = "SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL"
_COLUMNS = frozenset({"rowid", "key", "raw", "access_time", "expire_time", "mode", "filename", "value"})  # we read


def cache_settings(budget_bytes: int) -> dict[str, Any]:
    """Every diskcache setting, explicitly: passed at open, they override whatever `Settings` rows say."""
    core = import_diskcache().core
    settings = dict(core.DEFAULT_SETTINGS)
    settings.update(
        size_limit=budget_bytes,
        eviction_policy="least-recently-used",
        # diskcache's own cull evicts `cull_limit` entries at once (ten by default, which can throw out the entry
        # just written); the tier evicts one at a time itself (`GuardedIndex.put`).
        cull_limit=0,
        # SQLite's write-ahead log is not in diskcache's volume: checkpoint it every 256 pages (1 MiB) and cut it
        # back to 1 MiB after each checkpoint, so the folder stays within the budget plus about 1 MiB.
        sqlite_wal_autocheckpoint=256,
        sqlite_journal_size_limit=2**20,
        statistics=0,
        tag_index=0,
    )
    return settings


@functools.cache
def _reference_schema() -> frozenset[tuple[str, str, str]]:
    """(type, name, sql) of every schema object diskcache makes for this tier, read from a scratch index."""
    diskcache = import_diskcache()
    with tempfile.TemporaryDirectory(prefix="cacheblend-schema-") as scratch:
        diskcache.Cache(scratch, **cache_settings(0)).close()
        with contextlib.closing(sqlite3.connect(os.path.join(scratch, DB_NAME))) as db:
            rows = db.execute(_SCHEMA).fetchall()
            missing = _COLUMNS - {str(row[1]) for row in db.execute("PRAGMA table_info(Cache)")}
    if missing:
        raise ConfigError(f"diskcache {diskcache.__version__}'s index lacks the columns {sorted(missing)}: pin 5.6")
    return frozenset((str(t), str(n), str(s)) for t, n, s in rows)


def _foreign(rows: list[Any]) -> list[tuple[str, str]]:
    """(type, name) of the schema objects among `rows` of `_SCHEMA` that diskcache never makes for this tier."""
    reference = _reference_schema()
    return [(str(t), str(n)) for t, n, s in rows if (str(t), str(n), str(s)) not in reference]


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def check_index(directory: str, timeout_s: float, *, repair: bool = True) -> None:
    """Refuse, drop or reset what diskcache did not put in `directory/cache.db` (see the module docstring); without
    `repair` (a full disk: no write can be made), only refuse foreign tables.

    Raises ConfigError for foreign tables, sqlite3 errors for a damaged or locked database.
    """
    path = os.path.join(directory, DB_NAME)
    if not os.path.exists(path):
        return
    known_settings = set(import_diskcache().core.DEFAULT_SETTINGS) | set(import_diskcache().core.METADATA)
    deadline = time.monotonic() + 4 * timeout_s
    with contextlib.closing(sqlite3.connect(path, timeout=timeout_s, isolation_level=None)) as db:
        db.set_progress_handler(lambda: int(time.monotonic() > deadline), _PROGRESS_STEPS)
        db.execute("BEGIN IMMEDIATE" if repair else "BEGIN")
        try:
            rows = db.execute(_SCHEMA).fetchall()
            foreign = _foreign(rows)
            ours = {(str(t), str(n)) for t, n, _ in rows} - set(foreign)
            tables = sorted(n for t, n in foreign if t == "table")
            if tables:
                raise ConfigError(
                    f"the disk tier folder {directory!r} cannot be used: its {DB_NAME} holds tables that diskcache "
                    f"never makes ({', '.join(map(repr, tables[:5]))}), so it is not the tier's index; delete the "
                    "folder if it held only a cache, or give an empty or new folder"
                )
            if not repair:  # what is left runs only on writes (triggers) or when diskcache opens (settings)
                foreign = []
                ours = set()
            for kind, name in foreign:  # triggers and views run on the tier's calls; extra indexes slow them
                db.execute(f"DROP {kind.upper()} IF EXISTS {_quoted(name)}")
            if ("table", "Settings") in ours:
                marks = ", ".join("?" * len(known_settings))
                db.execute(f"DELETE FROM Settings WHERE key NOT IN ({marks})", sorted(known_settings))
                if ("table", "Cache") in ours:
                    db.execute("UPDATE Settings SET value = (SELECT count(*) FROM Cache) WHERE key = 'count'")
                    db.execute(
                        "UPDATE Settings SET value = (SELECT coalesce(sum(size), 0) FROM Cache) WHERE key = 'size'"
                    )
                db.execute("UPDATE Settings SET value = 0 WHERE key IN ('hits', 'misses')")
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise


class _Thread(threading.local):
    pid = -1  # the process that opened `reader` (a forked child opens its own)
    reader: sqlite3.Connection | None = None  # the tier's own read-only connection
    ready = False  # diskcache's connection on this thread was opened after the checks and has the tier's pragmas
    deadline = 0.0  # time.monotonic() after which the statement running on `reader` is interrupted


class GuardedIndex:
    """diskcache's `Cache` (`cache`) with the guards of the module docstring. Methods raise OSError, sqlite3.Error
    or diskcache.Timeout, and wait at most `timeout_s` on a lock or on one read of the tier's own.

    With `opened=False` (a folder on a full disk, where diskcache's open, which writes its settings, fails), the
    index starts on reads alone: `peek`, `inline_length`, `count` and `volume` run on the tier's own read-only
    connection, and the first write checks and opens the index (`cache`) then, raising what that open raises."""

    def __init__(self, directory: str, budget_bytes: int, timeout_s: float, *, opened: bool = True) -> None:
        settings = cache_settings(budget_bytes)
        self.directory, self.budget_bytes, self.timeout_s = directory, budget_bytes, timeout_s
        self._settings = settings
        self._db_path = os.path.join(directory, DB_NAME)
        self._pragmas = {k: v for k, v in settings.items() if k.startswith("sqlite_")}
        self._thread = _Thread()
        self._clean_schema = -1  # the last schema_version seen holding only diskcache's schema objects
        self._cache: Any = None  # diskcache's Cache, once opened
        self._opening = threading.Lock()
        disk_options = {k[5:]: v for k, v in settings.items() if k.startswith("disk_")}
        self.disk: Any = safe_bytes_disk()(directory, **disk_options)  # reads: key encoding and value files
        self.inline_limit: int = self.disk.min_file_size  # values this long and longer are kept as files
        if opened:
            self._open(checked=True)

    @property
    def cache(self) -> Any:
        """diskcache's Cache over the folder, opened (after `check_index`) on first use if it was not at start."""
        if self._cache is None:
            self._open(checked=False)
        return self._cache

    def _open(self, *, checked: bool) -> None:
        with self._opening:
            if self._cache is not None:
                return
            if not checked:
                check_index(self.directory, self.timeout_s)
            diskcache = import_diskcache()
            cache = diskcache.Cache(self.directory, timeout=self.timeout_s, disk=safe_bytes_disk(), **self._settings)
            self._cache, self.disk = cache, cache.disk  # its writes track their value files on its own disk

    def _query(self, statement: str, args: Any = ()) -> list[Any]:
        """The rows of one read on the tier's own connection, interrupted after `timeout_s`."""
        thread = self._thread
        if thread.pid != os.getpid():  # a forked child: the parent's connections are not to be used
            thread.pid, thread.reader, thread.ready = os.getpid(), None, False
        thread.deadline = time.monotonic() + self.timeout_s  # each statement on `reader` comes through here
        if thread.reader is None:
            self._refuse_symlinks()
            thread.reader = sqlite3.connect(self._db_path, timeout=self.timeout_s, isolation_level=None)
            thread.reader.set_progress_handler(lambda: int(time.monotonic() > thread.deadline), _PROGRESS_STEPS)
            thread.reader.execute("PRAGMA query_only = 1")
        return thread.reader.execute(statement, args).fetchall()

    def _refuse_symlinks(self) -> None:
        for path in (self._db_path, self._db_path + "-wal", self._db_path + "-shm"):
            if os.path.islink(path):  # planted after open: SQLite would follow it out of the folder
                raise sqlite3.OperationalError(f"{path} is a symlink; the disk tier never makes one")

    def _ready(self) -> None:
        """Check what diskcache's connection on this thread would obey before it opens, then set our pragmas."""
        if self._thread.ready and self._thread.pid == os.getpid():
            return
        for key, value in self._query("SELECT key, value FROM Settings WHERE substr(key, 1, 7) = 'sqlite_'"):
            ours = self._pragmas.get(key)
            if ours is None or (type(value) is not int if type(ours) is int else value != ours):
                raise sqlite3.DataError(f"the Settings row {key!r} of {self._db_path} holds {value!r}: not the tier's")
        self._refuse_symlinks()
        for key, value in self._pragmas.items():  # opens diskcache's connection on this thread
            self.cache.reset(key, value, update=False)
        self._thread.ready = True

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """One transaction, on a schema checked inside it; the value files it writes or deletes follow its outcome."""
        self._ready()
        disk, committed = self.cache.disk, False
        disk.begin()
        try:
            with self.cache.transact():
                ((version,),) = self._query("PRAGMA schema_version")
                if version != self._clean_schema:
                    planted = _foreign(self._query(_SCHEMA))
                    if planted:
                        msg = f"{self._db_path} holds {planted[:5]}, which diskcache never makes: planted since open"
                        raise sqlite3.IntegrityError(msg + "; writes fail until the folder is opened again")
                    self._clean_schema = version
                yield
            committed = True
        finally:
            for name in disk.end(committed):
                disk.remove(name)

    def put(self, key: str, data: bytes) -> int:
        """Store `data`, then evict least recently used entries one by one until the folder fits -> how many."""
        with self._writing():
            self.cache.set(key, data)
            evicted, victims = 0, self._by_last_use(key)
            while self.volume() > self.budget_bytes and (victim := next(victims, None)) is not None:
                evicted += int(self.cache.delete(victim))
            return evicted

    def _by_last_use(self, last: str) -> Iterator[Any]:
        select = "SELECT key FROM Cache WHERE raw = 1 AND key != ? ORDER BY access_time, rowid LIMIT 16 OFFSET ?"
        offset = 0
        while rows := self._query(select, (last, offset)):  # as committed: this transaction's changes unseen
            yield from (key for (key,) in rows)
            offset += len(rows)
        yield last

    def read(self, key: str) -> Any:
        """`key`'s bytes or open value file, moved to the most recently used end (a write); None: no entry."""
        handle = None
        try:
            with self._writing():
                handle = self.cache.get(key, read=True)
        except BaseException:
            if handle is not None and type(handle) is not bytes:
                handle.close()
            raise
        return handle

    def peek(self, key: str) -> Any:
        """Like `read`, without moving the entry, which is a write (refused by a full or read-only folder)."""
        select = "SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = ? AND coalesce(expire_time > ?, 1)"
        rows = self._query(select, (*self.disk.put(key), time.time()))
        if not rows:
            return None
        try:
            return self.disk.fetch(*rows[0], True)
        except OSError:  # the file went with its entry, deleted by another process since the select
            return None

    def inline_length(self, key: str) -> int | None:
        """Bytes of `key`'s value kept inside the index (0: in a file; None: no entry), read from its row header."""
        rows = self._query("SELECT length(value) FROM Cache WHERE key = ? AND raw = ?", self.disk.put(key))
        return None if not rows else int(rows[0][0] or 0)

    def delete(self, key: str) -> None:
        with self._writing():
            self.cache.delete(key)

    def clear(self) -> None:
        with self._writing():
            self.cache.clear()

    def volume(self) -> int:
        """Bytes of the index and the values, as diskcache counts them for its size limit."""
        if self._cache is None:  # not opened (a full disk): the same sum, read on the tier's own connection
            ((pages,),) = self._query("PRAGMA page_count")
            ((page_size,),) = self._query("PRAGMA page_size")
            size = self._query("SELECT value FROM Settings WHERE key = 'size'")
            return int(pages) * int(page_size) + (int(size[0][0]) if size and type(size[0][0]) is int else 0)
        self._ready()
        try:
            return int(self.cache.volume())
        except TypeError as exc:  # its `size` row holds text or a blob
            raise sqlite3.DataError(f"the Settings row 'size' of {self._db_path} is not a count") from exc

    def count(self) -> int:
        return int(self._query("SELECT count(*) FROM Cache")[0][0])

    def close(self) -> None:
        """Close this thread's connections (diskcache's and the tier's own)."""
        if self._cache is not None:
            self._cache.close()
        reader, self._thread.reader, self._thread.ready = self._thread.reader, None, False
        if reader is not None:
            reader.close()


def open_error(directory: str, exc: BaseException, *, full: bool = False) -> ConfigError:
    """The ConfigError for a folder whose index could not be opened, with the fix that fits `exc`."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        fix = "it is a file; give a folder path"
    elif isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
        fix = f"its {DB_NAME} is damaged; delete the folder (it holds only a cache) or give another one"
    elif full:
        fix = "its filesystem is full; free space on it, or give a folder on another filesystem"
    else:
        fix = "make it writable by this user, or give another folder"
    return ConfigError(f"the disk tier folder {directory!r} cannot be used ({exc}): {fix}")
