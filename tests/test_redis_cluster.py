"""The Redis tier on a Redis Cluster: three masters on loopback, started here (`redis-server --cluster-enabled yes`
on three ports joined by `redis-cli --cluster create`); skipped only where redis-server is missing.

Every key a Lua script touches must live in one slot (the shard's hash tag), shards must spread over the masters,
and several workers must share one namespace and its budget.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from redis_helpers import started_cluster
from store_helpers import make_kv, same

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store.redis_store import RedisStore, split_cluster_flag
from cacheblend_rag.store.serialize import serialize_chunk

# The Redis tier here keeps the exact codec, not the lossy default (int8): these tests check its bookkeeping bit for
# bit. The default codec has its own tests in test_codec_store.py and test_codec.py.
EXACT_CODEC = "native"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with started_cluster(str(tmp_path_factory.mktemp("redis-cluster"))) as servers:
        yield servers


@pytest.fixture
def store(cluster):
    store = RedisStore(cluster.url, budget_bytes=50 * 1024**2, namespace=f"t-{uuid.uuid4().hex[:8]}", codec=EXACT_CODEC)
    yield store
    store.clear()
    store.close()


def test_the_cluster_flag_is_read_from_the_url_and_dropped_from_it():
    assert split_cluster_flag("redis://h:7000/0?cluster=1") == ("redis://h:7000/0", True)
    assert split_cluster_flag("redis://h:7000/0?cluster=no&ssl_cert_reqs=none") == (
        "redis://h:7000/0?ssl_cert_reqs=none",
        False,
    )
    assert split_cluster_flag("redis://h:6379/2") == ("redis://h:6379/2", False)
    with pytest.raises(ConfigError, match="cluster= must be"):
        split_cluster_flag("redis://h:7000/0?cluster=maybe")


def test_a_cluster_round_trips_chunks_read_whole_and_by_layer(store):
    assert store.cluster and store.shards == 16
    kvs = [make_kv(f"chunk-{i}", tokens=64, seed=i) for i in range(12)]
    for kv in kvs:
        store.put(kv)
    for kv in kvs:
        assert same(store.get(kv.key), kv)
        hit = store.open(kv.key)
        assert hit.tier == "redis" and same(hit.kv.materialize(), kv)
    assert len(store) == 12 and store.nbytes > 0 and store.get("missing") is None


def test_every_key_a_script_touches_lives_in_one_slot(store):
    from redis.crc import key_slot

    keys = [f"chunk-{i}" for i in range(40)]
    for shard in range(store.shards):
        touched = [store.value_key(k) for k in keys if store._shard(k) == shard] + store._bookkeeping(shard)
        assert len({key_slot(k.encode()) for k in touched}) == 1, f"shard {shard} spans several slots"


def test_shards_spread_over_the_masters(cluster, store):
    for i in range(40):
        store.put(make_kv(f"chunk-{i}", tokens=16, seed=i))
    per_node = cluster.keys_per_node()
    assert sum(1 for n in per_node if n > 0) >= 2, f"every key landed on one master: {per_node}"


def test_a_cluster_keeps_each_shard_within_its_budget_least_recently_used_out(cluster):
    entry = len(serialize_chunk(make_kv("x", tokens=64)))
    store = RedisStore(
        cluster.url, budget_bytes=2 * (3 * entry + entry // 2), namespace="budget", shards=2, codec=EXACT_CODEC
    )
    try:
        keys = [f"chunk-{i}" for i in range(20)]
        for key in keys:
            store.put(make_kv(key, tokens=64))
            if key != keys[0]:
                assert store.get(keys[0]) is not None  # kept fresh: never the least recently used
        assert store.nbytes <= store.budget_bytes and len(store) == 6 and store.stats.evictions == 14
    finally:
        store.clear()
        store.close()


def test_two_workers_share_chunks_through_the_cluster(cluster, store):
    store.put(make_kv("from-parent", seed=7))
    script = textwrap.dedent(
        f"""
        from store_helpers import make_kv, same
        from cacheblend_rag.store.redis_store import RedisStore
        store = RedisStore({cluster.url!r}, namespace={store.namespace!r}, codec={EXACT_CODEC!r})
        assert same(store.get("from-parent"), make_kv("from-parent", seed=7))
        store.put(make_kv("from-child", seed=8))
        """
    )
    tests = str(Path(__file__).resolve().parent)  # the child imports this folder's helpers, as pytest does
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, env=env)
    assert same(store.get("from-child"), make_kv("from-child", seed=8))


def test_clear_empties_one_namespace_on_every_master(cluster, store):
    other = RedisStore(cluster.url, namespace=f"other-{uuid.uuid4().hex[:8]}")
    try:
        for i in range(10):
            store.put(make_kv(f"chunk-{i}", tokens=16))
        other.put(make_kv("kept", tokens=16))
        store.clear()
        assert len(store) == 0 and store.nbytes == 0 and store.get("chunk-3") is None
        assert other.get("kept") is not None
    finally:
        other.clear()
        other.close()


def test_a_cluster_url_with_a_database_number_is_refused(cluster):
    with pytest.raises(ConfigError, match="database 0 only"):
        RedisStore(cluster.url.replace("/0?", "/3?"))


def test_a_peer_on_the_cluster_names_the_codec_of_entries_it_cannot_read(store, cluster):
    kvs = [make_kv(f"peer-{i}", tokens=8, seed=i) for i in range(6)]  # keys over several shards, so several slots
    for kv in kvs:
        store.put(kv)
    peer = RedisStore(cluster.url, namespace=store.namespace, codec="int8")
    try:
        assert all(kv.key not in peer and peer.codecs_holding(kv.key) == {EXACT_CODEC} for kv in kvs)
        assert peer.codecs_holding("never-stored") == set()
    finally:
        peer.close()
