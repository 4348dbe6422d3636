"""Fault injection into the disk tier's SQLite index (`cache.db`) and into the counters of every tier.

Whoever can write the folder can write `cache.db`: plant triggers that never end, a blob of hundreds of MB, or
settings rows diskcache would obey. Each is dropped, bounded or overridden: every call returns in bounded time,
and a bad row is a counted miss, never a hang, a huge read or a raw exception. An entry that the engine drops as
damaged is counted as a miss, never as a hit.
"""

from __future__ import annotations

import sqlite3
import threading
import tracemalloc
from pathlib import Path

import diskcache
import pytest
from store_helpers import make_kv, same
from test_faults import ask, warm_disk_engine

from cacheblend_rag.store import DiskStore, MemoryStore, TieredStore

BIG = 1024  # tokens: above diskcache's 32 KiB threshold, so the entry is a value file named in cache.db
MB = 1024**2
# The disk tier here keeps the exact codec, not the lossy default (int8): these tests check its bookkeeping bit for
# bit. The default codec has its own tests in test_codec_store.py and test_codec.py.
EXACT_CODEC = "native"
# An endless recursive query: counting it would take hours. Planted in a trigger, it hangs whoever fires it.
ENDLESS = "SELECT (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c)"


def within(seconds: float, call):
    """`call()`'s result, or a failure if it has not returned after `seconds` (the call is left running)."""
    out: list = []
    worker = threading.Thread(target=lambda: out.append(call()), daemon=True)
    worker.start()
    worker.join(timeout=seconds)
    assert not worker.is_alive(), f"the call hung for more than {seconds} s"
    return out[0]


def sql(folder: Path, *statements: str) -> list:
    with sqlite3.connect(folder / "cache.db", isolation_level=None) as db:
        return [db.execute(s).fetchall() for s in statements][-1]


def stored(folder: Path, *kvs) -> None:
    store = DiskStore(folder, budget_bytes=10 * MB, codec=EXACT_CODEC)
    for kv in kvs:
        store.put(kv)
    store.close()


# ---------------------------------------------------------------- schema objects the store never creates


def test_triggers_views_and_indexes_planted_in_cache_db_are_dropped_at_open(tmp_path):
    folder = tmp_path / "kv"
    stored(folder, make_kv("chunk-a", tokens=BIG))
    sql(
        folder,
        f"CREATE TRIGGER on_insert AFTER INSERT ON Cache BEGIN {ENDLESS}; END",
        f"CREATE TRIGGER on_read AFTER UPDATE ON Cache BEGIN {ENDLESS}; END",  # a read updates the access time
        "CREATE VIEW peek AS SELECT key FROM Cache",
        "CREATE INDEX planted ON Cache (tag)",
    )

    def use():
        store = DiskStore(folder, budget_bytes=10 * MB, codec=EXACT_CODEC)
        store.put(make_kv("chunk-b"))
        return store.get("chunk-a"), store.get("chunk-b")

    a, b = within(20, use)
    assert same(a, make_kv("chunk-a", tokens=BIG)) and same(b, make_kv("chunk-b"))
    names = {name for (name,) in sql(folder, "SELECT name FROM sqlite_master")}
    assert not names & {"on_insert", "on_read", "peek", "planted"}


def test_a_trigger_planted_while_the_store_is_open_makes_misses_not_hangs(tmp_path):
    store = DiskStore(tmp_path / "kv", budget_bytes=10 * MB, timeout_s=0.5, codec=EXACT_CODEC)
    store.put(make_kv("chunk-a", tokens=BIG))
    sql(
        tmp_path / "kv",
        f"CREATE TRIGGER on_insert AFTER INSERT ON Cache BEGIN {ENDLESS}; END",
        f"CREATE TRIGGER on_read AFTER UPDATE ON Cache BEGIN {ENDLESS}; END",
    )
    assert within(20, lambda: store.get("chunk-a")) is None  # within: a hang fails the test, not the suite
    within(20, lambda: store.put(make_kv("chunk-b", tokens=BIG)))
    assert store.stats.misses == 1 and store.stats.errors == 2 and store.stats.puts == 1
    assert len(list((tmp_path / "kv").rglob("*.val"))) == 1  # chunk-a's: the failed put left no file


