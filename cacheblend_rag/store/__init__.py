"""Chunk KV caches and the stores that keep them."""

from .base import ChunkStore, StoreStats
from .chunk_kv import ChunkKV, chunk_key
from .memory import MemoryStore

__all__ = ["ChunkKV", "ChunkStore", "MemoryStore", "StoreStats", "chunk_key"]
