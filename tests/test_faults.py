"""Fault injection into the store tiers, as someone with write access to a cache folder or a Redis would do it.

One reproducer per defect a fault-injection review found (disk-tier path safety, bad entries, start-up errors, counters,
forged entries). Every bad entry must be a counted miss with an unchanged answer, never an exception, a hang, a
huge read or a file touched outside the tier's folder.
"""

from __future__ import annotations

import json
import os
import sqlite3
import struct
import threading
from pathlib import Path

import pytest
import torch
from store_helpers import make_kv

from cacheblend_rag import CacheBlendEngine, EngineConfig, StoreConfig
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store import DiskStore, MemoryStore, TieredStore
from cacheblend_rag.store.serialize import CorruptEntryError, parse_layout, serialize_chunk
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

CHUNKS = [random_words(501, 40), random_words(502, 40)]
BIG = 1024  # tokens: above diskcache's 32 KiB threshold, so the entry is a file named in cache.db
# The disk and Redis tiers here keep the exact codec, not the lossy default (int8): these tests check the tiers'
# bookkeeping bit for bit, against entries `serialize_chunk` writes in that codec. The default codec has its own
# tests in test_codec_store.py and test_codec.py.
EXACT_CODEC = "native"


def engine_on(pipelined: bool = True, **tiers) -> CacheBlendEngine:
    # memory_budget_bytes=0: nothing stays in process memory, every chunk comes from the lower tiers.
    store = StoreConfig(**{"memory_budget_bytes": 0, "kv_codec": EXACT_CODEC, **tiers})
    config = EngineConfig(miss_policy="blend", chunk_separator="", store=store)
    engine = CacheBlendEngine(make_tiny_model("qwen2"), make_tiny_tokenizer(), config=config)
    engine.prefiller.pipelined = pipelined  # False: each layer read when the fusor needs it (the reference)
    return engine


def ask(engine, chunks=CHUNKS):
    return engine.generate(chunks, prefix=random_words(1, 4), suffix=random_words(2, 5), max_new_tokens=6)


def warm_disk_engine(tmp_path, pipelined):
    """An engine on a disk tier whose chunks are stored, and its reference answer."""
    engine = engine_on(pipelined, disk_dir=str(tmp_path / "kv"))
    reference = ask(engine)
    engine.store.flush()
    assert ask(engine).metrics.hits_by_tier == {"disk": 2}
    return engine, reference, engine.store.tiers[1]


def set_rows(directory: Path, **columns) -> int:
    """Overwrite columns of every cache.db row that stores its value in a file; -> rows changed."""
    with sqlite3.connect(directory / "cache.db") as db:
        sets = ", ".join(f"{name} = ?" for name in columns)
        return db.execute(f"UPDATE Cache SET {sets} WHERE filename IS NOT NULL", tuple(columns.values())).rowcount


