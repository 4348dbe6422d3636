"""Entries coded against a base: a chunk's captured entry stored as the difference of its `pca` codes from its
isolated entry's. Decoding gives the same KV, bit for bit, as the entry coded alone; a base that is gone, replaced
or damaged makes the dependent a miss (deleted), never wrong KV; a tier without the base stores the entry alone."""

from __future__ import annotations

import pytest
import torch
from store_helpers import structured_kv

from cacheblend_rag import CacheBlendEngine, EngineConfig, StoreConfig
from cacheblend_rag.errors import CorruptEntryError, OrphanedEntryError
from cacheblend_rag.store.chunk_kv import ChunkKV
from cacheblend_rag.store.codec import get_codec
from cacheblend_rag.store.disk.tier import DiskStore
from cacheblend_rag.store.layout import BaseReader
from cacheblend_rag.store.serialize import (
    DEPENDENT_VERSION,
    deserialize_chunk,
    parse_layout,
    read_base,
    serialize_chunk,
)
from cacheblend_rag.store.transform_codec import KVCalibration, TransformCodec
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

BASE, DEP = "b" * 64, "d" * 64


@pytest.fixture(scope="module")
def codec() -> TransformCodec:
    return TransformCodec(KVCalibration.fit(*structured_kv(400, seed=0)))


def pair(tokens: int = 200, seed: int = 1, spread: float = 0.05) -> tuple[ChunkKV, ChunkKV]:
    """An isolated entry and the same chunk's captured one: the same KV, moved a little (what the chunks before it
    change)."""
    k, v = structured_kv(tokens, seed)
    g = torch.Generator().manual_seed(seed + 100)
    moved = [x + spread * x.std() * torch.randn(x.shape, generator=g) for x in (k, v)]
    return ChunkKV(BASE, k, v), ChunkKV(DEP, *moved, base=BASE)


def test_a_dependent_decodes_bit_for_bit_as_the_entry_alone_in_fewer_bytes(codec):
    base, dep = pair()
    base_bytes = serialize_chunk(base, codec=codec)
    reader = read_base(base_bytes, BASE, codec=codec)
    data = serialize_chunk(dep, codec=codec, base=reader)
    alone = serialize_chunk(dep, codec=codec)
    assert len(data) < 0.8 * len(alone)
    layout = parse_layout(data, DEP, len(data), codec=codec)
    assert (layout.base, layout.base_digest) == (BASE, reader.digest)
    got = deserialize_chunk(data, DEP, codec=codec, base=reader)
    want = deserialize_chunk(alone, DEP, codec=codec)
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert got.base == BASE


def test_a_dependent_without_its_base_or_with_another_is_an_orphan_not_wrong_kv(codec):
    base, dep = pair()
    reader = read_base(serialize_chunk(base, codec=codec), BASE, codec=codec)
    data = serialize_chunk(dep, codec=codec, base=reader)
    with pytest.raises(OrphanedEntryError, match="not stored"):
        deserialize_chunk(data, DEP, codec=codec)
    k, v = structured_kv(200, seed=7)  # the base key recomputed into other bytes: replaced
    replaced = read_base(serialize_chunk(ChunkKV(BASE, k, v), codec=codec), BASE, codec=codec)
    with pytest.raises(OrphanedEntryError, match="replaced"):
        deserialize_chunk(data, DEP, codec=codec, base=replaced)
    other = read_base(serialize_chunk(ChunkKV("e" * 64, base.keys, base.values), codec=codec), "e" * 64, codec=codec)
    with pytest.raises(OrphanedEntryError):
        deserialize_chunk(data, DEP, codec=codec, base=other)


