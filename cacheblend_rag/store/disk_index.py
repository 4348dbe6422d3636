"""The disk tier's guard on diskcache's SQLite index, `cache.db`, which whoever can write the folder can edit.

diskcache obeys what it finds there: its `Settings` rows become attributes, constructor arguments and per-connection
pragmas (a `locking_mode` that locks every other process out, a text where a number belongs), and SQLite runs any
trigger or view stored in it on the tier's own calls. So before diskcache opens the index, `check_index`:

- refuses (ConfigError) tables diskcache never makes, and a `Cache` or `Settings` table of another definition:
  the database is not a diskcache index, and its data is left as it is;
- drops every trigger, view and index diskcache never makes (diskcache re-creates its own);
- deletes `Settings` rows diskcache never writes and recounts the entry count and volume from the `Cache` table.

Then `cache_settings` passes every setting explicitly, so no stored value is used, and `GuardedCache` opens every
connection itself: never through a symlinked `cache.db`, with this module's pragmas rather than the stored ones,
and with a progress handler that interrupts a statement once the calling thread's deadline (`bounded`) has passed,
so a trigger planted while the tier is open makes a failed call (a counted miss), never a hang.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..errors import ConfigError
from .disk_files import import_diskcache

DB_NAME = "cache.db"
_PROGRESS_STEPS = 1000  # SQLite VM steps between two deadline checks (well under a millisecond)


def cache_settings(budget_bytes: int) -> dict[str, Any]:
    """Every diskcache setting, explicitly: passed at open, they override whatever `Settings` rows say."""
    core = import_diskcache().core
    settings = dict(core.DEFAULT_SETTINGS)
    settings.update(
        size_limit=budget_bytes,
        eviction_policy="least-recently-used",
        # diskcache evicts up to `cull_limit` least recently used entries whenever a set leaves the directory
        # over budget; its default of ten can throw out the entry just written when the cache holds few.
        cull_limit=1,
        # SQLite's write-ahead log lives beside the index and is not in diskcache's volume: checkpoint it every
        # 256 pages (1 MiB) and cut it back to 1 MiB after each checkpoint, so the folder stays within the budget
        # plus about 1 MiB.
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
            rows = db.execute("SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL").fetchall()
    return frozenset((str(t), str(n), str(s)) for t, n, s in rows)


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def check_index(directory: str, timeout_s: float) -> None:
    """Refuse, drop or reset what diskcache did not put in `directory/cache.db` (see the module docstring).

    Raises ConfigError for foreign tables, sqlite3 errors for a damaged or locked database.
    """
    path = os.path.join(directory, DB_NAME)
    if not os.path.exists(path):
        return
    reference = _reference_schema()
    known_settings = set(import_diskcache().core.DEFAULT_SETTINGS) | set(import_diskcache().core.METADATA)
    deadline = time.monotonic() + 4 * timeout_s
    with contextlib.closing(sqlite3.connect(path, timeout=timeout_s, isolation_level=None)) as db:
        db.set_progress_handler(lambda: int(time.monotonic() > deadline), _PROGRESS_STEPS)
        db.execute("BEGIN IMMEDIATE")
        try:
            rows = db.execute("SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL").fetchall()
            ours = {(str(t), str(n), str(s)) for t, n, s in rows} & reference
            foreign = [(t, n) for t, n, s in rows if (str(t), str(n), str(s)) not in ours]
            tables = sorted(n for t, n in foreign if t == "table")
            if tables:
                raise ConfigError(
                    f"the disk tier folder {directory!r} cannot be used: its {DB_NAME} holds tables that diskcache "
                    f"never makes ({', '.join(map(repr, tables[:5]))}), so it is not the tier's index; delete the "
                    "folder if it held only a cache, or give an empty or new folder"
                )
            for kind, name in foreign:  # triggers and views run on the tier's calls; extra indexes slow them
                db.execute(f"DROP {kind.upper()} IF EXISTS {_quoted(name)}")
            if any(t == "table" and n == "Settings" for t, n, _ in ours):
                marks = ", ".join("?" * len(known_settings))
                db.execute(f"DELETE FROM Settings WHERE key NOT IN ({marks})", sorted(known_settings))
                if any(t == "table" and n == "Cache" for t, n, _ in ours):
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


class _Deadline(threading.local):
    at = math.inf  # time.monotonic() after which this thread's SQLite statements are interrupted


@functools.cache
def guarded_cache() -> type:
    """diskcache's `Cache`, opening its own connections and bounding every statement by the caller's deadline.

    It overrides diskcache internals (`_con`, and `reset` for the counters), which is why diskcache is pinned <6.
    """
    diskcache = import_diskcache()
    core = diskcache.core

    class GuardedCache(diskcache.Cache):
        def __init__(self, directory: str, *, timeout_s: float, **settings: Any) -> None:
            self._deadline = _Deadline()
            self._db_path = os.path.join(directory, DB_NAME)
            self._pragmas = {k: v for k, v in settings.items() if k.startswith("sqlite_")}
            super().__init__(directory, timeout=timeout_s, **settings)

        @property
        def _con(self) -> sqlite3.Connection:
            # diskcache's own fork check: a child process opens its own connections.
            if getattr(self._local, "pid", None) != os.getpid():
                self.close()
                self._local.pid = os.getpid()
            con = getattr(self._local, "con", None)
            if con is None:
                for path in (self._db_path, self._db_path + "-wal", self._db_path + "-shm"):
                    if os.path.islink(path):  # planted after open: SQLite would follow it out of the folder
                        raise sqlite3.OperationalError(f"{path} is a symlink; the disk tier never makes one")
                con = sqlite3.connect(self._db_path, timeout=self._timeout, isolation_level=None)
                con.set_progress_handler(self._over_time, _PROGRESS_STEPS)
                self._local.con = con
                for key, value in self._pragmas.items():  # ours, never the `Settings` rows
                    self.reset(key, value, update=False)
            return con

        def _over_time(self) -> int:
            if time.monotonic() <= self._deadline.at:
                return 0
            self._deadline.at = math.inf  # interrupt once: the rollback that follows must run
            return 1

        @contextlib.contextmanager
        def bounded(self, seconds: float) -> Iterator[None]:
            """Interrupt this thread's SQLite statements (sqlite3.OperationalError) after `seconds` from now."""
            outer = self._deadline.at
            self._deadline.at = min(outer, time.monotonic() + seconds)
            try:
                yield
            finally:
                self._deadline.at = outer

        def reset(self, key: str, value: Any = core.ENOVAL, update: bool = True) -> Any:
            result = super().reset(key, value, update)
            if key in core.METADATA and type(result) is not int:  # a counter row edited behind the tier's back
                raise sqlite3.DataError(f"the Settings row {key!r} of {self._db_path} holds {result!r}, not a count")
            return result

        def set(self, key: Any, value: Any, **kwargs: Any) -> Any:
            """diskcache's `set`; when its row is not stored, the value file it wrote is deleted too."""
            self._disk.take_written()
            try:
                return super().set(key, value, **kwargs)
            except BaseException:
                written = self._disk.take_written()
                if written is not None:
                    self._disk.remove(written)
                raise

        def peek(self, key: str) -> Any:
            """`get(key, read=True)` without moving the entry to the most recently used end, which is a write
            (refused by a full or read-only folder): its bytes, an open value file, or None."""
            db_key, raw = self._disk.put(key)
            select = (
                "SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = ?"
                " AND (expire_time IS NULL OR expire_time > ?)"
            )
            rows = self._sql(select, (db_key, raw, time.time())).fetchall()
            if not rows:
                return None
            ((mode, filename, value),) = rows
            try:
                return self._disk.fetch(mode, filename, value, True)
            except OSError:  # the file went with its entry, deleted by another process since the select
                return None

        def inline_length(self, key: str) -> int | None:
            """Bytes of `key`'s value kept inside the index (0 for one kept in a file); None: no such entry.

            SQLite reads a blob's length from its row header, so this costs the same for 1 byte or 1 GB.
            """
            db_key, raw = self._disk.put(key)
            rows = self._sql("SELECT length(value) FROM Cache WHERE key = ? AND raw = ?", (db_key, raw)).fetchall()
            return None if not rows else int(rows[0][0] or 0)

    return GuardedCache


def open_error(directory: str, exc: BaseException) -> ConfigError:
    """The ConfigError for a folder whose index could not be opened, with the fix that fits `exc`."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        fix = "it is a file; give a folder path"
    elif isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
        fix = f"its {DB_NAME} is damaged; delete the folder (it holds only a cache) or give another one"
    else:
        fix = "make it writable by this user, or give another folder"
    return ConfigError(f"the disk tier folder {directory!r} cannot be used ({exc}): {fix}")