# ---------------------------------------------------------------- the disk tier follows only files it wrote


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "serial"])
@pytest.mark.parametrize("name", ["absolute", "dotdot"])
def test_disk_tier_never_reads_or_deletes_a_file_outside_its_folder(tmp_path, name, pipelined):
    engine, reference, disk = warm_disk_engine(tmp_path, pipelined)
    victim = tmp_path / "elsewhere" / "precious.txt"
    victim.parent.mkdir()
    victim.write_text("keep me")
    assert set_rows(tmp_path / "kv", filename=str(victim) if name == "absolute" else "../elsewhere/precious.txt")
    again = ask(engine)  # reads both rows (a miss each), drops them, recomputes and stores the chunks anew
    assert again.token_ids == reference.token_ids and again.metrics.chunks_missed == 2
    assert disk.stats.corrupt == 2
    # Eviction and clearing delete what rows name: plant the rows again, then evict everything.
    set_rows(tmp_path / "kv", filename=str(victim) if name == "absolute" else "../elsewhere/precious.txt")
    disk.clear()
    assert victim.read_text() == "keep me" and victim.parent.is_dir()


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "serial"])
def test_disk_tier_never_follows_a_symlink_in_place_of_a_value_file(tmp_path, pipelined):
    engine, reference, disk = warm_disk_engine(tmp_path, pipelined)
    outside = tmp_path / "outside"
    outside.mkdir()
    for f in (tmp_path / "kv").rglob("*.val"):  # a valid entry, moved out and linked back in
        target = outside / f.name
        f.rename(target)
        f.symlink_to(target)
    again = ask(engine)
    assert again.token_ids == reference.token_ids and again.metrics.chunks_missed == 2
    assert disk.stats.corrupt == 2 and len(list(outside.iterdir())) == 2


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "serial"])
def test_a_fifo_in_place_of_a_value_file_is_a_miss_and_never_blocks(tmp_path, pipelined):
    engine, reference, disk = warm_disk_engine(tmp_path, pipelined)
    for f in (tmp_path / "kv").rglob("*.val"):
        f.unlink()
        os.mkfifo(f)  # opening it for reading would wait forever for a writer
    answers = []
    worker = threading.Thread(target=lambda: answers.append(ask(engine)), daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "a request blocked on a FIFO in the disk tier"
    assert answers[0].token_ids == reference.token_ids and answers[0].metrics.chunks_missed == 2
    assert disk.stats.corrupt == 2


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "serial"])
def test_a_huge_sparse_value_file_is_a_miss_read_only_as_far_as_its_header(tmp_path, pipelined, monkeypatch):
    engine, reference, disk = warm_disk_engine(tmp_path, pipelined)
    for f in (tmp_path / "kv").rglob("*.val"):
        with f.open("r+b") as out:
            out.truncate(3 * 1024**3 // 2)  # 1.5 GB of zeros, almost none of it on disk
    reads: list[int] = []
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: reads.append(n) or real_pread(fd, n, offset))
    again = ask(engine)
    assert again.token_ids == reference.token_ids and again.metrics.chunks_missed == 2
    assert disk.stats.corrupt == 2 and max(reads) < 1024**2


# ---------------------------------------------------------------- malformed entries in every tier


def with_header(data: bytes, header: bytes) -> bytes:
    """`data` (a serialized entry) with its JSON header replaced by `header`, tensor bytes kept."""
    (n,) = struct.unpack_from("<Q", data)
    return struct.pack("<Q", len(header)) + header + data[8 + n :]


def edited_header(data: bytes, edit) -> bytes:
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + n])
    edit(header)
    return with_header(data, json.dumps(header).encode())


VALID = serialize_chunk(make_kv("chunk-a", tokens=BIG))
MALFORMED = {
    "900 KB of [": with_header(VALID, b"[" * 900_000),
    "200 KB of [ (deep nesting)": with_header(VALID, b"[" * 200_000),
    "header is a list": with_header(VALID, b"[1, 2]"),
    "header is not UTF-8": with_header(VALID, b'{"\xff": 1}'),
    "metadata is a list": edited_header(VALID, lambda h: h.update(__metadata__=[1])),
    "offsets are strings": edited_header(VALID, lambda h: h["keys"].update(data_offsets=["0", "64"])),
    "offsets are floats": edited_header(VALID, lambda h: h["keys"].update(data_offsets=[0.0, 1.5])),
    "offsets missing": edited_header(VALID, lambda h: h["values"].pop("data_offsets")),
    "shape not numbers": edited_header(VALID, lambda h: h["__metadata__"].update(shape="a,b,c,d")),
    "huge shape": edited_header(VALID, lambda h: h["__metadata__"].update(shape="2,2,99999999999,8")),
    "layer checksums missing": edited_header(VALID, lambda h: h["__metadata__"].pop("layer_sha256")),
    "tensor entry is a number": edited_header(VALID, lambda h: h.update(keys=7)),
}


@pytest.mark.parametrize("damage", list(MALFORMED))
def test_every_malformed_header_is_a_corrupt_entry_error(damage):
    with pytest.raises(CorruptEntryError):
        parse_layout(MALFORMED[damage], "chunk-a", len(MALFORMED[damage]))


@pytest.mark.parametrize("read", ["get", "open"])
@pytest.mark.parametrize("damage", list(MALFORMED))
def test_a_malformed_disk_entry_is_a_counted_miss(tmp_path, damage, read):
    store = DiskStore(tmp_path, budget_bytes=10 * 1024**2, codec=EXACT_CODEC)
    store._index.cache.set(store.entry_name("chunk-a"), MALFORMED[damage])  # another writer sharing the folder
    assert getattr(store, read)("chunk-a") is None
    assert store.stats.corrupt == 1 and store.stats.misses == 1 and "chunk-a" not in store


