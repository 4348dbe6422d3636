"""Store faults that arrive while the engine is serving: a disk folder that fills up or turns read-only, a
process killed while it precomputes to disk (the Redis tier's: `test_faults_runtime_redis.py`).

Whatever happens underneath, a request answers as it does over a healthy store, each failed write is counted in
its tier's stats, and nothing hangs or retries a failing write over and over: the disk tier makes at most one
write attempt while its folder stays full or read-only (it pauses its writes, `disk_pause`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import diskcache
import pytest
from store_helpers import make_kv, same

from cacheblend_rag import CacheBlendEngine, EngineConfig, StoreConfig
from cacheblend_rag.store import DiskStore
from cacheblend_rag.store.disk import files as disk_files
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

EXACT_CODEC = "native"  # bit-exact entries, so an answer over stored chunks matches one over recomputed chunks
BIG = 1024  # tokens: above diskcache's 32 KiB threshold, so the entry is a value file
MB = 1024**2


def engine_on(store=None, **tiers) -> CacheBlendEngine:
    # memory_budget_bytes=0: nothing stays in process memory, every chunk comes from the lower tiers.
    settings = StoreConfig(**{"memory_budget_bytes": 0, "kv_codec": EXACT_CODEC, **tiers})
    config = EngineConfig(miss_policy="blend", chunk_separator="", store=settings)
    return CacheBlendEngine(make_tiny_model("qwen2"), make_tiny_tokenizer(), config=config, store=store)


def chunks_of(seed: int, n: int = 2) -> list[str]:
    return [random_words(seed * 10 + i, 40) for i in range(n)]


def ask(engine, chunks):
    return engine.generate(chunks, prefix=random_words(1, 4), suffix=random_words(2, 5), max_new_tokens=6)


class WriteFaults:
    """Makes the disk tier's writes into `folder` fail as a full or read-only folder does, from `start()` on, and
    counts them.

    The lowest writes the tier makes: a value file (`disk_files.write_value_file`, an OSError with `errno`) and a
    transaction on `cache.db` (diskcache's `Cache.transact`, in which the tier makes every change to its index),
    which fails inside with SQLite's own message (a sqlite3.OperationalError). Reads pass, and so does everything
    in other folders.
    """

    def __init__(self, monkeypatch, kind: str, folder: Path) -> None:
        folder = os.fspath(folder)
        self.attempts = 0
        self.failing = False
        code = errno.ENOSPC if kind == "full" else errno.EROFS
        sql_message = "database or disk is full" if kind == "full" else "attempt to write a readonly database"
        write_file = disk_files.write_value_file
        faults = self

        def write_value_file(directory, filename, data):
            if faults.failing and directory == folder:
                faults.attempts += 1
                raise OSError(code, os.strerror(code))
            return write_file(directory, filename, data)

        transact = diskcache.Cache.transact

        @contextlib.contextmanager
        def failing_transact(cache, retry=False):
            with transact(cache, retry):
                if faults.failing and cache.directory == folder:
                    faults.attempts += 1
                    raise sqlite3.OperationalError(sql_message)
                yield

        monkeypatch.setattr(disk_files, "write_value_file", write_value_file)
        monkeypatch.setattr(diskcache.Cache, "transact", failing_transact)

    def start(self) -> None:
        self.failing = True

    def stop(self) -> None:
        self.failing = False


# ---------------------------------------------------------------- a folder that fills up or turns read-only


@pytest.mark.parametrize("kind", ["full", "read-only"])
def test_a_disk_that_fails_every_write_mid_run_costs_one_write_attempt_and_answers_right(
    tmp_path, monkeypatch, kind, one_thread
):
    """Warm chunks keep coming from disk (reads need no write), new chunks are recomputed, the failed write is
    counted, and the tier stops writing instead of failing every put and every LRU touch of every request."""
    healthy = engine_on(disk_dir=str(tmp_path / "healthy"))
    engine = engine_on(disk_dir=str(tmp_path / "kv"))
    faults = WriteFaults(monkeypatch, kind, tmp_path / "kv")
    requests = [chunks_of(1), chunks_of(2), chunks_of(1), chunks_of(3), chunks_of(2), chunks_of(4), chunks_of(1)]
    ask(engine, chunks_of(1))
    engine.store.flush()
    faults.start()
    for i, chunks in enumerate(requests):
        expected = ask(healthy, chunks)
        healthy.store.flush()
        got = ask(engine, chunks)
        engine.store.flush()
        assert got.text == expected.text, f"request {i}"
        if chunks == chunks_of(1):  # stored before the fault: still read from disk
            assert got.metrics.hits_by_tier == {"disk": 2}, f"request {i}"
    disk = engine.store.tier_stats()["disk"]
    assert faults.attempts == 1, f"{faults.attempts} write attempts over {len(requests)} requests"
    assert disk.errors == 1 and disk.skipped > 0 and disk.puts == 3  # the prefix and chunks_of(1) before it


def test_writes_resume_once_the_pause_is_over_and_the_disk_takes_them(tmp_path, monkeypatch, caplog):
    store = DiskStore(tmp_path / "kv", budget_bytes=10 * MB, codec=EXACT_CODEC, write_pause_s=0.2)
    faults = WriteFaults(monkeypatch, "full", tmp_path / "kv")
    faults.start()
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.store"):
        for i in range(5):
            store.put(make_kv(f"chunk-{i}", tokens=BIG, seed=i))
        assert faults.attempts == 1 and store.stats.errors == 1 and store.stats.skipped == 4
        time.sleep(0.25)
        store.put(make_kv("chunk-5", tokens=BIG))  # the pause is over: one more try, which fails
        assert faults.attempts == 2 and store.stats.errors == 2
        faults.stop()
        time.sleep(0.25)
        store.put(make_kv("chunk-6", tokens=BIG))
    assert same(store.get("chunk-6"), make_kv("chunk-6", tokens=BIG)) and store.stats.puts == 1
    messages = [r.getMessage() for r in caplog.records]
    assert sum("is full" in m and "pausing its writes" in m for m in messages) == 1, messages
    assert sum("takes writes again" in m for m in messages) == 1, messages


def test_a_failure_that_is_not_a_full_or_read_only_disk_does_not_pause_writes(tmp_path, monkeypatch):
    store = DiskStore(tmp_path / "kv", budget_bytes=10 * MB, codec=EXACT_CODEC)
    calls = []

    def broken(directory, filename, data):
        calls.append(filename)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk_files, "write_value_file", broken)
    for i in range(3):
        store.put(make_kv(f"chunk-{i}", tokens=BIG, seed=i))
    assert len(calls) == 3 and store.stats.errors == 3 and store.stats.skipped == 0


def test_a_read_only_index_still_serves_the_stored_entries(tmp_path, monkeypatch):
    """The LRU touch of a read is a write: refused, the entry is still read, and the tier stops touching."""
    store = DiskStore(tmp_path / "kv", budget_bytes=10 * MB, codec=EXACT_CODEC)
    small, big = make_kv("small"), make_kv("big", tokens=BIG)
    store.put(small)
    store.put(big)
    faults = WriteFaults(monkeypatch, "read-only", tmp_path / "kv")
    faults.start()
    for _ in range(3):
        assert same(store.get("small"), small) and same(store.get("big"), big)
        hit = store.open("big")
        assert hit is not None and same(hit.kv.materialize(), big)
    assert faults.attempts == 1 and store.stats.errors == 1 and store.stats.hits == 9


# ---------------------------------------------------------------- killed while precomputing to disk

_PRECOMPUTE = textwrap.dedent(
    """
    import sys, torch
    from cacheblend_rag import CacheBlendEngine, EngineConfig, StoreConfig
    from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words
    torch.set_num_threads(1)
    config = EngineConfig(miss_policy="blend", chunk_separator="",
                          store=StoreConfig(memory_budget_bytes=0, kv_codec="native", disk_dir=sys.argv[1]))
    engine = CacheBlendEngine(make_tiny_model("qwen2"), make_tiny_tokenizer(), config=config)
    for i in range(int(sys.argv[2])):
        engine.precompute([random_words(7000 + i, 60)], prefix=random_words(1, 4), context=None)
        engine.store.flush()
        print(i, flush=True)
    """
)


def test_a_precompute_killed_mid_write_leaves_a_folder_that_opens_and_answers_right(tmp_path, one_thread):
    folder = tmp_path / "kv"
    child = subprocess.Popen(
        [sys.executable, "-c", _PRECOMPUTE, str(folder), "400"], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        for line in child.stdout:  # let it store eight chunks, then kill it while it writes more
            if int(line) >= 7:
                break
        time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    store = DiskStore(folder, codec=EXACT_CODEC)
    with sqlite3.connect(folder / "cache.db") as db:
        keys = [k for (k,) in db.execute("SELECT key FROM Cache")]
    assert len(keys) >= 8
    found = [store.get(k) for k in keys]  # each a hit or a counted miss, never an exception
    assert sum(kv is not None for kv in found) + store.stats.misses == len(keys)
    store.close()

    chunks = [random_words(7000 + i, 60) for i in (0, 3, 7)]
    engine = engine_on(disk_dir=str(folder))
    reference = engine_on(disk_dir=str(tmp_path / "healthy"))
    reference.precompute(chunks, prefix=random_words(1, 4), context=None)
    for _ in range(2):
        got, expected = ask(engine, chunks), ask(reference, chunks)
        assert got.text == expected.text
    assert engine.store.tier_stats()["disk"].hits >= 3
