"""Chunk KV caches and the stores that keep them: memory, local disk, Redis, and a tiered stack of them."""

from ..errors import CorruptEntryError
from .base import ChunkReader, ChunkStore, Hit, StoreStats
from .chunk_kv import ChunkKV, chunk_key
from .codec import CODECS, KVCodec, PayloadSpec, get_codec
from .disk.tier import DiskStore, check_disk_dir
from .lazy import LazyChunkKV
from .memory import MemoryStore
from .redis_store import RedisStore
from .serialize import deserialize_chunk, serialize_chunk
from .stats import TierStats
from .tiered import TieredStore, build_store

__all__ = [
    "CODECS",
    "ChunkKV",
    "ChunkReader",
    "ChunkStore",
    "CorruptEntryError",
    "DiskStore",
    "Hit",
    "KVCodec",
    "LazyChunkKV",
    "MemoryStore",
    "PayloadSpec",
    "RedisStore",
    "StoreStats",
    "TierStats",
    "TieredStore",
    "build_store",
    "check_disk_dir",
    "chunk_key",
    "deserialize_chunk",
    "get_codec",
    "serialize_chunk",
]
