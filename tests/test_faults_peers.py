"""Processes that fork while serving, peers on one store configured otherwise, and models that differ only in their
buffers: each keeps its answers right and leaves the others' entries alone."""

from __future__ import annotations

import json
import os
import select
import signal
import threading
import time

import pytest

from cacheblend_rag import CacheBlendEngine, EngineConfig, StoreConfig
from cacheblend_rag.engine import model_fingerprint
from cacheblend_rag.store import DiskStore, RedisStore
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

CHUNKS = [random_words(300 + i, 24) for i in range(5)]
PREFIX, SUFFIX = random_words(1, 4), random_words(2, 5)


def engine_on(model=None, **store) -> CacheBlendEngine:
    config = EngineConfig(miss_policy="blend", chunk_separator="", store=StoreConfig(**store))
    return CacheBlendEngine(model or make_tiny_model("llama", mute_eos=True), make_tiny_tokenizer(), config=config)


def ask(engine: CacheBlendEngine, chunks, **options):
    return engine.generate(chunks, prefix=PREFIX, suffix=SUFFIX, **{"max_new_tokens": 3, **options})


# ---------------------------------------------------------------- a process that forks while the engine serves


def in_a_child(run, timeout_s: float = 120.0):
    """Fork; the child runs `run()` and sends back what it returns (JSON), or the error it raised. A child that has
    not answered after `timeout_s` is killed and the test fails."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        try:
            out = {"value": run()}
        except BaseException as exc:  # noqa: BLE001 (sent to the parent, which fails the test with it)
            out = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], timeout_s)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"the forked child did not answer within {timeout_s:.0f} s")
        data = b""
        while chunk := os.read(read, 1 << 16):
            data += chunk
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    return json.loads(data)


@pytest.mark.usefixtures("one_thread")
def test_a_child_forked_while_the_engine_serves_two_streams_answers_its_own_request():
    engine = engine_on()
    want = ask(engine, CHUNKS[:2], mode="full").token_ids
    gate = threading.Event()
    step = engine.scheduler.decoder.step_slots

    def slow_step(*args, **kwargs):  # the worker keeps both streams decoding until the test lets them end
        gate.wait(0.05)
        return step(*args, **kwargs)

    engine.scheduler.decoder.step_slots = slow_step
    first = engine.stream(CHUNKS[:3], prefix=PREFIX, suffix=SUFFIX, max_new_tokens=300)
    next(first)
    second = engine.stream(CHUNKS[2:4], prefix=PREFIX, suffix=SUFFIX, max_new_tokens=300)
    next(second)
    deadline = time.monotonic() + 10  # the second joins the batch just after its first token is sent
    while engine.scheduler.busy < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.scheduler.busy == 2  # the worker thread serves both; the fork comes between two of its steps
    assert "cacheblend-scheduler" in {t.name for t in threading.enumerate()}
    child = in_a_child(lambda: ask(engine, CHUNKS[:2], mode="full").token_ids)
    assert child == {"value": want}
    gate.set()
    first.close()
    second.close()
    assert ask(engine, CHUNKS[:2], mode="full").token_ids == want  # the parent goes on serving


@pytest.mark.usefixtures("one_thread")
def test_a_child_forked_with_a_tiered_store_writes_its_lower_tier_and_stores_its_cold_chunks(tmp_path):
    engine = engine_on(disk_dir=str(tmp_path / "kv"))
    ask(engine, CHUNKS[:2])  # the parent's write-back thread exists, and is the parent's only
    engine.store.flush()
    cold = [random_words(900 + i, 20) for i in range(2)]

    def child():
        answer = ask(engine, cold).token_ids  # stored in memory, then on disk by the child's own write-back
        engine.store.flush()
        first_key = engine.prompt_keys(engine.build_prompt(cold, prefix=PREFIX, suffix=SUFFIX), with_prefix=False)[0]
        return answer, first_key in engine.store.tiers[1]

    answer, on_disk = in_a_child(child)["value"]
    assert on_disk and answer == ask(engine, cold).token_ids


# ---------------------------------------------------------------- peers on one store, configured otherwise


def test_workers_with_other_codecs_on_one_folder_keep_their_own_entries(tmp_path):
    model = make_tiny_model("llama", mute_eos=True)
    a = engine_on(model, disk_dir=str(tmp_path / "kv"), kv_codec="int8", memory_budget_bytes=0)
    a.precompute(CHUNKS, prefix=PREFIX, context=None)
    a.store.flush()
    b = engine_on(model, disk_dir=str(tmp_path / "kv"), kv_codec="native", memory_budget_bytes=0)
    b.generate(CHUNKS[:1], prefix=PREFIX, suffix=SUFFIX, max_new_tokens=1, mode="reuse")  # B's misses, stored by B
    b.store.flush()
    again = ask(a, CHUNKS, mode="reuse").metrics
    assert (again.chunks_hit, again.chunks_missed) == (5, 0)  # A's entries are all still there
    assert a.store.tiers[1].stats.corrupt == 0 and b.store.tiers[1].stats.corrupt == 0
    assert ask(b, CHUNKS[:1], mode="reuse").metrics.chunks_hit == 1  # and B reads its own


def test_workers_with_other_signing_keys_on_one_folder_keep_their_own_entries(tmp_path):
    model = make_tiny_model("llama", mute_eos=True)
    a = engine_on(model, disk_dir=str(tmp_path / "kv"), hmac_key="a" * 16, memory_budget_bytes=0)
    b = engine_on(model, disk_dir=str(tmp_path / "kv"), hmac_key="b" * 16, memory_budget_bytes=0)
    for _ in range(2):  # each worker's misses are stored beside the other's entries, not over them
        for engine in (a, b):
            ask(engine, CHUNKS[:3], mode="reuse")
            engine.store.flush()
    for engine in (a, b):
        m = ask(engine, CHUNKS[:3], mode="reuse").metrics
        assert (m.chunks_hit, m.chunks_missed) == (3, 0) and engine.store.tiers[1].stats.corrupt == 0
    assert len(DiskStore(tmp_path / "kv")) == 2 * (3 + 1)  # the prefix and three chunks, for each key


def test_workers_with_other_codecs_on_one_redis_keep_their_own_entries(redis_server):
    model = make_tiny_model("llama", mute_eos=True)
    namespace = f"peers-{os.getpid()}-{time.monotonic_ns()}"
    stores = [RedisStore(redis_server.url, namespace=namespace, codec=codec) for codec in ("int8", "native")]
    config = EngineConfig(miss_policy="blend", chunk_separator="", store=StoreConfig(memory_budget_bytes=0))
    a, b = (CacheBlendEngine(model, make_tiny_tokenizer(), config=config, store=s) for s in stores)
    try:
        a.precompute(CHUNKS, prefix=PREFIX, context=None)
        b.generate(CHUNKS[:1], prefix=PREFIX, suffix=SUFFIX, max_new_tokens=1, mode="reuse")
        again = ask(a, CHUNKS, mode="reuse").metrics
        assert (again.chunks_hit, again.chunks_missed) == (5, 0)
        assert stores[0].stats.corrupt == 0 and stores[1].stats.corrupt == 0
    finally:
        stores[0].clear()
        for s in stores:
            s.close()


# ---------------------------------------------------------------- a model's buffers


def test_a_models_buffers_are_in_its_fingerprint_so_it_never_reads_another_models_entries():
    same, other = make_tiny_model("llama", 0), make_tiny_model("llama", 0)
    assert model_fingerprint(same) == model_fingerprint(make_tiny_model("llama", 0))
    other.model.rotary_emb.inv_freq.mul_(0.5)  # other rotary frequencies: other logits, other KV
    assert model_fingerprint(other) != model_fingerprint(same)
    a, b = engine_on(same), engine_on(other)
    b.store = a.store  # one store for both
    a.precompute(CHUNKS[:2], prefix=PREFIX, context=None)
    assert ask(b, CHUNKS[:2], mode="reuse").metrics.chunks_hit == 0  # none of a's entries is b's


# ---------------------------------------------------------------- a shared tier that evicts mid-read


def test_an_entry_evicted_while_its_layers_are_read_is_a_miss_not_damage(redis_server):
    from store_helpers import make_kv

    from cacheblend_rag.errors import EntryGoneError

    store = RedisStore(redis_server.url, namespace=f"gone-{os.getpid()}-{time.monotonic_ns()}", codec="native")
    try:
        store.put(make_kv("chunk-a", tokens=64))
        hit = store.open("chunk-a")
        assert hit is not None and store.stats.hits == 1
        store._client.delete(store.value_key("chunk-a"))  # evicted by Redis between the header and the layers
        with pytest.raises(EntryGoneError, match="went away while its layers were read"):
            hit.kv.layer(0)
        assert (store.stats.vanished, store.stats.corrupt, store.stats.hits, store.stats.misses) == (1, 0, 0, 1)
    finally:
        store.clear()
        store.close()
