"""The disk tier's pause on writes, for a folder that is full or has turned read-only while the tier serves.

Such a folder fails every write the same way until someone frees space or remounts it, and each failed write
still costs work (serializing the entry, writing a value file until the disk refuses it, a SQLite transaction).
So once a write fails with ENOSPC, EDQUOT or EROFS (or SQLite's "database or disk is full" / "attempt to write a
readonly database"), the tier makes no write for `pause_s` seconds: puts are skipped and counted, reads skip the
LRU touch (itself a write) and still serve what is stored. The first write after the pause tries again. One log
line says the folder is full or read-only, and one that it takes writes again; any other failure (a damaged file,
a lock held too long) is not a lasting state and pauses nothing.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import threading
import time

logger = logging.getLogger(__name__)

_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_SQLITE_READONLY, _SQLITE_FULL = 8, 13  # SQLite's primary result codes


def lasting_write_failure(exc: BaseException | None) -> str | None:
    """Why the folder takes no writes now ("full" or "read-only"), read from `exc` or an exception it was raised
    from; None for any other failure."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return "full"
        if isinstance(exc, OSError) and exc.errno == errno.EROFS:
            return "read-only"
        if isinstance(exc, sqlite3.Error):
            code = getattr(exc, "sqlite_errorcode", None)
            primary = code & 0xFF if isinstance(code, int) else None
            text = str(exc).lower()
            if primary == _SQLITE_FULL or "disk is full" in text:
                return "full"
            if primary == _SQLITE_READONLY or "readonly database" in text or "read-only" in text:
                return "read-only"
        exc = exc.__cause__ or exc.__context__  # diskcache raises its Timeout from a failed BEGIN
    return None


class WritePause:
    """Whether the tier writes now; `failed` starts a pause for a lasting failure, `succeeded` ends the episode."""

    def __init__(self, where: str, pause_s: float) -> None:
        self.where = where
        self.pause_s = pause_s
        self._until = 0.0  # time.monotonic() before which no write is tried
        self._reason: str | None = None  # "full" or "read-only" from the first failure until a write succeeds
        self._lock = threading.Lock()

    @property
    def paused(self) -> bool:
        return time.monotonic() < self._until

    def failed(self, exc: BaseException) -> bool:
        """Pause writes if `exc` is a full or read-only folder (-> True); any other failure -> False."""
        reason = lasting_write_failure(exc)
        if reason is None:
            return False
        with self._lock:
            self._until = time.monotonic() + self.pause_s
            first, self._reason = self._reason is None, reason
        if first:
            logger.warning(
                "disk tier %s is %s (%s): pausing its writes for %.0f s at a time until one succeeds; stored "
                "entries are still read, new ones are recomputed and kept in the other tiers",
                self.where,
                reason,
                exc,
                self.pause_s,
            )
        return True

    def succeeded(self) -> None:
        if self._reason is None:  # the common case: no lock taken
            return
        with self._lock:
            was, self._reason = self._reason, None
        if was is not None:
            logger.warning("disk tier %s takes writes again (it was %s)", self.where, was)
