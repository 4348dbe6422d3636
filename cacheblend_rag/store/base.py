"""What every chunk store offers: look up by key, put, and count what happened."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .chunk_kv import ChunkKV


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    bytes_read: int = 0


@runtime_checkable
class ChunkStore(Protocol):
    """A place chunk KV lives. `get` returns None on a miss; it never raises for a missing or bad entry."""

    def get(self, key: str) -> ChunkKV | None: ...

    def put(self, kv: ChunkKV) -> None: ...

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...
