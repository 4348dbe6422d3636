"""The store tiers below process memory: serialization, the disk tier, and the tiered stack (the Redis tier is in
test_store_redis.py, the protocol every store shares in test_store_protocol.py)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from store_helpers import EXACT_CODEC, make_kv, same

from cacheblend_rag.store.chunk_kv import ChunkKV
from cacheblend_rag.store.disk.tier import DiskStore
from cacheblend_rag.store.memory import MemoryStore
from cacheblend_rag.store.serialize import (
    CorruptEntryError,
    deserialize_chunk,
    header_length,
    parse_layout,
    serialize_chunk,
)
from cacheblend_rag.store.tiered import TieredStore, build_store

# ---------------------------------------------------------------- serialization


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_serialization_round_trips_bit_exact(dtype):
    kv = make_kv("chunk-a", dtype=dtype)
    out = deserialize_chunk(serialize_chunk(kv, fingerprint="model-x"), "chunk-a")
    assert same(out, kv)


def test_serialization_accepts_non_contiguous_tensors():
    base = make_kv("chunk-a", tokens=6)
    # [L, Hkv, D, T] -> transposed view [L, Hkv, T, D]: same shape as a chunk, not contiguous
    keys = base.keys.transpose(2, 3).contiguous().transpose(2, 3)
    kv = ChunkKV("chunk-a", keys, base.values)
    assert not kv.keys.is_contiguous()
    assert same(deserialize_chunk(serialize_chunk(kv), "chunk-a"), kv)


def _tamper(data: bytes, old: bytes, new: bytes) -> bytes:
    assert len(old) == len(new) and data.count(old) == 1
    return data.replace(old, new)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: d[:5], "too short"),
        (lambda d: d[:40], "truncated"),
        (lambda d: d[:-7], "truncated"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 0x01]), "sha256"),  # one bit flipped in the tensor data
        (lambda d: b"\xff" * len(d), "garbled|truncated|unreadable"),
        (lambda d: _tamper(d, b'"float32"', b'"float16"'), "valid 'keys'"),  # mislabelled dtype
        (lambda d: _tamper(d, b'"2,2,4,8"', b'"2,2,8,4"'), "valid 'keys'"),  # mislabelled shape
        (lambda d: _tamper(d, b'"version":"3"', b'"version":"9"'), "format version"),
    ],
    ids=["header-cut", "body-cut", "tail-cut", "bit-flip", "garbage", "dtype", "shape", "version"],
)
def test_damaged_bytes_raise_corrupt_entry_error(damage, message):
    data = serialize_chunk(make_kv("chunk-a"))
    with pytest.raises(CorruptEntryError, match=message):
        deserialize_chunk(damage(data), "chunk-a")


def test_layers_read_one_at_a_time_equal_the_whole_entry():
    kv = make_kv("chunk-a", dtype=torch.bfloat16)
    data = serialize_chunk(kv)
    layout = parse_layout(data[: header_length(data, "chunk-a")], "chunk-a", len(data))
    assert layout.num_layers == kv.num_layers
    for i in range(layout.num_layers):
        (k0, k1), (v0, v1) = layout.layer_ranges(i)
        k, v = layout.decode_layer(i, data[k0:k1], data[v0:v1])
        assert torch.equal(k, kv.keys[i]) and torch.equal(v, kv.values[i])


def test_a_damaged_layer_is_caught_when_that_layer_is_read():
    kv = make_kv("chunk-a")
    data = bytearray(serialize_chunk(kv))
    layout = parse_layout(bytes(data), "chunk-a", len(data))
    (k0, _), _ = layout.layer_ranges(1)
    data[k0 + 3] ^= 0x10  # one bit in layer 1's keys
    ranges = [layout.layer_ranges(i) for i in range(layout.num_layers)]
    (k0, k1), (v0, v1) = ranges[0]
    layout.decode_layer(0, data[k0:k1], data[v0:v1])  # layer 0 is intact
    (k0, k1), (v0, v1) = ranges[1]
    with pytest.raises(CorruptEntryError, match="layer 1 fails its sha256"):
        layout.decode_layer(1, data[k0:k1], data[v0:v1])
    with pytest.raises(CorruptEntryError, match="truncated"):
        layout.decode_layer(0, data[ranges[0][0][0] : ranges[0][0][1] - 1], data[v0:v1])


def test_entry_of_another_key_is_corrupt():
    data = serialize_chunk(make_kv("chunk-a"))
    with pytest.raises(CorruptEntryError, match="belongs to chunk chunk-a"):
        deserialize_chunk(data, "chunk-b")


# ---------------------------------------------------------------- disk tier

BIG_TOKENS = 1024  # 2 x [2, 2, 1024, 8] fp32 = 128 KiB per entry: above diskcache's 32 KiB file threshold


def test_disk_round_trip_and_counters(tmp_path):
    store = DiskStore(tmp_path, budget_bytes=10 * 1024**2, codec=EXACT_CODEC)
    kv = make_kv("chunk-a", dtype=torch.bfloat16)
    assert store.get("chunk-a") is None
    store.put(kv)
    assert "chunk-a" in store and len(store) == 1
    assert same(store.get("chunk-a"), kv)
    assert (store.stats.hits, store.stats.misses, store.stats.puts) == (1, 1, 1)
    store.discard("chunk-a")
    assert "chunk-a" not in store and len(store) == 0


def test_disk_eviction_keeps_budget_and_drops_least_recently_used(tmp_path):
    entry = len(serialize_chunk(make_kv("x", tokens=BIG_TOKENS)))
    budget = 32 * 1024 + 4 * entry + entry // 2  # the index plus four and a half entries
    store = DiskStore(tmp_path, budget_bytes=budget, codec=EXACT_CODEC)
    for i, name in enumerate("abcd"):
        store.put(make_kv(name, tokens=BIG_TOKENS, seed=i))
    assert len(store) == 4 and store.stats.evictions == 0
    assert store.get("a") is not None  # a becomes the most recently used; b is now the oldest
    store.put(make_kv("e", tokens=BIG_TOKENS, seed=4))
    assert store.nbytes <= budget
    assert "b" not in store
    assert all(name in store for name in "acde")
    assert store.stats.evictions == 1


def test_disk_put_over_budget_evicts_least_recently_used_one_at_a_time_and_no_more(tmp_path):
    """The tier evicts for itself, one entry at a time (diskcache's own cull removes ten at once): a put that
    outweighs several entries evicts just enough of the least recently used ones, never the entry it stores."""
    entry = len(serialize_chunk(make_kv("x", tokens=BIG_TOKENS)))
    budget = 32 * 1024 + 6 * entry + entry // 2  # the index plus six and a half entries
    store = DiskStore(tmp_path, budget_bytes=budget, codec=EXACT_CODEC)
    for i, name in enumerate("abcdef"):
        store.put(make_kv(name, tokens=BIG_TOKENS, seed=i))
    store.put(make_kv("a", tokens=BIG_TOKENS, seed=9))  # stored again: now the most recently used
    assert len(store) == 6 and store.stats.evictions == 0
    store.put(make_kv("big", tokens=4 * BIG_TOKENS))  # four entries' worth: b, c, d and e make room
    assert store.nbytes <= budget
    assert [name for name in ("a", "b", "c", "d", "e", "f", "big") if name in store] == ["a", "f", "big"]
    assert store.stats.evictions == 4 and same(store.get("a"), make_kv("a", tokens=BIG_TOKENS, seed=9))


def test_disk_entry_larger_than_budget_is_not_kept(tmp_path):
    store = DiskStore(tmp_path, budget_bytes=64 * 1024, codec=EXACT_CODEC)
    store.put(make_kv("small"))
    store.put(make_kv("huge", tokens=BIG_TOKENS))
    assert "huge" not in store and "small" in store


def test_disk_overwritten_value_file_is_a_logged_miss_and_removed(tmp_path, caplog):
    store = DiskStore(tmp_path, budget_bytes=10 * 1024**2)
    store.put(make_kv("chunk-a", tokens=BIG_TOKENS))
    (value_file,) = tmp_path.rglob("*.val")
    raw = bytearray(value_file.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 64] = b"\0" * 64
    value_file.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.store.disk.tier"):
        assert store.get("chunk-a") is None
    assert "chunk-a" not in store
    assert store.stats.corrupt == 1 and store.stats.misses == 1
    assert "corrupt" in caplog.text and "sha256" in caplog.text


@pytest.mark.parametrize("planted", [b"garbage bytes", {"a pickled": "dict"}, "a string"])
def test_disk_foreign_value_is_a_miss_and_never_unpickled(tmp_path, planted):
    diskcache = pytest.importorskip("diskcache")
    store = DiskStore(tmp_path, budget_bytes=10 * 1024**2)
    diskcache.Cache(str(tmp_path)).set(store.entry_name("chunk-a"), planted)  # another writer sharing the directory
    assert store.get("chunk-a") is None
    assert "chunk-a" not in store
    assert store.stats.corrupt == 1


def test_disk_entries_survive_reopening(tmp_path):
    DiskStore(tmp_path, budget_bytes=10 * 1024**2, codec=EXACT_CODEC).put(make_kv("chunk-a"))
    assert same(DiskStore(tmp_path, budget_bytes=10 * 1024**2, codec=EXACT_CODEC).get("chunk-a"), make_kv("chunk-a"))


# ---------------------------------------------------------------- tiered stack


def test_tiered_hit_in_lower_tier_is_promoted(tmp_path):
    memory, disk = MemoryStore(10 * 1024**2), DiskStore(tmp_path, 10 * 1024**2, codec=EXACT_CODEC)
    store = TieredStore([memory, disk], names=["memory", "disk"])
    kv = make_kv("chunk-a")
    disk.put(kv)
    assert "chunk-a" not in memory
    assert same(store.get("chunk-a"), kv)
    assert "chunk-a" in memory
    assert store.get("chunk-a") is not None
    assert store.get("chunk-b") is None
    assert store.hits_by_tier == {"memory": 1, "disk": 1}
    assert (store.stats.hits, store.stats.misses) == (2, 1)


def test_tiered_put_writes_through_and_serves_after_memory_eviction(tmp_path):
    store = build_store(
        memory_bytes=make_kv("x").nbytes, disk_dir=tmp_path, disk_bytes=10 * 1024**2, kv_codec=EXACT_CODEC
    )
    memory, disk = store.tiers
    store.put(make_kv("chunk-a", seed=1))
    store.put(make_kv("chunk-b", seed=2))  # memory holds one entry: chunk-a leaves it
    store.flush()  # lower tiers are written in the background
    assert "chunk-a" not in memory and "chunk-a" in disk
    assert same(store.get("chunk-a"), make_kv("chunk-a", seed=1))
    assert store.hits_by_tier == {"memory": 0, "disk": 1}
    assert set(store.tier_stats()) == {"memory", "disk"}


class HeldTier(MemoryStore):
    """A memory tier whose writes wait until `release` is set (at most 10 s): a slow disk or Redis, held."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__(10 * 1024**2, name="slow")
        self.release = release

    def put(self, kv):
        self.release.wait(timeout=10)
        super().put(kv)


def test_tiered_put_never_waits_on_a_slow_lower_tier():
    release = threading.Event()
    slow = HeldTier(release)
    store = TieredStore([MemoryStore(10 * 1024**2), slow])
    store.put(make_kv("chunk-a"))  # returns although the slow tier is still blocked
    assert store.get("chunk-a") is not None and "chunk-a" not in slow
    release.set()
    store.flush(timeout=10)
    assert "chunk-a" in slow
    store.close()


def test_a_chunk_still_being_written_down_is_served_from_its_copy_not_recomputed():
    """The first tier keeps no room for the chunk (a zero memory budget); the disk write is held back. Until it
    lands, a lookup is a hit from the copy being written, counted for the tier it is going to; after it lands, the
    tier itself serves it. A chunk the writer has not been given is still a miss."""
    release = threading.Event()
    slow = HeldTier(release)
    store = TieredStore([MemoryStore(0), slow])
    kv = make_kv("chunk-a", seed=3)
    store.put(kv)
    assert "chunk-a" not in slow and "chunk-a" in store
    held = store.open("chunk-a")
    assert held is not None and held.tier == "slow" and same(held.kv.materialize(), kv)
    assert same(store.get("chunk-a"), kv) and store.get("chunk-b") is None
    assert store.hits_by_tier == {"memory": 0, "slow": 2} and (store.stats.hits, store.stats.misses) == (2, 1)
    assert slow.stats.hits == 0  # the slow tier itself was never asked for the chunk still on its way
    release.set()
    store.flush(timeout=10)
    assert same(store.get("chunk-a"), kv) and slow.stats.hits == 1
    store.discard("chunk-a")
    assert store.get("chunk-a") is None and "chunk-a" not in store
    store.close()


def test_tiered_clear_empties_the_named_tiers_only(tmp_path):
    from cacheblend_rag.errors import ConfigError

    store = build_store(disk_dir=tmp_path, disk_bytes=10 * 1024**2)
    memory, disk = store.tiers
    store.put(make_kv("chunk-a"))
    store.clear(["memory"])  # waits for the background write first, so disk keeps the chunk
    assert "chunk-a" not in memory and "chunk-a" in disk
    assert store.get("chunk-a") is not None  # served from disk, promoted back into memory
    with pytest.raises(ConfigError, match="no tier named"):
        store.clear(["memory", "ssd"])
    assert "chunk-a" in memory  # a bad name clears nothing
    store.clear()
    assert len(store) == 0 and "chunk-a" not in store
    assert store.stats.puts == 1  # counters survive a clear


def test_tiered_rejects_duplicate_names():
    from cacheblend_rag.errors import ConfigError

    with pytest.raises(ConfigError, match="distinct"):
        TieredStore([MemoryStore(), MemoryStore()])


def test_the_disk_folder_stays_within_its_budget_with_the_sqlite_log_and_no_empty_folders(tmp_path):
    budget = 8 * 2**20
    store = DiskStore(tmp_path / "kv", budget_bytes=budget, codec=EXACT_CODEC)
    for i in range(180):  # ~190 KB entries: the budget holds about 40 of them
        store.put(make_kv(f"chunk-{i}", tokens=1500, seed=i))
        if i % 3 == 0:
            store.get(f"chunk-{i // 2}")  # reads and misses, as requests make them
    files = [p for p in (tmp_path / "kv").rglob("*") if p.is_file()]
    folders = [p for p in (tmp_path / "kv").rglob("*") if p.is_dir()]
    total = sum(p.stat().st_size for p in files)
    wal = tmp_path / "kv" / "cache.db-wal"
    assert total <= budget + 1.25 * 2**20, (total, wal.stat().st_size if wal.exists() else 0)
    assert not [f for f in folders if not any(f.iterdir())]  # an emptied value folder is removed
    assert len(store) > 20