def test_no_chains_no_other_codecs_and_a_signed_dependent_covers_its_base(codec):
    base, dep = pair()
    reader = read_base(serialize_chunk(base, codec=codec), BASE, codec=codec)
    data = serialize_chunk(dep, codec=codec, base=reader)
    with pytest.raises(CorruptEntryError, match="cannot be a base"):  # a dependent is never a base: no chains
        read_base(data, DEP, codec=codec)
    int8 = get_codec("int8")
    with pytest.raises(CorruptEntryError, match="cannot be a base"):  # int8 payloads are not integer codes to share
        read_base(serialize_chunk(base, codec=int8), BASE, codec=int8)
    with pytest.raises(ValueError, match="cannot be coded against"):
        serialize_chunk(dep, codec=int8, base=reader)
    small = ChunkKV(DEP, dep.keys[:, :, :50].contiguous(), dep.values[:, :, :50].contiguous(), base=BASE)
    with pytest.raises(ValueError, match="cannot be coded against"):  # another shape
        serialize_chunk(small, codec=codec, base=reader)
    signed = serialize_chunk(dep, codec=codec, base=reader, hmac_key=b"k" * 32)
    forged = signed.replace(BASE.encode(), b"f" * 64)  # another base named in the header: the signature fails
    with pytest.raises(CorruptEntryError, match="HMAC"):
        parse_layout(forged, DEP, len(forged), codec=codec, hmac_key=b"k" * 32)
    unsigned_reader = parse_layout(forged, DEP, len(forged), codec=codec)
    assert unsigned_reader.base == "f" * 64 and DEPENDENT_VERSION == "5"


def test_the_disk_tier_codes_against_a_base_it_holds_and_reads_layer_by_layer(tmp_path, codec):
    base, dep = pair()
    alone = DiskStore(tmp_path / "alone", 10 * 1024**2, codec=codec)
    alone.put(dep)  # no base stored: the entry alone, readable by itself
    assert alone.get(DEP) is not None and alone.stats.corrupt == alone.stats.vanished == 0
    store = DiskStore(tmp_path / "kv", 10 * 1024**2, codec=codec)
    store.put(base)
    store.put(dep)
    want = deserialize_chunk(serialize_chunk(dep, codec=codec), DEP, codec=codec)
    hit, hit_alone = store.open(DEP), alone.open(DEP)
    assert hit is not None and hit_alone is not None
    assert hit.kv.layout.total_bytes < 0.8 * hit_alone.kv.layout.total_bytes
    for i in (2, 0, 1):
        k, v = hit.kv.layer(i)
        assert torch.equal(k, want.keys[i]) and torch.equal(v, want.values[i])
    assert hit.kv.bytes_read == hit.kv.nbytes  # its own bytes and its base's
    got = store.get(DEP)
    assert got is not None and got.base == BASE and torch.equal(got.values, want.values)


def test_an_evicted_replaced_or_damaged_base_makes_its_dependent_a_deleted_miss(tmp_path, codec):
    base, dep = pair(tokens=2000)  # entries of more than 32 KB: diskcache keeps them as files
    store = DiskStore(tmp_path / "kv", 10 * 1024**2, codec=codec)
    store.put(base)
    store.put(dep)
    store.discard(BASE)  # evicted
    assert store.get(DEP) is None
    assert store.stats.vanished == 1 and store.stats.corrupt == 0 and DEP not in store  # deleted: never readable
    store.put(base)
    store.put(dep)
    k, v = structured_kv(2000, seed=7)
    store.put(ChunkKV(BASE, k, v))  # the base recomputed into other bytes
    assert store.open(DEP) is None and store.stats.vanished == 2 and DEP not in store
    store.put(base)
    store.put(dep)
    victim = next(p for p in (tmp_path / "kv").rglob("*.val") if f'"key":"{BASE}"'.encode() in p.read_bytes()[:8192])
    damaged = bytearray(victim.read_bytes())
    damaged[-10] ^= 0xFF  # in the base's last layer
    victim.write_bytes(bytes(damaged))
    hit = store.open(DEP)
    assert hit is not None
    with pytest.raises(CorruptEntryError):
        hit.kv.materialize()
    assert DEP not in store and store.stats.corrupt == 1


def test_a_base_reader_reads_only_the_layers_asked_for(codec):
    base, _ = pair()
    data = memoryview(serialize_chunk(base, codec=codec))
    asked = []

    def read(ranges):
        asked.extend(ranges)
        return [data[a:b] for a, b in ranges]

    layout = parse_layout(data, BASE, len(data), codec=codec)
    codes = BaseReader(layout, read).codes([1])
    assert asked == list(layout.layer_ranges(1)) and codes[0][0].shape == (2, 16, 200)

    def failing(ranges):
        raise OSError("I/O error")

    with pytest.raises(CorruptEntryError, match="could not be read"):  # a failed read is the entry's miss, not a crash
        BaseReader(layout, failing).codes([0])