@pytest.mark.parametrize("read", ["get", "open"])
@pytest.mark.parametrize("damage", list(MALFORMED))
def test_a_malformed_redis_entry_is_a_counted_miss(redis_store, damage, read):
    redis_store.put(make_kv("chunk-a", tokens=BIG))
    redis_store._client.set(redis_store.value_key("chunk-a"), MALFORMED[damage])
    assert getattr(redis_store, read)("chunk-a") is None
    assert redis_store.stats.corrupt == 1 and redis_store.stats.misses == 1 and "chunk-a" not in redis_store


ROWS = {
    "text inline": dict(mode=1, value="not bytes", filename=None),
    "integer inline": dict(mode=1, value=12345, filename=None),
    "text mode": dict(mode=3, value=None),
    "pickle mode": dict(mode=4, value=b"\x80\x04K\x01."),
    "unknown mode": dict(mode=9),
    "no file name": dict(mode=2, filename=None),
}


@pytest.mark.parametrize("read", ["get", "open"])
@pytest.mark.parametrize("row", list(ROWS))
def test_a_disk_row_of_the_wrong_type_or_mode_is_a_counted_miss(tmp_path, row, read):
    store = DiskStore(tmp_path, budget_bytes=10 * 1024**2, codec=EXACT_CODEC)
    store.put(make_kv("chunk-a", tokens=BIG))
    assert set_rows(tmp_path, **ROWS[row]) == 1
    assert getattr(store, read)("chunk-a") is None
    assert store.stats.corrupt + store.stats.errors == 1 and store.stats.misses == 1 and "chunk-a" not in store
    store.put(make_kv("chunk-a", tokens=BIG))  # the row was dropped: the tier works on
    assert store.get("chunk-a") is not None


def test_a_disk_row_of_the_wrong_type_is_a_miss_under_the_engine(tmp_path):
    engine, reference, disk = warm_disk_engine(tmp_path, pipelined=True)
    set_rows(tmp_path / "kv", mode=1, value="text", filename=None)
    again = ask(engine)
    assert again.token_ids == reference.token_ids and again.metrics.chunks_missed == 2 and disk.stats.corrupt == 2


# ---------------------------------------------------------------- unusable disk folders at start-up


def garbled(folder: Path) -> Path:
    folder.mkdir()
    (folder / "cache.db").write_bytes(b"this is not a database" * 100)
    return folder


def test_a_garbled_cache_db_is_one_clear_error_at_start_up(tmp_path):
    folder = garbled(tmp_path / "kv")
    with pytest.raises(ConfigError, match=r"disk tier folder .*kv.* cache.db is damaged; delete the folder"):
        DiskStore(folder)
    with pytest.raises(ConfigError, match="cache.db is damaged"):
        CacheBlendEngine(
            make_tiny_model("qwen2"),
            make_tiny_tokenizer(),
            config=EngineConfig(miss_policy="blend", store=StoreConfig(disk_dir=str(folder))),
        )


def test_a_file_given_as_the_disk_folder_is_one_clear_error(tmp_path):
    (tmp_path / "kv").write_text("a file")
    with pytest.raises(ConfigError, match="it is a file; give a folder path"):
        DiskStore(tmp_path / "kv")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders anyway")
@pytest.mark.parametrize("filled", [False, True], ids=["empty", "filled"])
def test_a_read_only_disk_folder_is_one_clear_error(tmp_path, filled):
    folder = tmp_path / "kv"
    folder.mkdir()
    if filled:
        DiskStore(folder).close()
    folder.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="make it writable"):
            DiskStore(folder)
    finally:
        folder.chmod(0o700)


# ---------------------------------------------------------------- counters


def test_a_chunk_repeated_in_one_cold_request_is_one_miss():
    engine = CacheBlendEngine(
        make_tiny_model("qwen2"), make_tiny_tokenizer(), config=EngineConfig(miss_policy="blend", chunk_separator="")
    )
    chunk = random_words(503, 30)
    m = ask(engine, [chunk] * 6).metrics
    assert (m.chunks_missed, m.chunks_hit) == (1, 5)


