"""The disk tier's guard between diskcache's index (`cache.db`) and the files it names.

diskcache keeps each large value in a file and stores the file's name in a row of its SQLite index; reading or
evicting the entry opens or deletes `directory/<that name>`. Whoever can write the folder can write that row, so
the name is untrusted input: `SafeBytesDisk` opens or deletes a value file only when its name has exactly the form
diskcache itself writes (`ab/cd/<28 hex digits>.val`), no component is a symlink, and the file is a regular file.
Anything else is a `CorruptEntryError` (on a read) or left alone (on a delete): no file outside the folder is ever
read or removed, and a FIFO or device never blocks a reader. Writes go the same way: each value folder level must
be a real folder (a symlink planted in place of `35/` fails the write, it is never followed), and a write that
fails (a full disk) deletes its partial file. Inside one of the tier's transactions (`begin` .. `end`), the value
files diskcache deletes are deleted once it commits, and the one written for a row that was not committed is
deleted instead. Values are bytes only; nothing is ever unpickled.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import re
import sqlite3
import stat
import threading
from typing import Any, BinaryIO

from ...errors import CorruptEntryError

logger = logging.getLogger(__name__)

# What diskcache's `Disk.filename` generates: two levels of two hex digits, then 28 hex digits and ".val".
_VALUE_NAME = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # POSIX; 0 elsewhere (the lstat checks below still refuse symlinks)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO for reading must not wait for a writer
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def import_diskcache() -> Any:
    try:
        import diskcache
    except ImportError as exc:
        raise ImportError("the disk tier needs diskcache; install it with `pip install 'diskcache>=5.6'`") from exc
    return diskcache


def _checked_name(filename: object) -> list[str]:
    """The components of a value file name diskcache could have written, or CorruptEntryError."""
    if type(filename) is not str or _VALUE_NAME.fullmatch(filename) is None:
        raise CorruptEntryError(f"the index names the value file {str(filename)[:80]!r}, which this tier never writes")
    return filename.split("/")


def open_value_file(directory: str, filename: object) -> BinaryIO:
    """Open a value file for reading, refusing anything but a regular file at a name diskcache writes."""
    parts = _checked_name(filename)
    fd = os.open(directory, os.O_RDONLY | _DIRECTORY)
    try:
        for sub in parts[:-1]:  # each folder level must be a real folder, not a symlink out of the tier
            nxt = os.open(sub, os.O_RDONLY | _DIRECTORY | _NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        if stat.S_ISLNK(os.lstat(parts[-1], dir_fd=fd).st_mode):
            raise CorruptEntryError(f"value file {filename} is a symlink")
        file_fd = os.open(parts[-1], os.O_RDONLY | _NOFOLLOW | _NONBLOCK, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a symlink where a folder or file should be
            raise CorruptEntryError(f"value file {filename} is reached through a symlink") from exc
        raise
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(file_fd).st_mode):
        os.close(file_fd)
        raise CorruptEntryError(f"value file {filename} is not a regular file (a FIFO, device or folder)")
    os.set_blocking(file_fd, True)
    return os.fdopen(file_fd, "rb", buffering=0)


def write_value_file(directory: str, filename: str, data: bytes) -> None:
    """Write `data` to the new value file `filename` (a name diskcache drew), making its folders as needed.

    A folder level that is a symlink or a file is an OSError, never followed. On any failure the partial file is
    deleted before the error propagates.
    """
    parts = _checked_name(filename)
    for attempt in range(10):  # another process may delete an emptied value folder between our steps
        fd = os.open(directory, os.O_RDONLY | _DIRECTORY)
        try:
            for sub in parts[:-1]:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(sub, 0o755, dir_fd=fd)
                try:
                    nxt = os.open(sub, os.O_RDONLY | _DIRECTORY | _NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise OSError(exc.errno, f"value folder {sub!r} of {filename} is a symlink or a file") from exc
                    raise
                os.close(fd)
                fd = nxt
            try:
                out = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644, dir_fd=fd)
            except FileNotFoundError:
                if attempt == 9:
                    raise
                continue
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(out, view) :]
            except BaseException:
                os.close(out)
                with contextlib.suppress(OSError):
                    os.unlink(parts[-1], dir_fd=fd)
                raise
            os.close(out)
            return
        finally:
            os.close(fd)


class _Pending(threading.local):
    written: str | None = None  # the value file `store` wrote in this thread's open transaction
    removals: list[str] | None = None  # value files to delete when that transaction commits; None: none is open


@functools.cache
def safe_bytes_disk() -> type:
    """A diskcache `Disk` that stores and returns only `bytes` and follows only value file names it wrote."""
    diskcache = import_diskcache()
    core = diskcache.core

    class SafeBytesDisk(diskcache.Disk):
        def __init__(self, directory: str, **kwargs: Any) -> None:
            super().__init__(directory, **kwargs)
            self.folder = directory
            self.pending = _Pending()

        def store(self, value: Any, read: bool, key: Any = core.UNKNOWN) -> Any:
            """-> (size, mode, filename, value) columns: small values inline, others in a new value file."""
            if type(value) is not bytes:
                raise TypeError(f"the disk tier stores bytes only, got {type(value).__name__}")
            if len(value) < self.min_file_size:
                return 0, core.MODE_RAW, None, sqlite3.Binary(value)
            filename, _ = self.filename(key, value)
            write_value_file(self.folder, filename, value)
            self.pending.written = filename
            return len(value), core.MODE_BINARY, filename, None

        def begin(self) -> None:
            """A transaction opens on this thread: the value files deleted in it wait for `end`."""
            self.pending.written, self.pending.removals = None, []

        def end(self, committed: bool) -> list[str]:
            """-> the files to delete now: those deleted in the transaction, or the one its rolled-back row named."""
            written, removals = self.pending.written, self.pending.removals or []
            self.pending.written = self.pending.removals = None
            return removals if committed else [written] if written is not None else []

        def fetch(self, mode: int, filename: str | None, value: Any, read: bool) -> Any:
            """-> the value's bytes (kept inline in SQLite) or an open regular file (kept as a file).

            Any row this tier could not have written raises CorruptEntryError, so the store drops it.
            """
            if mode == core.MODE_RAW:
                if type(value) in (bytes, sqlite3.Binary, memoryview):
                    return bytes(value)
                raise CorruptEntryError(f"an inline value is a {type(value).__name__}, not bytes")
            if mode == core.MODE_BINARY:
                return open_value_file(self.folder, filename)
            if mode == core.MODE_PICKLE:
                raise CorruptEntryError("a pickled value was found in the disk tier; it is not loaded")
            raise CorruptEntryError(f"a value stored in mode {mode!r}; this tier writes raw bytes or files only")

        def remove(self, file_path: str) -> None:
            if self.pending.removals is not None:  # its row is deleted only once the transaction commits
                self.pending.removals.append(file_path)
                return
            try:
                _checked_name(file_path)
            except CorruptEntryError:
                logger.warning("disk tier %s: not deleting %r, a name it never writes", self.folder, file_path)
                return
            folder = os.path.join(self.folder, os.path.dirname(file_path))
            if any(os.path.islink(p) for p in (folder, os.path.dirname(folder))):
                logger.warning("disk tier %s: not deleting %r, reached through a symlink", self.folder, file_path)
                return
            super().remove(file_path)

    return SafeBytesDisk
