"""Counters of the tiers that hold serialized entries (disk, Redis), which can also meet bad data and outages."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import StoreStats

if TYPE_CHECKING:
    from .lazy import LazyChunkKV


@dataclass
class TierStats(StoreStats):
    corrupt: int = 0  # entries that failed to decode, were dropped and counted as misses
    errors: int = 0  # operations the backend failed (I/O error, Redis unreachable); each one is a miss or a lost put
    skipped: int = 0  # writes not tried while the tier pauses them (a full or read-only disk folder): lost puts

    def refused_hit(self, nbytes: int) -> None:
        """A hit `open` counted was refused before a layer of it was read: a corrupt miss after all."""
        self.hits -= 1
        self.bytes_read -= nbytes
        self.misses += 1
        self.corrupt += 1


class UnreadHits:
    """The readers `open` handed out that no layer has been read from yet, by key.

    The engine checks a hit's shape and dtype before it reads a layer and discards an entry that does not fit;
    `refused(key)` on that discard tells the tier the hit it counted was no hit. Readers are held weakly: one the
    caller dropped is forgotten.
    """

    def __init__(self) -> None:
        self._readers: weakref.WeakValueDictionary[str, LazyChunkKV] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def handed_out(self, key: str, reader: LazyChunkKV) -> None:
        with self._lock:
            self._readers[key] = reader

    def forget(self, key: str) -> None:
        with self._lock:
            self._readers.pop(key, None)

    def refused(self, key: str) -> LazyChunkKV | None:
        """The reader handed out for `key` if none of it has been read (forgotten now); None otherwise."""
        with self._lock:
            reader = self._readers.pop(key, None)
        return reader if reader is not None and reader.bytes_read == 0 else None
