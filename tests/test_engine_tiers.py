"""The engine over every store: each tier alone or stacked, with pipelined loading on and off, gives the memory
store's tokens; damaged or unreachable lower tiers still give the right answer."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from redis_helpers import RedisServer, started_cluster

from cacheblend_rag import CacheBlendEngine, EngineConfig, StoreConfig
from cacheblend_rag.store import ChunkStore, DiskStore, MemoryStore, RedisStore, TieredStore
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

CHUNKS = [random_words(301, 40), random_words(302, 40)]
# The disk and Redis tiers here keep the exact codec, not the lossy default (int8): these tests check that a stored
# chunk gives exactly the memory store's answer, and damage entries as exact ones are laid out. The default codec
# has its own tests in test_codec_store.py and test_codec.py.
EXACT_CODEC = "native"


def ask(engine):
    return engine.generate(CHUNKS, prefix=random_words(1, 4), suffix=random_words(2, 5), max_new_tokens=6)


def engine_on(**tiers) -> CacheBlendEngine:
    # memory_budget_bytes=0: nothing stays in process memory, every chunk comes from the lower tier
    store = StoreConfig(**{"memory_budget_bytes": 0, "kv_codec": EXACT_CODEC, **tiers})
    config = EngineConfig(miss_policy="blend", chunk_separator="", store=store)
    return CacheBlendEngine(make_tiny_model("qwen2"), make_tiny_tokenizer(), config=config)


def test_a_corrupted_file_on_disk_is_a_miss_and_the_answer_stays_right(tmp_path):
    engine = engine_on(disk_dir=str(tmp_path / "kv"))
    reference = ask(engine)
    engine.store.flush()
    assert ask(engine).metrics.hits_by_tier == {"disk": 2}
    files = sorted(Path(tmp_path / "kv").rglob("*.val"))
    assert files, "diskcache should keep chunk entries as files"
    for f in files:  # flip bytes in the middle of every stored entry
        data = bytearray(f.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 64] = b"\xff" * 64
        f.write_bytes(bytes(data))
    again = ask(engine)
    assert again.metrics.chunks_missed == 2 and again.metrics.chunks_hit == 0
    assert again.token_ids == reference.token_ids
    disk = engine.store.tiers[1]
    assert disk.stats.corrupt >= 2


def test_a_garbled_redis_value_is_a_miss_and_the_answer_stays_right():
    redis = pytest.importorskip("redis")
    server = RedisServer()
    server.start()
    try:
        engine = engine_on(redis_url=server.url)
        reference = ask(engine)
        engine.store.flush()
        assert ask(engine).metrics.hits_by_tier == {"redis": 2}
        client = redis.Redis.from_url(server.url)
        for key in client.scan_iter("{cacheblend-rag}:*"):
            if client.type(key) == b"string" and client.strlen(key) > 10_000:  # chunk values, not bookkeeping
                client.setrange(key, client.strlen(key) // 2, b"garbage" * 10)
        again = ask(engine)
        assert again.metrics.chunks_missed == 2
        assert again.token_ids == reference.token_ids

        server.stop()  # Redis gone mid-run: the engine keeps answering, recomputing what it cannot load
        down = ask(engine)
        assert down.token_ids == reference.token_ids
    finally:
        server.stop()


def test_clear_store_drops_chunk_kv_and_the_answer_stays_right(tmp_path):
    from cacheblend_rag.errors import ConfigError

    config = EngineConfig(miss_policy="blend", chunk_separator="", store=StoreConfig(disk_dir=str(tmp_path / "kv")))
    engine = CacheBlendEngine(make_tiny_model("qwen2"), make_tiny_tokenizer(), config=config)
    reference = ask(engine)
    assert ask(engine).metrics.chunks_hit == 2
    engine.clear_store(["memory"])  # disk still holds both chunks
    assert ask(engine).metrics.hits_by_tier == {"disk": 2}
    engine.clear_store()
    again = ask(engine)
    assert again.metrics.chunks_missed == 2 and again.token_ids == reference.token_ids
    with pytest.raises(ConfigError, match="no tier named"):
        engine.clear_store(["redis"])


# ---------------------------------------------------------------- every store, alone or stacked, as `store=`

SINGLE = ["memory", "disk", "redis", "cluster"]
STACKS = [
    ("memory", "disk"),
    ("memory", "redis"),
    ("disk", "redis"),
    ("memory", "disk", "redis"),
    ("memory", "cluster"),
]


@pytest.fixture(scope="module")
def reference_tokens():
    config = EngineConfig(miss_policy="blend", chunk_separator="")
    return ask(
        CacheBlendEngine(make_tiny_model("qwen2"), make_tiny_tokenizer(), config=config, store=MemoryStore())
    ).token_ids


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with started_cluster(str(tmp_path_factory.mktemp("redis-cluster"))) as servers:
        yield servers


def make_tier(kind: str, request, tmp_path) -> ChunkStore:
    if kind == "memory":
        return MemoryStore()
    if kind == "disk":
        return DiskStore(tmp_path / "kv", codec=EXACT_CODEC)
    url = request.getfixturevalue("redis_server" if kind == "redis" else "cluster").url
    return RedisStore(url, namespace=f"combo-{uuid.uuid4().hex[:8]}", name=kind, codec=EXACT_CODEC)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "serial"])
@pytest.mark.parametrize("kinds", [(k,) for k in SINGLE] + STACKS, ids="+".join)
def test_every_store_and_stack_gives_the_memory_stores_tokens(kinds, pipelined, request, tmp_path, reference_tokens):
    tiers = [make_tier(kind, request, tmp_path) for kind in kinds]
    store = tiers[0] if len(tiers) == 1 else TieredStore(tiers)
    config = EngineConfig(miss_policy="blend", chunk_separator="")
    engine = CacheBlendEngine(make_tiny_model("qwen2"), make_tiny_tokenizer(), config=config, store=store)
    engine.prefiller.pipelined = pipelined
    try:
        cold = ask(engine)
        assert cold.token_ids == reference_tokens and cold.metrics.chunks_missed == 2
        engine.store.flush()
        if len(tiers) > 1:
            engine.clear_store([kinds[0]])  # the next request is served by the second tier
        warm = ask(engine)
        assert warm.token_ids == reference_tokens
        assert warm.metrics.hits_by_tier == {kinds[0] if len(tiers) == 1 else kinds[1]: 2}
    finally:
        store.clear()
        store.close()