def test_a_corrupt_entry_found_while_loading_layers_is_a_miss_not_also_a_hit(tmp_path):
    disk = DiskStore(tmp_path, budget_bytes=10 * 1024**2, codec=EXACT_CODEC)
    store = TieredStore([MemoryStore(0), disk], write_back=False)
    kv = make_kv("chunk-a", tokens=BIG)
    disk.put(kv)
    (_, _), (v0, _) = parse_layout(VALID, "chunk-a", len(VALID)).layer_ranges(1)
    (f,) = tmp_path.rglob("*.val")
    raw = bytearray(f.read_bytes())
    raw[v0 + 3] ^= 0x01
    f.write_bytes(bytes(raw))
    lazy = store.open("chunk-a").kv
    with pytest.raises(CorruptEntryError):
        lazy.layer(1)
    assert (disk.stats.hits, disk.stats.misses, disk.stats.corrupt) == (0, 1, 1)
    assert (store.stats.hits, store.stats.misses, store.hits_by_tier["disk"]) == (0, 1, 0)


def test_a_layer_damaged_under_the_engine_counts_one_miss_per_chunk(tmp_path):
    engine, reference, disk = warm_disk_engine(tmp_path, pipelined=True)
    files = sorted((tmp_path / "kv").rglob("*.val"), key=lambda f: f.stat().st_size)
    raw = bytearray(files[0].read_bytes())
    raw[-5] ^= 0x01  # the last layer's values: found only after the fusor has started
    files[0].write_bytes(bytes(raw))
    again = ask(engine)
    m = again.metrics
    assert again.token_ids == reference.token_ids
    assert (m.chunks_hit, m.chunks_missed) == (1, 1) and sum(m.hits_by_tier.values()) == 1


# ---------------------------------------------------------------- forged entries and the HMAC key

KEY = b"a secret of 32 bytes, not less.."


def forged(key: str) -> bytes:
    """A well-formed entry for `key` with other values: its checksums are right, so only a signature tells."""
    return serialize_chunk(make_kv(key, tokens=BIG, seed=99))


def test_with_an_hmac_key_the_disk_tier_refuses_entries_forged_without_it(tmp_path):
    signed = DiskStore(tmp_path, budget_bytes=10 * 1024**2, hmac_key=KEY, codec=EXACT_CODEC)
    signed.put(make_kv("chunk-a", tokens=BIG))
    assert signed.get("chunk-a") is not None
    unsigned = DiskStore(tmp_path, codec=EXACT_CODEC)
    assert unsigned.get("chunk-a") is None and unsigned.stats.corrupt == 0  # not its entry: a plain miss
    assert signed.get("chunk-a") is not None  # and it stays, for the readers with the key
    for forgery in (forged("chunk-a"), serialize_chunk(make_kv("chunk-a", tokens=BIG, seed=99), hmac_key=b"x" * 32)):
        signed._index.cache.set(signed.entry_name("chunk-a"), forgery)  # a writer that knows where signed ones lie
        assert signed.get("chunk-a") is None and signed.open("chunk-a") is None
    assert signed.stats.corrupt == 2


def test_with_an_hmac_key_the_redis_tier_refuses_entries_forged_without_it(redis_server):
    from cacheblend_rag.store import RedisStore

    signed = RedisStore(redis_server.url, namespace="hmac-test", hmac_key=KEY, codec=EXACT_CODEC)
    try:
        signed.put(make_kv("chunk-a", tokens=BIG))
        assert signed.open("chunk-a") is not None
        signed._client.set(signed.value_key("chunk-a"), forged("chunk-a"))
        assert signed.get("chunk-a") is None and signed.stats.corrupt == 1
    finally:
        signed.clear()
        signed.close()


def test_an_engine_with_an_hmac_key_answers_right_over_a_forged_disk_tier(tmp_path):
    engine = engine_on(disk_dir=str(tmp_path / "kv"), hmac_key=KEY)
    reference = ask(engine)
    engine.store.flush()
    signed = DiskStore(tmp_path / "kv", hmac_key=KEY, codec=EXACT_CODEC)
    for name in list(signed._index.cache):
        key = name.split(".", 1)[0]  # the chunk key (a hex digest), before the codec and signing key's digest
        good = signed.get(key)
        noisy = torch.randn_like(good.keys)
        signed._index.cache.set(name, serialize_chunk(type(good)(key, noisy, good.values)))  # forged, checksums right
    again = ask(engine)
    assert again.token_ids == reference.token_ids and again.metrics.chunks_missed == 2


def test_a_short_hmac_key_is_refused():
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        EngineConfig(miss_policy="blend", store=StoreConfig(hmac_key="short"))
