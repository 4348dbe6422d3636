"""One protocol for every store: memory, disk, Redis and a tiered stack answer the same calls the same way."""

from __future__ import annotations

import uuid

import pytest
import torch
from store_helpers import EXACT_CODEC, make_kv, same

from cacheblend_rag.store.disk.tier import DiskStore
from cacheblend_rag.store.memory import MemoryStore
from cacheblend_rag.store.tiered import TieredStore


@pytest.fixture(params=["memory", "disk", "redis", "tiered"])
def any_store(request, tmp_path):
    from cacheblend_rag.store import RedisStore

    if request.param == "memory":
        store = MemoryStore(10 * 1024**2)
    elif request.param == "disk":
        store = DiskStore(tmp_path, 10 * 1024**2, codec=EXACT_CODEC)
    elif request.param == "redis":
        url = request.getfixturevalue("redis_server").url
        store = RedisStore(url, namespace=f"p-{uuid.uuid4().hex[:8]}", codec=EXACT_CODEC)
    else:
        store = TieredStore([MemoryStore(0), DiskStore(tmp_path, 10 * 1024**2, codec=EXACT_CODEC)])
    yield store
    store.close()


def test_every_store_implements_the_whole_protocol_the_same_way(any_store):
    from cacheblend_rag.store import ChunkReader, ChunkStore, Hit

    store = any_store
    assert isinstance(store, ChunkStore) and isinstance(store.name, str)
    kv = make_kv("chunk-a", tokens=1024)
    store.put(kv)
    store.flush()
    assert "chunk-a" in store and len(store) == 1
    hit = store.open("chunk-a")
    assert isinstance(hit, Hit) and isinstance(hit.kv, ChunkReader) and hit.tier in (store.name, "disk")
    assert hit.kv.shape == kv.shape and hit.kv.dtype == kv.dtype and hit.kv.nbytes == kv.nbytes
    k, v = hit.kv.layer(1)
    assert torch.equal(k, kv.keys[1]) and torch.equal(v, kv.values[1])
    assert same(hit.kv.materialize(), kv) and same(store.get("chunk-a"), kv)
    assert store.open("chunk-b") is None and store.get("chunk-b") is None
    assert store.stats.hits >= 2 and store.stats.misses >= 2
    store.discard("chunk-a")
    assert store.get("chunk-a") is None
    store.put(kv)
    store.clear()
    assert len(store) == 0 and store.open("chunk-a") is None
