"""Entries stored for another dtype or codec are misses, and a request says so in one line.

An fp32 run fills a disk folder; a bf16 engine of the same model on that folder finds none of it (the keys name
the dtype), recomputes, and its metrics and log say how many of the missing chunks are stored for float32. A
worker whose disk tier reads fp16 says the same of a peer's int8 entries. Chunks stored nowhere say nothing."""

from __future__ import annotations

import logging

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, EngineConfig, StoreConfig
from cacheblend_rag.models.fingerprint import fingerprint_in, model_fingerprint
from cacheblend_rag.store import DiskStore, MemoryStore, TieredStore
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

CHUNKS = [random_words(701, 30), random_words(702, 30), random_words(703, 30)]
LOGGER = "cacheblend_rag.engine.chunks.cache"


def engine_on(folder, *, dtype="float32", codec="int8") -> CacheBlendEngine:
    store = StoreConfig(memory_budget_bytes=0, disk_dir=str(folder), kv_codec=codec)
    config = EngineConfig(dtype=dtype, miss_policy="blend", chunk_separator="", chunk_context="isolated", store=store)
    return CacheBlendEngine(make_tiny_model("qwen2"), make_tiny_tokenizer(), config=config)


def ask(engine, chunks=CHUNKS):
    return engine.generate(chunks, prefix=random_words(1, 4), suffix=random_words(2, 5), max_new_tokens=2)


def test_fp32_entries_are_named_to_a_bf16_engine_once_in_the_log(tmp_path, caplog):
    writer = engine_on(tmp_path / "kv")
    ask(writer)
    writer.store.flush()
    reader = engine_on(tmp_path / "kv", dtype="bfloat16")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first = ask(reader).metrics
        again = ask(reader, CHUNKS[::-1]).metrics  # stored now in bf16: hits, nothing to say
    assert first.chunks_missed == 3 and first.stored_otherwise == {"float32": 3}
    assert first.stored_note == "3 chunks are stored for float32; this engine runs bfloat16 and recomputes them"
    assert again.chunks_missed == 0 and again.stored_otherwise == {}
    told = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert told == [first.stored_note]


def test_a_peers_entries_in_another_codec_are_named(tmp_path):
    writer = engine_on(tmp_path / "kv", codec="int8")
    ask(writer, CHUNKS[:2])
    writer.store.flush()
    reader = engine_on(tmp_path / "kv", codec="fp16")
    m = ask(reader).metrics
    assert m.chunks_missed == 3 and m.stored_otherwise == {"codec int8": 2}  # the third chunk is stored nowhere
    assert "2 chunks are stored in the int8 codec, which this engine's tiers do not read" in m.stored_note


def test_new_chunks_say_nothing(tmp_path, caplog):
    engine = engine_on(tmp_path / "kv")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        m = ask(engine).metrics
    assert m.chunks_missed == 3 and m.stored_otherwise == {} and m.stored_note is None
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_codecs_holding_names_what_each_tier_holds(tmp_path):
    from cacheblend_rag.store import ChunkKV

    kv = ChunkKV("k1", torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8))
    int8 = DiskStore(str(tmp_path / "kv"), codec="int8")
    int8.put(kv)
    fp16 = DiskStore(str(tmp_path / "kv"), codec="fp16")
    assert "k1" not in fp16 and fp16.codecs_holding("k1") == {"int8"} and fp16.codecs_holding("k2") == set()
    memory = MemoryStore()
    memory.put(kv)
    assert memory.codecs_holding("k1") == {"native"}
    assert TieredStore([memory, fp16]).codecs_holding("k1") == {"native", "int8"}


def test_the_fingerprint_in_another_dtype_is_that_models_own():
    fp32 = make_tiny_model("llama")
    bf16 = make_tiny_model("llama").to(torch.bfloat16)
    assert fingerprint_in(fp32, torch.bfloat16) == model_fingerprint(bf16)
    assert fingerprint_in(fp32, torch.float32) == model_fingerprint(fp32)
    assert fingerprint_in(bf16, torch.float32) is None  # its fp32 values are gone


def test_a_checkpoints_fingerprint_in_another_dtype_and_an_edit_after_loading(tmp_path):
    from transformers import AutoModelForCausalLM

    make_tiny_model("llama").save_pretrained(tmp_path / "ckpt")
    fp32 = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert fingerprint_in(bf16, torch.float32) == model_fingerprint(fp32)
    assert fingerprint_in(fp32, torch.bfloat16) == model_fingerprint(bf16)
    with torch.no_grad():
        bf16.model.layers[1].mlp.down_proj.weight.mul_(1.5)  # the files no longer say what it holds
    assert fingerprint_in(bf16, torch.float32) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_line_in_singular_and_none(dtype):
    from cacheblend_rag.engine.chunks.elsewhere import note

    assert note({}, dtype) is None
    assert note({"float16": 1}, dtype) == f"1 chunk is stored for float16; this engine runs {dtype} and recomputes them"


def test_a_redis_tier_names_a_peers_codec(redis_store, redis_server):
    from cacheblend_rag.store import ChunkKV
    from cacheblend_rag.store.redis_store import RedisStore

    redis_store.put(ChunkKV("k1", torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8)))  # the native codec
    peer = RedisStore(redis_server.url, namespace=redis_store.namespace, codec="int8", shards=redis_store.shards)
    try:
        assert "k1" not in peer and peer.codecs_holding("k1") == {"native"} and peer.codecs_holding("k2") == set()
    finally:
        peer.close()