def test_a_row_the_index_refuses_leaves_no_value_file_behind(tmp_path):
    store = DiskStore(tmp_path / "kv", budget_bytes=10 * MB, codec=EXACT_CODEC)
    sql(tmp_path / "kv", "CREATE TRIGGER refuse BEFORE INSERT ON Cache BEGIN SELECT RAISE(ABORT, 'no room'); END")
    for i in range(3):
        store.put(make_kv(f"chunk-{i}", tokens=BIG, seed=i))
    assert store.stats.errors == 3 and list((tmp_path / "kv").rglob("*.val")) == []


def test_a_view_planted_in_place_of_the_index_table_while_the_store_is_open_makes_misses_not_hangs(tmp_path):
    """The tier's own reads of `cache.db` are interrupted after `timeout_s`; its writes refuse the planted view."""
    store = DiskStore(tmp_path / "kv", budget_bytes=10 * MB, timeout_s=0.5, codec=EXACT_CODEC)
    store.put(make_kv("chunk-a", tokens=BIG))
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c)"
    sql(
        tmp_path / "kv",
        "DROP TABLE Cache",
        f"CREATE VIEW Cache AS {endless} SELECT '{store.entry_name('chunk-a')}' AS key, 1 AS raw, x AS value "
        "FROM c WHERE x < 0",
    )
    assert within(20, lambda: store.get("chunk-a")) is None  # the view's scan never ends by itself
    within(20, lambda: store.put(make_kv("chunk-b", tokens=BIG)))
    assert store.stats.misses == 1 and store.stats.errors == 2 and store.stats.puts == 1


def test_a_write_rolled_back_after_its_value_file_was_written_leaves_the_old_entry_and_no_new_file(
    tmp_path, monkeypatch
):
    """Value files follow their transaction: the one written for a row that was not committed is deleted, and the
    one that row would have replaced stays, with its entry."""
    store = DiskStore(tmp_path / "kv", budget_bytes=10 * MB, codec=EXACT_CODEC)
    old = make_kv("chunk-a", tokens=BIG)
    store.put(old)
    (old_file,) = (tmp_path / "kv").rglob("*.val")
    set_row = diskcache.Cache.set

    def set_then_fail(cache, *args, **kwargs):  # the row is written, then its transaction fails (as at commit)
        set_row(cache, *args, **kwargs)
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(diskcache.Cache, "set", set_then_fail)
    store.put(make_kv("chunk-a", tokens=BIG, seed=1))
    store.put(make_kv("chunk-b", tokens=BIG, seed=2))
    monkeypatch.undo()
    assert list((tmp_path / "kv").rglob("*.val")) == [old_file]
    assert same(store.get("chunk-a"), old) and "chunk-b" not in store and store.stats.errors == 2


# ---------------------------------------------------------------- oversized values


@pytest.mark.parametrize("read", ["get", "open"])
def test_a_huge_inline_value_is_a_miss_without_being_read(tmp_path, read):
    folder = tmp_path / "kv"
    stored(folder, make_kv("chunk-a"))  # small: kept inline, inside cache.db
    sql(folder, f"UPDATE Cache SET value = zeroblob({48 * MB})")
    store = DiskStore(folder, budget_bytes=10 * MB, codec=EXACT_CODEC)
    tracemalloc.start()
    try:
        assert getattr(store, read)("chunk-a") is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * MB, f"{peak / MB:.0f} MB held to refuse one entry"
    assert store.stats.corrupt == 1 and store.stats.misses == 1 and "chunk-a" not in store


# ---------------------------------------------------------------- settings rows the store did not write

PLANTED_SETTINGS = {
    "min file size not a number": ("disk_min_file_size", "abc"),
    "an unknown disk setting": ("disk_surprise", 1),
    "a setting naming a method": ("close", 1),
    "size limit not a number": ("size_limit", "abc"),
    "an unknown eviction policy": ("eviction_policy", "nonsense"),
    "entry count not a number": ("count", "abc"),
    "volume not a number": ("size", "abc"),
}


