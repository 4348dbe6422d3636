"""The Redis tier: round trips, its LRU budget, damaged values, two processes sharing it, and a server that stops
and comes back. Each test runs against a private `redis-server` on a free loopback port; they are skipped (with the
reason) only where that binary or redis-py is missing."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import torch
from redis_helpers import RedisServer
from store_helpers import EXACT_CODEC, make_kv, same

from cacheblend_rag.store.memory import MemoryStore
from cacheblend_rag.store.serialize import serialize_chunk
from cacheblend_rag.store.tiered import TieredStore


def test_redis_round_trip(redis_store):
    kv = make_kv("chunk-a", dtype=torch.bfloat16)
    assert redis_store.get("chunk-a") is None
    redis_store.put(kv)
    assert "chunk-a" in redis_store and len(redis_store) == 1
    assert same(redis_store.get("chunk-a"), kv)
    assert redis_store.nbytes == len(serialize_chunk(kv))
    redis_store.discard("chunk-a")
    assert "chunk-a" not in redis_store and len(redis_store) == 0 and redis_store.nbytes == 0


def test_redis_eviction_keeps_budget_and_drops_least_recently_used(redis_server):
    from cacheblend_rag.store.redis_store import RedisStore

    entry = len(serialize_chunk(make_kv("x")))
    store = RedisStore(
        redis_server.url,
        budget_bytes=3 * entry + entry // 2,
        namespace=f"t-{uuid.uuid4().hex[:8]}",
        codec=EXACT_CODEC,
    )
    for i, name in enumerate("abc"):
        store.put(make_kv(name, seed=i))
    assert store.get("a") is not None  # b is now the least recently used
    store.put(make_kv("d", seed=3))
    assert "b" not in store
    assert all(name in store for name in "acd")
    assert len(store) == 3 and store.nbytes == 3 * entry <= store.budget_bytes
    assert store.stats.evictions == 1
    store.clear()


def test_redis_garbled_value_is_a_logged_miss_and_removed(redis_store, caplog):
    redis_store.put(make_kv("chunk-a"))
    client = redis_store._client
    value_key = redis_store.value_key("chunk-a")
    client.setrange(value_key, client.strlen(value_key) - 3, b"\x00\x01\x02")
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.store.redis_store"):
        assert redis_store.get("chunk-a") is None
    assert "corrupt" in caplog.text
    assert "chunk-a" not in redis_store and len(redis_store) == 0 and redis_store.nbytes == 0
    assert redis_store.stats.corrupt == 1
    client.set(redis_store.value_key("chunk-b"), b"not a chunk")  # planted by hand, no bookkeeping
    assert redis_store.get("chunk-b") is None and "chunk-b" not in redis_store
    assert redis_store.stats.corrupt == 2


def test_redis_two_processes_see_each_others_chunks(redis_server, redis_store):
    redis_store.put(make_kv("from-parent", seed=7))
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from store_helpers import make_kv, same
        from cacheblend_rag.store.redis_store import RedisStore
        store = RedisStore({redis_server.url!r}, namespace={redis_store.namespace!r}, codec={EXACT_CODEC!r})
        got = store.get("from-parent")
        assert got is not None and same(got, make_kv("from-parent", seed=7)), "child did not see the parent's chunk"
        store.put(make_kv("from-child", seed=8))
        """
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert same(redis_store.get("from-child"), make_kv("from-child", seed=8))


def test_redis_stopped_mid_run_falls_back_without_errors(caplog):
    from cacheblend_rag.store.redis_store import RedisStore

    server = RedisServer()
    server.start()
    try:
        redis = RedisStore(server.url, budget_bytes=10 * 1024**2, backoff_s=0.3)
        store = TieredStore([MemoryStore(10 * 1024**2), redis], names=["memory", "redis"])
        store.put(make_kv("chunk-a"))
        store.flush()
        assert "chunk-a" in redis
        server.stop()

        with caplog.at_level(logging.WARNING, logger="cacheblend_rag.store.redis_store"):
            assert redis.get("chunk-a") is None
            assert redis.get("chunk-a") is None  # backing off: not even tried
            store.put(make_kv("chunk-b"))
            store.flush()
            assert store.get("chunk-a") is not None and store.get("chunk-b") is not None
            assert store.get("chunk-c") is None
        assert store.hits_by_tier == {"memory": 2, "redis": 0}
        assert redis.stats.errors == 1 and not redis.available  # one failed try; the backoff answered the rest
        assert caplog.text.count("unreachable") == 1

        # The server comes back on the same port: after the back-off the tier is used again.
        server.start()
        time.sleep(0.35)
        redis.put(make_kv("chunk-d"))
        assert redis.get("chunk-d") is not None
        assert "reachable again" in caplog.text
    finally:
        server.stop()
