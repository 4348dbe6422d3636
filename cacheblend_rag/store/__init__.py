"""Chunk KV caches and the stores that keep them: memory, local disk, Redis, and a tiered stack of them."""

from .base import ChunkStore, StoreStats
from .chunk_kv import ChunkKV, chunk_key
from .disk import DiskStore
from .memory import MemoryStore
from .redis_store import RedisStore
from .serialize import CorruptEntryError, deserialize_chunk, serialize_chunk
from .stats import TierStats
from .tiered import TieredStore, build_store

__all__ = [
    "ChunkKV",
    "ChunkStore",
    "CorruptEntryError",
    "DiskStore",
    "MemoryStore",
    "RedisStore",
    "StoreStats",
    "TierStats",
    "TieredStore",
    "build_store",
    "chunk_key",
    "deserialize_chunk",
    "serialize_chunk",
]