@pytest.mark.parametrize("planted", list(PLANTED_SETTINGS))
def test_settings_rows_planted_in_cache_db_are_overridden(tmp_path, planted):
    folder = tmp_path / "kv"
    stored(folder, make_kv("chunk-a", tokens=BIG))
    with sqlite3.connect(folder / "cache.db") as db:
        db.execute("INSERT OR REPLACE INTO Settings VALUES (?, ?)", PLANTED_SETTINGS[planted])
    store = DiskStore(folder, budget_bytes=10 * MB, codec=EXACT_CODEC)
    store.put(make_kv("chunk-b", tokens=BIG))
    store.put(make_kv("chunk-c"))
    assert all(store.get(k) is not None for k in ("chunk-a", "chunk-b", "chunk-c"))
    assert len(store) == 3 and store.stats.errors == 0 and store.stats.corrupt == 0


def test_a_planted_exclusive_locking_mode_never_locks_out_a_second_process(tmp_path):
    folder = tmp_path / "kv"
    stored(folder, make_kv("chunk-a"))
    sql(folder, "INSERT INTO Settings VALUES ('sqlite_locking_mode', 'EXCLUSIVE')")
    first = DiskStore(folder, budget_bytes=10 * MB, codec=EXACT_CODEC)
    first.put(make_kv("chunk-b"))
    assert first.get("chunk-a") is not None
    # its own connection, as another process
    second = within(10, lambda: DiskStore(folder, budget_bytes=10 * MB, codec=EXACT_CODEC))
    assert within(10, lambda: second.get("chunk-b")) is not None
    second.put(make_kv("chunk-c"))
    assert first.get("chunk-c") is not None


# ---------------------------------------------------------------- counters: a dropped entry is no hit


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "serial"])
def test_an_entry_the_engine_drops_as_damaged_counts_as_a_miss_in_the_tier(tmp_path, pipelined):
    engine, reference, disk = warm_disk_engine(tmp_path, pipelined)
    suffix = disk.entry_name("").removeprefix(".")  # what the tier adds to a key: "." and its codec's name
    keys = [name.removesuffix("." + suffix) for (name,) in sql(tmp_path / "kv", "SELECT key FROM Cache")]
    for key in keys:  # well-formed entries under the chunks' keys, with a shape this model never makes
        disk.put(make_kv(key, tokens=3))
    engine.store.flush()
    hits, misses, stack_hits = disk.stats.hits, disk.stats.misses, engine.store.hits_by_tier["disk"]
    again = ask(engine)
    assert again.token_ids == reference.token_ids and again.metrics.chunks_missed == 2
    n = len(keys)  # the two chunks' entries and the prefix's
    captured = 1  # the second chunk looks up its captured entry first (capture="all"): never stored here
    assert disk.stats.hits == hits and disk.stats.misses == misses + n + captured and disk.stats.corrupt == n
    assert engine.store.hits_by_tier["disk"] == stack_hits and engine.store.stats.hits == stack_hits


@pytest.mark.parametrize("lower", ["disk", "redis"])
def test_a_hit_discarded_unread_is_taken_back_but_a_read_one_is_not(tmp_path, request, lower):
    if lower == "disk":
        disk = DiskStore(tmp_path / "kv", budget_bytes=10 * MB, codec=EXACT_CODEC)
    else:
        disk = request.getfixturevalue("redis_store")
    store = TieredStore([MemoryStore(0), disk], write_back=False)
    store.put(make_kv("chunk-a", tokens=BIG))
    store.put(make_kv("chunk-b", tokens=BIG))
    refused = store.open("chunk-a")
    assert refused is not None
    store.discard("chunk-a")  # the caller refused it unread, as the engine does an entry of the wrong shape
    read = store.open("chunk-b")
    read.kv.materialize()
    store.discard("chunk-b")  # used, then deleted
    assert (disk.stats.hits, disk.stats.misses, disk.stats.corrupt) == (1, 1, 1)
    assert (store.stats.hits, store.stats.misses, store.hits_by_tier[disk.name]) == (1, 1, 1)
