"""Decode steps between a prefill's layers (`ServingConfig.max_token_gap_s`): where they run, and that they change
no answer. Tiny seeded models; the timing side (how long streams stall) is measured by `benchmarks/load.py`."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_batching import POOL, request_args

from cacheblend_rag import CacheBlendEngine, EngineConfig, ServingConfig
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.fusion import FusionPlan, LayerEvents, fuse
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words


def test_layer_events_hooked_on_a_forward_tell_every_layer_but_the_last_on_their_own_thread_only():
    model = make_tiny_model("llama", num_layers=4)
    ids = torch.tensor([[5, 6, 7, 8]])
    seen: list[tuple[str, int]] = []
    with torch.inference_mode():
        events = LayerEvents(lambda i: seen.append((threading.current_thread().name, i)))
        with events.hooked(model.model.layers):
            model(input_ids=ids)
            other = threading.Thread(target=lambda: model(input_ids=ids), name="other")
            other.start()
            other.join()
        model(input_ids=ids)  # the hooks are gone
    assert seen == [(threading.current_thread().name, i) for i in range(3)]


def test_the_fusor_calls_back_between_layers_and_computes_the_same():
    engine = CacheBlendEngine(
        make_tiny_model("qwen2", num_layers=5),
        make_tiny_tokenizer(),
        config=EngineConfig(miss_policy="blend", chunk_separator=""),
    )
    prompt = engine.build_prompt([POOL[0], POOL[1]], prefix=random_words(1, 3), suffix=random_words(7, 4))
    engine.prefill(prompt, "reuse")  # fills the store
    parts = [engine.store.get(k) for k in engine.prompt_keys(prompt)]
    n = prompt.num_tokens
    exact = torch.zeros(n, dtype=torch.bool)
    exact[: len(prompt.prefix_ids)] = True
    reused = ~exact
    reused[n - len(prompt.suffix_ids) :] = False
    plan = FusionPlan(prompt.input_ids(), torch.arange(n), exact, reused, (1,), (6,), "key")

    def run(events=None):
        return fuse(engine.lm, plan, engine.chunks.prompt_kv(parts, n), events=events)

    called: list[int] = []
    plain, ticked = run(), run(LayerEvents(called.append))
    assert called == [0, 1, 2, 3]
    assert torch.equal(plain.logits, ticked.logits)
    assert torch.equal(plain.selected_positions, ticked.selected_positions)
    for a, b in zip(plain.keys + plain.values, ticked.keys + ticked.values, strict=True):
        assert torch.equal(a, b)


def engine_with_gap(gap: float | None, max_batch: int = 8) -> CacheBlendEngine:
    return CacheBlendEngine(
        make_tiny_model("qwen2", mute_eos=True),
        make_tiny_tokenizer(),
        config=EngineConfig(
            miss_policy="blend",
            chunk_separator="",
            serving=ServingConfig(max_batch_size=max_batch, max_token_gap_s=gap),
        ),
    )


def test_decode_steps_between_prefill_layers_leave_every_answer_as_served_alone():
    """Gap 0: the requests decoding get a step after every layer of every prefill (blend, full and reuse passes);
    every answer is still the one the request gets alone, and the steps are counted on the request that hosted
    them."""
    serial = [engine_with_gap(None, 1).generate(c, **a).token_ids for c, a in map(request_args, range(16))]
    engine = engine_with_gap(0.0)
    barrier = threading.Barrier(8)

    def ask(i: int):
        if i < 8:
            barrier.wait()
        chunks, args = request_args(i)
        stream = engine.stream(chunks, **args)
        "".join(stream)
        return stream.result

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(ask, range(16)))
    assert [r.token_ids for r in results] == serial
    hosted = {r.metrics.mode: 0 for r in results}
    for r in results:
        hosted[r.metrics.mode] += r.metrics.interleaved_steps
    assert hosted["full"] > 0 and hosted["blend"] > 0 and hosted["reuse"] > 0, hosted


def test_without_a_gap_no_prefill_hosts_a_decode_step():
    engine = engine_with_gap(None)
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(lambda i: engine.generate(*request_args(i)[:1], **request_args(i)[1]), range(6)))
    assert all(r.metrics.interleaved_steps == 0 for r in results)


def test_a_long_gap_hosts_no_step_and_a_stream_abandoned_meanwhile_frees_the_batch():
    engine = engine_with_gap(3600.0, max_batch=2)
    chunks, args = request_args(0)
    left = engine.stream(chunks, **{**args, "max_new_tokens": 30})
    next(left)
    other = engine.generate(*request_args(1)[:1], **request_args(1)[1])
    assert other.metrics.interleaved_steps == 0  # its last step was not an hour old
    left.close()
    for _ in range(200):
        if engine.scheduler.busy == 0:
            break
        threading.Event().wait(0.01)
    assert engine.scheduler.busy == 0


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), "0.5", True])
def test_max_token_gap_s_is_checked(bad):
    with pytest.raises(ConfigError, match="max_token_gap_s"):
        ServingConfig(max_token_gap_s=bad)


def test_chunks_stored_after_a_cold_request_host_the_decode_steps_of_the_requests_still_answering():
    """While the scheduler serves requests, the chunks a cold request was answered without are prefilled and stored
    on its own thread, and (with a gap) the requests decoding take steps between the layers of those prefills:
    their answers do not stop for a background fill, and stay those served alone."""
    long_chunks, long_args = [POOL[0]], dict(prefix=random_words(1, 3), suffix=random_words(9, 4), max_new_tokens=200)
    alone = engine_with_gap(None, 1)
    alone.precompute(long_chunks, prefix=long_args["prefix"])
    expected = alone.generate(long_chunks, **long_args).token_ids
    cold_chunks = [random_words(700 + s, 30) for s in range(3)]
    cold_expected = alone.generate(cold_chunks, prefix=long_args["prefix"], suffix=random_words(8, 4),
                                   max_new_tokens=3, mode="full").token_ids  # fmt: skip

    engine = CacheBlendEngine(
        make_tiny_model("qwen2", mute_eos=True),
        make_tiny_tokenizer(),
        config=EngineConfig(
            miss_policy="full", chunk_separator="", serving=ServingConfig(max_token_gap_s=0.0), chunk_context="isolated"
        ),
    )
    engine.precompute(long_chunks, prefix=long_args["prefix"])
    fills: list[tuple[str, bool]] = []
    in_fill = threading.Event()
    steps_in_fills = 0
    fill, step = engine.chunks.fill, engine.scheduler.decoder.step_slots

    def spy_fill(*args, **kwargs):
        fills.append((threading.current_thread().name, kwargs.get("events") is not None))
        in_fill.set()
        try:
            return fill(*args, **kwargs)
        finally:
            in_fill.clear()

    def spy_step(*args, **kwargs):
        nonlocal steps_in_fills
        steps_in_fills += in_fill.is_set()
        return step(*args, **kwargs)

    engine.chunks.fill, engine.scheduler.decoder.step_slots = spy_fill, spy_step
    stream = engine.stream(long_chunks, **long_args)
    next(stream)
    cold = engine.generate(cold_chunks, prefix=long_args["prefix"], suffix=random_words(8, 4), max_new_tokens=3)
    "".join(stream)
    assert cold.metrics.mode == "full" and cold.token_ids == cold_expected
    assert stream.result.token_ids == expected
    assert engine.wait_for_fills(timeout=60)
    assert fills and all(name == "cacheblend-scheduler" and hosted for name, hosted in fills), fills
    assert steps_in_fills > 0
    assert cold.metrics.chunks_deferred > 0 and engine.fill_stats.prefill_s > 0
    warm = engine.generate(cold_chunks, prefix=long_args["prefix"], suffix=random_words(8, 4), max_new_tokens=3)
    assert (warm.metrics.mode, warm.metrics.chunks_hit) == ("blend", 3)


def test_without_a_scheduler_running_the_fills_thread_stores_the_chunks():
    engine = CacheBlendEngine(
        make_tiny_model("qwen2"),
        make_tiny_tokenizer(),
        config=EngineConfig(miss_policy="full", chunk_separator="", chunk_context="isolated"),
    )
    names: list[str] = []
    fill = engine.chunks.fill

    def spy_fill(*args, **kwargs):
        names.append(threading.current_thread().name)
        return fill(*args, **kwargs)

    engine.chunks.fill = spy_fill
    prompt = engine.build_prompt(
        [random_words(720 + s, 30) for s in range(3)], prefix=random_words(1, 3), suffix=random_words(8, 4)
    )
    pre = engine.prefill(prompt)  # not through the scheduler; returns once the skipped chunks are stored
    assert pre.metrics.mode == "full" and len(pre.deferred) == 2
    assert names == ["cacheblend-deferred-fills"] * 2
    assert all(key in engine.store for key in engine.prompt_keys(prompt))