def test_grouped_precompute_stores_captured_entries_against_their_isolated_ones(tmp_path):
    """The engine's captured entries on a pca disk tier are dependents, and a blend from them gives the logits of
    the same entries coded alone (a memory tier of pca entries), up to float32 rounding of the two load paths."""
    chunks = [random_words(i + 20, 30) for i in range(3)]

    def engine(store: StoreConfig) -> CacheBlendEngine:
        config = EngineConfig(chunk_separator="", store=store)
        return CacheBlendEngine(make_tiny_model("llama"), make_tiny_tokenizer(), config=config)

    on_disk = engine(StoreConfig(memory_budget_bytes=0, disk_dir=str(tmp_path / "kv"), kv_codec="pca"))
    in_memory = engine(StoreConfig(memory_codec="pca"))
    results = []
    for e in (on_disk, in_memory):
        e.precompute_groups([chunks], "a question?")
        e.store.flush()
        results.append(e.prefill(e.build_prompt(chunks, "a question?"), "blend"))
    disk = on_disk.store.tiers[1]
    plan = on_disk.chunks.place(on_disk.build_prompt(chunks, "a question?").prefix_ids, [
        on_disk.tokenizer.encode(c, add_special_tokens=False) for c in chunks])  # fmt: skip
    captured = [p.found for p in plan[1:]]
    assert all(k is not None for k in captured)
    for key in captured:
        kv = disk.get(key)
        assert kv is not None and kv.base  # stored against the chunk's isolated entry
    assert results[0].metrics.hits_by_tier.get("disk") == len(chunks)
    torch.testing.assert_close(results[0].logits, results[1].logits)  # float32 rounding apart (4.8e-7 of 3.1)


def test_the_redis_tier_codes_against_a_base_it_holds_and_orphans_when_it_goes(redis_server, codec):
    from cacheblend_rag.store.redis_store import RedisStore

    base, dep = pair()
    store = RedisStore(redis_server.url, 10 * 1024**2, namespace=f"dependents-{id(codec)}", codec=codec)
    store.put(dep)  # no base yet: stored alone
    alone = store.open(DEP)
    assert alone is not None and not alone.kv.layout.base
    alone_bytes = alone.kv.layout.total_bytes
    store.put(base)
    store.put(dep)  # now against the base
    want = deserialize_chunk(serialize_chunk(dep, codec=codec), DEP, codec=codec)
    hit = store.open(DEP)
    assert hit is not None and hit.kv.layout.base == BASE and hit.kv.layout.total_bytes < 0.8 * alone_bytes
    for i in (1, 2, 0):
        k, v = hit.kv.layer(i)
        assert torch.equal(k, want.keys[i]) and torch.equal(v, want.values[i])
    whole = store.get(DEP)
    assert whole is not None and torch.equal(whole.values, want.values) and whole.base == BASE
    store.discard(BASE)
    assert store.open(DEP) is None and store.get(DEP) is None
    assert store.stats.vanished == 1 and DEP not in store and store.stats.corrupt == 0
    store.clear()


def test_a_failed_read_of_the_base_is_a_miss_that_keeps_the_dependent(tmp_path, codec, monkeypatch):
    import sqlite3

    from cacheblend_rag.store.disk.index import GuardedIndex

    base, dep = pair()
    store = DiskStore(tmp_path / "kv", 10 * 1024**2, codec=codec)
    store.put(base)
    store.put(dep)
    read = GuardedIndex.read

    def base_unreadable(self, name):  # noqa: ANN001
        if name.startswith(BASE):
            raise sqlite3.OperationalError("disk I/O error")
        return read(self, name)

    monkeypatch.setattr(GuardedIndex, "read", base_unreadable)
    assert store.open(DEP) is None and store.stats.errors == 1
    assert DEP in store and store.stats.vanished == 0  # a failure, not an orphan: kept
    monkeypatch.setattr(GuardedIndex, "read", read)
    hit = store.open(DEP)
    assert hit is not None and hit.kv.materialize().base == BASE
