"""Layer-wise pipelined loading: layers read one at a time from disk and Redis equal the stored chunk, the
prefetch thread hands them over in order and passes errors on, and a running engine gives the same tokens
with and without the pipeline, also when a layer turns out damaged after the fusor has started."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from store_helpers import make_kv, same

from cacheblend_rag import CacheBlendEngine, EngineConfig, StoreConfig
from cacheblend_rag.engine.prefill.prefetch import LayerPrefetcher
from cacheblend_rag.store.disk.tier import DiskStore
from cacheblend_rag.store.lazy import LazyChunkKV
from cacheblend_rag.store.memory import MemoryStore
from cacheblend_rag.store.serialize import CorruptEntryError, parse_layout, serialize_chunk
from cacheblend_rag.store.tiered import TieredStore
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

CPU = torch.device("cpu")

# ---------------------------------------------------------------- the prefetch thread


def _fake_load(log: list[int], delay: float = 0.0, fail_at: int | None = None):
    def load(layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if delay:
            time.sleep(delay)
        if layer_idx == fail_at:
            raise CorruptEntryError(f"layer {layer_idx} is bad")
        log.append(layer_idx)
        return torch.full((1,), float(layer_idx)), torch.full((1,), -float(layer_idx))

    return load


def test_prefetcher_hands_over_every_layer_in_order():
    log: list[int] = []
    with LayerPrefetcher(_fake_load(log), 6, CPU) as p:
        got = [p.get(i) for i in range(6)]
    assert [int(k) for k, _ in got] == list(range(6)) and [int(v) for _, v in got] == [0, -1, -2, -3, -4, -5]
    assert log == list(range(6))


def test_prefetcher_stays_at_most_depth_layers_ahead():
    log: list[int] = []
    with LayerPrefetcher(_fake_load(log), 8, CPU, depth=2) as p:
        time.sleep(0.2)  # the consumer is slow: the thread must stop two layers ahead
        assert log == [0, 1]
        p.get(0)
        time.sleep(0.2)
        assert log == [0, 1, 2]


def test_prefetcher_raises_a_load_error_at_the_layer_that_failed():
    with LayerPrefetcher(_fake_load([], fail_at=3), 6, CPU) as p:
        for i in range(3):
            p.get(i)
        with pytest.raises(CorruptEntryError, match="layer 3 is bad"):
            p.get(3)


def test_prefetcher_rejects_out_of_order_use_and_stops_on_close():
    p = LayerPrefetcher(_fake_load([], delay=0.01), 50, CPU)
    with pytest.raises(RuntimeError, match="expected layer 0, got 2"):
        p.get(2)
    p.close()
    assert not any(t.name == "cacheblend-prefetch" and t.is_alive() for t in threading.enumerate())


def test_prefetcher_records_waits_when_loading_is_the_bottleneck():
    with LayerPrefetcher(_fake_load([], delay=0.02), 5, CPU) as p:
        for i in range(5):
            p.get(i)
    assert p.load_s >= 0.09 and 0.05 <= p.wait_s <= p.load_s + 0.05


# ---------------------------------------------------------------- layer-wise reads from the tiers

BIG = 1024  # tokens: entries above diskcache's 32 KiB file threshold, so they are read from files by range
# The disk tier here keeps the exact codec, not the lossy default (int8): these tests check layer-wise reads bit for
# bit. The default codec has its own tests in test_codec_store.py and test_codec.py.
EXACT_CODEC = "native"


@pytest.mark.parametrize("tokens", [4, BIG], ids=["inline-in-sqlite", "file"])
def test_disk_open_reads_layers_equal_to_the_stored_chunk(tmp_path, tokens):
    store = DiskStore(tmp_path, budget_bytes=10 * 1024**2, codec=EXACT_CODEC)
    kv = make_kv("chunk-a", tokens=tokens, dtype=torch.bfloat16)
    store.put(kv)
    lazy, tier = store.open("chunk-a")
    assert tier == "disk" and isinstance(lazy, LazyChunkKV) and lazy.shape == kv.shape and lazy.nbytes == kv.nbytes
    for i in reversed(range(kv.num_layers)):  # any order
        k, v = lazy.layer(i)
        assert torch.equal(k, kv.keys[i]) and torch.equal(v, kv.values[i])
    assert same(lazy.materialize(), kv)
    assert store.open("chunk-b") is None and store.stats.misses == 1


def test_disk_layer_damaged_on_disk_is_caught_at_that_layer_and_dropped(tmp_path):
    store = DiskStore(tmp_path, budget_bytes=10 * 1024**2, codec=EXACT_CODEC)
    kv = make_kv("chunk-a", tokens=BIG)
    store.put(kv)
    data = serialize_chunk(kv)
    layout = parse_layout(data, "chunk-a", len(data))
    (_, _), (v0, _) = layout.layer_ranges(1)
    (f,) = Path(tmp_path).rglob("*.val")
    raw = bytearray(f.read_bytes())
    raw[v0 + 10] ^= 0x01  # one bit of layer 1's values
    f.write_bytes(bytes(raw))
    lazy = store.open("chunk-a").kv
    lazy.layer(0)
    with pytest.raises(CorruptEntryError, match="layer 1 fails its sha256"):
        lazy.layer(1)
    assert "chunk-a" not in store and store.stats.corrupt == 1


def test_tiered_open_promotes_a_lazy_hit_once_every_layer_was_read(tmp_path):
    memory, disk = MemoryStore(10 * 1024**2), DiskStore(tmp_path, 10 * 1024**2, codec=EXACT_CODEC)
    store = TieredStore([memory, disk], write_back=False)
    kv = make_kv("chunk-a", tokens=BIG)
    disk.put(kv)
    lazy, tier = store.open("chunk-a")
    assert tier == "disk" and isinstance(lazy, LazyChunkKV)
    for i in range(kv.num_layers - 1):
        lazy.layer(i)
    assert "chunk-a" not in memory  # not before the last layer
    lazy.layer(kv.num_layers - 1)
    assert same(memory.get("chunk-a"), kv)
    hit, tier = store.open("chunk-a")
    assert tier == "memory" and not isinstance(hit, LazyChunkKV)


def test_redis_open_reads_layers_equal_to_the_stored_chunk(redis_store):
    kv = make_kv("chunk-a", tokens=64, dtype=torch.float16)
    redis_store.put(kv)
    lazy, tier = redis_store.open("chunk-a")
    assert tier == "redis" and isinstance(lazy, LazyChunkKV)
    assert same(lazy.materialize(), kv)
    assert redis_store.open("chunk-b") is None


def test_redis_entry_evicted_while_being_read_is_caught(redis_store):
    redis_store.put(make_kv("chunk-a", tokens=64))
    lazy = redis_store.open("chunk-a").kv
    lazy.layer(0)
    redis_store._client.delete(redis_store.value_key("chunk-a"))  # evicted by another worker meanwhile
    with pytest.raises(CorruptEntryError, match="went away while its layers were read"):  # an EntryGoneError
        lazy.layer(1)
    assert redis_store.stats.vanished == 1 and redis_store.stats.corrupt == 0 and len(redis_store) == 0


# ---------------------------------------------------------------- the engine with and without the pipeline

CHUNKS = [random_words(401, 40), random_words(402, 30), random_words(403, 50)]


def engine_on(pipelined: bool, **tiers) -> CacheBlendEngine:
    # memory_budget_bytes=0: nothing stays in process memory, every chunk comes from the lower tier
    config = EngineConfig(miss_policy="blend", chunk_separator="", store=StoreConfig(memory_budget_bytes=0, **tiers))
    engine = CacheBlendEngine(make_tiny_model("llama"), make_tiny_tokenizer(), config=config)
    engine.prefiller.pipelined = pipelined  # False: each layer read when the fusor needs it (the reference)
    return engine


def ask(engine, mode="blend"):
    return engine.generate(CHUNKS, prefix=random_words(1, 4), suffix=random_words(2, 5), mode=mode, max_new_tokens=6)


@pytest.mark.parametrize("mode", ["prefix", "reuse", "blend"])
def test_pipelined_loading_from_disk_gives_the_same_tokens_and_logits(tmp_path, mode):
    plain = engine_on(False, disk_dir=str(tmp_path / "a"))
    piped = engine_on(True, disk_dir=str(tmp_path / "b"))
    for engine in (plain, piped):
        ask(engine, mode)
        engine.store.flush()  # chunks now on disk only
    a, b = ask(plain, mode), ask(piped, mode)
    assert a.token_ids == b.token_ids
    assert b.metrics.pipelined and not a.metrics.pipelined
    assert b.metrics.hits_by_tier == a.metrics.hits_by_tier and b.metrics.hits_by_tier["disk"] >= 1
    assert b.metrics.load_s > 0 and b.metrics.wait_s >= 0
    assert 0 < a.metrics.wait_s <= a.metrics.load_s  # without the pipeline the fusor waits for every load
    prompt = plain.build_prompt(CHUNKS, prefix=random_words(1, 4), suffix=random_words(2, 5))
    torch.testing.assert_close(piped.prefill(prompt, mode).logits, plain.prefill(prompt, mode).logits)


def test_pipelined_loading_from_redis_gives_the_same_tokens(redis_server):
    plain = engine_on(False, redis_url=redis_server.url)
    piped = engine_on(True, redis_url=redis_server.url)  # shares plain's entries through Redis
    first = ask(plain)
    plain.store.flush()
    second = ask(piped)
    assert second.metrics.hits_by_tier == {"redis": 3} and second.token_ids == first.token_ids


def test_a_layer_damaged_after_fusion_started_is_recomputed_and_the_answer_stays_right(tmp_path):
    engine = engine_on(True, disk_dir=str(tmp_path / "kv"), kv_codec=EXACT_CODEC)
    reference = ask(engine)
    engine.store.flush()
    num_layers = engine.lm.shape.num_layers
    for f in Path(tmp_path / "kv").rglob("*.val"):  # damage only the last layer's values of every entry
        raw = bytearray(f.read_bytes())
        layout = parse_layout(bytes(raw), _entry_key(raw), len(raw))
        (_, _), (v0, _) = layout.layer_ranges(num_layers - 1)
        raw[v0] ^= 0x40
        f.write_bytes(bytes(raw))
    again = ask(engine)
    assert again.token_ids == reference.token_ids
    assert again.metrics.chunks_hit == 0 and again.metrics.chunks_missed == 3
    engine.store.flush()
    healed = ask(engine)  # the recomputed chunks were stored again
    assert healed.metrics.hits_by_tier == {"disk": 3} and healed.token_ids == reference.token_ids


def _entry_key(raw: bytearray) -> str:
    import json
    import struct

    (n,) = struct.unpack_from("<Q", raw)
    return json.loads(bytes(raw[8 : 8 + n]))["__metadata__"]["key"]
