"""What the tiers that hold serialized entries (disk, Redis) count the same way, and the base class that counts it.

Both can meet bad data and outages, both hand out hits read layer by layer, and both count a hit the caller refuses
unread as a corrupt miss. `CountedTier` holds that bookkeeping once; each tier adds only how it reads, writes and
deletes entries and how it logs a failed call.
"""

from __future__ import annotations

import logging
import threading
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import CorruptEntryError, EntryGoneError, OrphanedEntryError
from .base import Hit, StoreStats
from .chunk_kv import ChunkKV
from .codec import CODECS, CodesCodec
from .layout import BaseReader, OpenEntry
from .serialize import serialize_chunk, stored_name

if TYPE_CHECKING:
    from .codec import KVCodec
    from .lazy import LazyChunkKV


@dataclass
class TierStats(StoreStats):
    corrupt: int = 0  # entries that failed to decode, were dropped and counted as misses
    errors: int = 0  # operations the backend failed (I/O error, Redis unreachable); each one is a miss or a lost put
    skipped: int = 0  # writes not tried while the tier pauses them (a full or read-only disk folder): lost puts
    vanished: int = 0  # entries evicted or replaced by the store while their layers were read: misses, not damage

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


class CountedTier(ABC):
    """The `stats`, unread-hit tracking, `discard` and base opening of a tier of serialized entries (disk, Redis).

    A subclass implements `_delete` (which logs and counts its own failures, never raises), `_open_entry` (what
    `_open_base` opens a dependent's base with; `_entry_bytes` codes an entry against its base) and the reads and
    writes; it counts through `_count_hit`,
    `_count_miss` and `_count_failure`, hands a lazily read hit out through `_hand_out`, and drops a damaged entry
    through `_drop_corrupt`.
    """

    codec: KVCodec  # set by the subclass: how its entries are encoded
    hmac_key: bytes | None  # set by the subclass: the key its entries are signed with, if any
    _failed_calls: tuple[type[BaseException], ...]  # set by the subclass: what `_open_entry` raises when a call fails

    def __init__(self, name: str, label: str, logger: logging.Logger) -> None:
        self.name = name
        self.stats = TierStats()
        self._label = label  # "disk tier <folder>", "Redis tier at <host>": how log lines name the tier
        self._logger = logger
        self._lock = threading.Lock()  # guards `stats`
        self._unread = UnreadHits()

    def entry_name(self, key: str) -> str:
        """The name this tier keeps `key`'s entry under (`serialize.stored_name`: the key, the codec, the signing
        key's digest), so that peers with another codec or signing key keep entries of their own."""
        return stored_name(key, self.codec, self.hmac_key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._has_entry(key, self.entry_name(key))

    def codecs_holding(self, key: str) -> frozenset[str]:
        """The codecs `key`'s entry is stored in here under this tier's signing key, its own codec included."""
        return frozenset(n for n, c in CODECS.items() if self._has_entry(key, stored_name(key, c, self.hmac_key)))

    @abstractmethod
    def _has_entry(self, key: str, name: str) -> bool:
        """Whether chunk `key` has an entry stored under `name` (a failure is False, never raised)."""

    @abstractmethod
    def _open_entry(self, key: str) -> OpenEntry | None:
        """`key`'s entry with its header read and checked, its layers left to read by range; None if it is not
        stored. Raises CorruptEntryError for a bad entry, and the tier's own errors for a failed call."""

    @abstractmethod
    def _base_read_failed(self, key: str, exc: BaseException) -> None:
        """A call of the tier's (one of `_failed_calls`) failed while `_entry_bytes` read base `key`: counted as a
        failed call, not a miss, unless the call counted itself. The entry is then stored alone."""

    def _entry_bytes(self, kv: ChunkKV) -> bytes:
        """`kv` serialized for this tier: coded against its base (`ChunkKV.base`) where the tier holds that entry, of
        the same shape, under a `CodesCodec`; else alone. A base that fails its checks while read is dropped, and the
        entry stored alone. Raises NonFiniteKVError."""
        base = None
        if kv.base and kv.base != kv.key and isinstance(self.codec, CodesCodec):
            try:
                base = self._open_base(kv.base)
            except self._failed_calls as exc:
                self._base_read_failed(kv.base, exc)
            if base is not None and base.layout.shape != kv.shape:
                base.close()
                base = None
        try:
            return serialize_chunk(kv, codec=self.codec, hmac_key=self.hmac_key, base=base)
        except CorruptEntryError as exc:  # the base went away or turned out damaged while it was read
            self._drop_corrupt(kv.base, exc)
            return serialize_chunk(kv, codec=self.codec, hmac_key=self.hmac_key)
        finally:
            if base is not None:
                base.close()

    def _open_base(self, key: str) -> BaseReader | None:
        """The entry a dependent is coded against (`layout.py`), its header read, which keeps it recently used; None
        if it is not stored, cannot be a base (itself a dependent), or is damaged (dropped and counted)."""
        try:
            entry = self._open_entry(key)
        except CorruptEntryError as exc:
            self._drop_corrupt(key, exc)
            return None
        if entry is None:
            return None
        try:
            return BaseReader(entry.layout, entry.read_ranges, close=entry.close)
        except CorruptEntryError:
            entry.close()
            return None

    @abstractmethod
    def _delete(self, key: str) -> None:
        """Delete `key`'s entry; a failure is logged and counted, never raised."""

    def discard(self, key: str) -> None:
        """Delete `key`'s entry. If it is a hit `open` handed out unread, that hit is counted as a corrupt miss."""
        refused = self._unread.refused(key)
        if refused is not None:
            with self._lock:
                self.stats.refused_hit(refused.layout.total_bytes)
        self._delete(key)

    def _count_hit(self, nbytes: int) -> None:
        with self._lock:
            self.stats.hits += 1
            self.stats.bytes_read += nbytes

    def _count_miss(self) -> None:
        with self._lock:
            self.stats.misses += 1

    def _count_failure(self, *, miss: bool) -> None:
        """One call the backend failed: a miss (a read) or a lost write."""
        with self._lock:
            self.stats.errors += 1
            self.stats.misses += int(miss)

    def _hand_out(self, key: str, lazy: LazyChunkKV) -> Hit:
        """Count `lazy` as a hit and hand it out; damage found in a layer later takes the hit back."""
        self._count_hit(lazy.layout.total_bytes)
        lazy.when_corrupt(lambda exc: self._drop_corrupt(key, exc, was_hit=True))
        self._unread.handed_out(key, lazy)
        return Hit(lazy, self.name)

    def _drop_corrupt(self, key: str, exc: CorruptEntryError, *, was_hit: bool = False) -> None:
        """Count a corrupt entry as a miss (taking back the hit `open` counted for it) and delete it. An entry that
        went away while it was read (`EntryGoneError`) is a miss counted apart (`vanished`), with nothing to
        delete; one whose base went away (`OrphanedEntryError`) is counted the same way, and deleted."""
        gone = isinstance(exc, EntryGoneError)
        if gone:
            self._logger.info("%s: %s; it will be recomputed", self._label, exc)
        else:
            self._logger.warning("%s: dropping a corrupt entry (%s); it will be recomputed", self._label, exc)
        self._unread.forget(key)
        with self._lock:
            if gone:
                self.stats.vanished += 1
            else:
                self.stats.corrupt += 1
            self.stats.misses += 1
            if was_hit:
                self.stats.hits -= 1
        if not gone or isinstance(exc, OrphanedEntryError):
            self._delete(key)
