"""The miss policy: a request whose chunks are not stored yet is never much slower than a full prefill, and the
chunks it skipped are stored after the answer so that the next request is warm."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, EngineConfig, blend_rule
from cacheblend_rag.engine import TokenizedPrompt
from cacheblend_rag.engine.prefill.planning import cold_cost_share
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

CHUNKS = [random_words(s, 40) for s in (801, 802, 803)]
PREFIX, SUFFIX = random_words(1, 4), random_words(2, 6)


def engine_with(policy: str, model=None) -> CacheBlendEngine:
    config = EngineConfig(chunk_separator="", miss_policy=policy, chunk_context="isolated")  # cold chunks: filled after
    return CacheBlendEngine(model or make_tiny_model("qwen2"), make_tiny_tokenizer(), config=config)


def ask(engine, **kw):
    return engine.generate(CHUNKS, prefix=PREFIX, suffix=SUFFIX, max_new_tokens=4, **kw)


def test_cold_cost_share_counts_the_missing_chunks_and_the_blend():
    prompt = TokenizedPrompt((1, 2), ((3,) * 40, (4,) * 40), (5,) * 8)  # 90 tokens, 80 in chunks
    reuse_only = cold_cost_share(prompt, [], None, 4)
    assert reuse_only == pytest.approx(8 / 90)
    all_missing = cold_cost_share(prompt, prompt.chunk_ids, blend_rule("attention", 0.15), 4)
    assert all_missing == pytest.approx((80 + 12 + 8 + 8) / 90)  # chunks, r = 0.15 of 80 (12), question twice
    assert cold_cost_share(prompt, prompt.chunk_ids[:1], blend_rule("attention", 0.15), 4) < 1 < all_missing
    gradual = cold_cost_share(prompt, [], blend_rule("gradual", 0.15), 4)
    assert gradual == pytest.approx(((12 + 8) * 4 + 80 * 2) / (90 * 4))  # every chunk token up to check layer 1


def test_an_unknown_policy_is_refused():
    with pytest.raises(ConfigError, match="miss_policy must be one of auto, blend, full"):
        EngineConfig(miss_policy="lazy")


def test_policy_full_answers_a_cold_request_exactly_and_stores_its_chunks_after():
    model = make_tiny_model("qwen2")
    full = ask(engine_with("blend", model), mode="full")
    engine = engine_with("full", model)
    cold = ask(engine)
    m = cold.metrics
    assert cold.token_ids == full.token_ids  # a full prefill: exact
    assert m.mode == "full" and m.fallback == "full prefill: 3 of 3 chunks not stored yet"
    assert (m.chunks_hit, m.chunks_missed, m.reused_tokens, m.cold_tokens) == (0, 3, 0, 120)
    assert m.precompute_s == 0  # the chunks are stored after the call returns, on a background thread
    assert engine.wait_for_fills(timeout=60) and engine.fill_stats.prefilled == m.chunks_deferred > 0
    assert engine.fill_stats.prefill_s > 0 and engine.fill_stats.pending == 0
    with pytest.raises(AttributeError, match="engine.fill_stats.prefill_s"):
        m.deferred_fill_s  # noqa: B018  (the old name says where the figure went)
    warm = ask(engine).metrics
    assert (warm.mode, warm.chunks_hit, warm.chunks_missed, warm.fallback) == ("blend", 3, 0, None)


def test_policy_blend_prefills_missing_chunks_inside_the_request():
    m = ask(engine_with("blend")).metrics
    assert m.mode == "blend" and m.fallback is None and m.chunks_missed == 3 and m.precompute_s > 0
    assert m.warm_ttft_s == pytest.approx(m.ttft_s - m.precompute_s)


def test_policy_auto_runs_full_only_when_the_missing_chunks_cost_more_than_the_prompt():
    engine = engine_with("auto")
    assert ask(engine).metrics.mode == "full"  # every chunk missing: prefilling them costs more than the prompt
    engine.clear_store()
    engine.precompute(CHUNKS[:2], prefix=PREFIX)
    m = ask(engine).metrics
    assert (m.mode, m.chunks_hit, m.chunks_missed) == ("blend", 2, 1)  # one of three missing: blending is cheaper


def test_prefill_stores_the_skipped_chunks_before_it_returns():
    engine = engine_with("full")
    prompt = engine.build_prompt(CHUNKS, prefix=PREFIX, suffix=SUFFIX)
    pre = engine.prefill(prompt, "blend")
    assert pre.metrics.mode == "full" and pre.deferred
    assert all(key in engine.store for key in engine.prompt_keys(prompt))
    again = engine.prefill(prompt, "blend")
    assert again.metrics.mode == "blend" and torch.isfinite(again.logits).all()


def test_a_cold_request_returns_before_its_chunks_are_stored_and_the_next_one_waits_for_them():
    import threading

    engine = engine_with("full")
    gate = threading.Event()
    fill = engine.chunks.fill

    def slow_fill(*args, **kwargs):
        gate.wait(30)  # hold the background fill until the cold call has returned
        return fill(*args, **kwargs)

    engine.chunks.fill = slow_fill
    cold = ask(engine).metrics
    assert cold.mode == "full" and engine.fill_stats.prefilled == 0  # answered; nothing stored inside the call
    assert not all(
        key in engine.store for key in engine.prompt_keys(engine.build_prompt(CHUNKS, prefix=PREFIX, suffix=SUFFIX))[1:]
    )
    threading.Timer(0.2, gate.set).start()
    warm = ask(engine).metrics  # waits for the queued chunks instead of computing them again
    assert (warm.mode, warm.chunks_hit, warm.chunks_missed) == ("blend", 3, 0)
    assert engine.fill_stats.prefilled == cold.chunks_deferred > 0  # counted by the fills, not in the metrics
