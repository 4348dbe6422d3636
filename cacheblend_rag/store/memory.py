"""In-process chunk store: an LRU dictionary bounded by bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..errors import ConfigError
from .base import Hit, StoreStats
from .chunk_kv import ChunkKV


class MemoryStore:
    """Keeps chunk KV in process memory, evicting the least recently used entries beyond `budget_bytes`.

    An entry larger than the whole budget is not kept (storing it would evict everything and then itself).
    Safe to share between threads.
    """

    def __init__(self, budget_bytes: int = 2 * 1024**3, *, name: str = "memory") -> None:
        if budget_bytes < 0:
            raise ConfigError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.name = name
        self.budget_bytes = budget_bytes
        self.stats = StoreStats()
        self._entries: OrderedDict[str, ChunkKV] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: str) -> ChunkKV | None:
        with self._lock:
            kv = self._entries.get(key)
            if kv is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
            self.stats.bytes_read += kv.nbytes
            return kv

    def open(self, key: str) -> Hit | None:
        """Like `get`: an entry in memory is already whole."""
        kv = self.get(key)
        return None if kv is None else Hit(kv, self.name)

    def put(self, kv: ChunkKV) -> None:
        with self._lock:
            old = self._entries.pop(kv.key, None)
            if old is not None:
                self._bytes -= old.nbytes
            if kv.nbytes > self.budget_bytes:
                return
            self._entries[kv.key] = kv
            self._bytes += kv.nbytes
            self.stats.puts += 1
            while self._bytes > self.budget_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
                self.stats.evictions += 1

    def discard(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def flush(self) -> None:
        """Nothing to wait for: `put` stores at once."""

    def close(self) -> None:
        """Drop every entry (memory holds nothing another process could still use)."""
        self.clear()

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
