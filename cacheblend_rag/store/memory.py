"""In-process chunk store: a dictionary bounded by bytes, keeping each entry as is or encoded by a codec, evicting in
the order of an eviction policy (`eviction`: least recently or least frequently used)."""

from __future__ import annotations

import logging
import threading

from ..errors import ConfigError, NonFiniteKVError
from .base import ChunkReader, Hit, StoreStats
from .chunk_kv import ChunkKV
from .codec import NATIVE, KVCodec, get_codec
from .eviction import EvictionOrder, eviction_order
from .lazy import LazyChunkKV
from .serialize import EntryLayout, parse_layout, serialize_chunk

logger = logging.getLogger(__name__)


class _Encoded:
    """One chunk kept as the bytes `serialize_chunk` made with the tier's codec, and their parsed layout."""

    def __init__(self, kv: ChunkKV, codec: KVCodec) -> None:
        self.data = serialize_chunk(kv, codec=codec)
        self.layout: EntryLayout = parse_layout(self.data, kv.key, len(self.data), codec=codec)
        self.nbytes = len(self.data)

    def reader(self) -> LazyChunkKV:
        """Decodes layer by layer on demand, like a disk hit; bytes that never left the process are not re-hashed."""
        view = memoryview(self.data)
        return LazyChunkKV(self.layout, lambda ranges: [view[a:b] for a, b in ranges], verify=False)


class MemoryStore:
    """Keeps chunk KV in process memory, evicting entries beyond `budget_bytes` in the order of `eviction` ("lru",
    "lfu" or an `EvictionOrder`; see `eviction.py`).

    With the `native` codec (the default) entries are the `ChunkKV` tensors themselves. With another codec
    (`codec.py`) they are kept encoded, so the budget holds more chunks, and a hit is decoded layer by layer as the
    loading pipeline asks for it (`get` decodes all of it). An entry larger than the whole budget is not kept
    (storing it would evict everything and then itself). Safe to share between threads.
    """

    def __init__(
        self,
        budget_bytes: int = 2 * 1024**3,
        *,
        codec: str | KVCodec = NATIVE,
        name: str = "memory",
        eviction: str | EvictionOrder = "lfu",
    ) -> None:
        if budget_bytes < 0:
            raise ConfigError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.name = name
        self.budget_bytes = budget_bytes
        self.codec = get_codec(codec, "memory codec")
        self.stats = StoreStats()
        self.eviction = eviction_order(eviction)
        self._entries: dict[str, ChunkKV | _Encoded] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: str) -> ChunkKV | None:
        hit = self.open(key)
        return None if hit is None else hit.kv.materialize()

    def open(self, key: str) -> Hit | None:
        """The entry: whole if kept as is, else read (decoded) layer by layer as it is asked for."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.stats.misses += 1
                return None
            self.eviction.touch(key)
            self.stats.hits += 1
            self.stats.bytes_read += entry.nbytes
        kv: ChunkReader = entry if isinstance(entry, ChunkKV) else entry.reader()
        return Hit(kv, self.name)

    def put(self, kv: ChunkKV) -> None:
        try:
            entry = kv if self.codec is NATIVE else _Encoded(kv, self.codec)  # encoded outside the lock
        except NonFiniteKVError as exc:  # an encoding codec refuses NaN / inf; the request keeps its own copy
            logger.warning("%s", exc)
            return
        with self._lock:
            old = self._entries.pop(kv.key, None)
            if old is not None:
                self._bytes -= old.nbytes
            if entry.nbytes > self.budget_bytes:
                self.eviction.remove(kv.key)
                return
            self._entries[kv.key] = entry
            self._bytes += entry.nbytes
            self.eviction.add(kv.key, entry.nbytes)
            self.stats.puts += 1
            while self._bytes > self.budget_bytes:
                evicted = self._entries.pop(self.eviction.victim(keep=kv.key))
                self._bytes -= evicted.nbytes
                self.stats.evictions += 1

    def discard(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
                self.eviction.remove(key)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.eviction.clear()
            self._bytes = 0

    def flush(self) -> None:
        """Nothing to wait for: `put` stores at once."""

    def close(self) -> None:
        """Drop every entry (memory holds nothing another process could still use)."""
        self.clear()

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def codecs_holding(self, key: str) -> frozenset[str]:
        """This tier's own codec where it holds `key` (a process's memory holds no peer's entries)."""
        return frozenset((self.codec.name,)) if key in self else frozenset()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
