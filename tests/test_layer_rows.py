"""The prefill's row-wise layer halves over padded rows (`fusion.GraphedLayerSteps`), run eagerly on a CPU: the same
prefill as the eager layers for every rule and pass, to 1e-5 in fp32 on tiny models of three families; r = 1 still a
full prefill and r = 0 full reuse through the engine; buckets, their bound and their threads. (The graphs themselves
are replayed on CUDA only: `tests/test_cuda.py`.)"""

from __future__ import annotations

import threading

import pytest
import torch

from cacheblend_rag import BlendConfig, CacheBlendEngine, EngineConfig
from cacheblend_rag.engine.prefill.planning import blend_plan, question_mask, reuse_plan
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.fusion import EagerLayerSteps, GraphedLayerSteps, bucket_rows, fuse
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words


def engine_with_prompt(family: str = "llama", chunk_words: int = 30):
    config = EngineConfig(miss_policy="blend", chunk_separator="", dtype="float32")
    engine = CacheBlendEngine(make_tiny_model(family), make_tiny_tokenizer(), config=config)
    chunks = [random_words(s, chunk_words) for s in (31, 32, 33)]
    prompt = engine.build_prompt(chunks, prefix=random_words(1, 4), suffix=random_words(2, 5))
    engine.prefill(prompt, "reuse")  # fills the store
    parts = [engine.store.get(k) for k in engine.prompt_keys(prompt)]
    return engine, prompt, parts


def run_rule(engine, prompt, parts, rule: str, steps, *, block_size: int = 0, keep_raw: bool = False):
    """The fused prefill of one rule with `steps`: (probe or None, result)."""
    n, lm = prompt.num_tokens, engine.lm
    kv = engine.chunks.prompt_kv(parts, n, keep_raw=keep_raw)
    if rule == "reuse":
        return None, fuse(lm, reuse_plan(prompt), kv, block_size=block_size, steps=steps)
    if rule.startswith("attention"):
        depth = None if rule == "attention" else 3
        probe = fuse(lm, reuse_plan(prompt), kv, block_size=block_size, attention_from=question_mask(prompt),
                     layers=depth, steps=steps)  # fmt: skip
        plan = blend_plan(prompt, BlendConfig(rule="attention", recompute_ratio=0.3), probe.attention)
        return probe, fuse(lm, plan, kv, block_size=block_size, steps=steps)
    return None, fuse(lm, blend_plan(prompt, BlendConfig(rule=rule, recompute_ratio=0.3)), kv,
                      block_size=block_size, steps=steps)  # fmt: skip


def assert_same(a, b) -> None:
    torch.testing.assert_close(a.kv.keys, b.kv.keys, atol=1e-5, rtol=0)
    torch.testing.assert_close(a.kv.values, b.kv.values, atol=1e-5, rtol=0)
    assert torch.equal(a.selected_positions, b.selected_positions)
    assert a.recomputed_per_layer == b.recomputed_per_layer
    if a.logits is None:
        assert b.logits is None
    else:
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=0)
    if a.attention is not None:
        torch.testing.assert_close(a.attention, b.attention, atol=1e-6, rtol=0)


def test_buckets_pad_by_at_most_an_eighth_with_eight_sizes_per_doubling():
    assert [bucket_rows(a) for a in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert [bucket_rows(a) for a in (17, 18, 19, 30, 33, 1150, 1160, 7700)] == [18, 18, 20, 30, 36, 1152, 1280, 8192]
    for a in range(17, 5000):
        b = bucket_rows(a)
        assert a <= b < a * 1.125 + 1 and bucket_rows(b) == b
    assert len({bucket_rows(a) for a in range(257, 513)}) == 8
    with pytest.raises(ValueError, match="at least one row"):
        bucket_rows(0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("rule", ["reuse", "attention", "attention:shallow", "paper", "gradual", "epic"])
def test_padded_rows_give_the_eager_layers_prefill(family, rule):
    # Every pass the engine runs (full reuse, the question's pass, shallow or not, the blend of the chosen tokens,
    # check layers that narrow the set): the same KV, choice, logits and recorded attention as the eager layers.
    engine, prompt, parts = engine_with_prompt(family)
    padded = GraphedLayerSteps(engine.lm, capture=False)
    for eager, over_rows in zip(run_rule(engine, prompt, parts, rule, None),
                                run_rule(engine, prompt, parts, rule, padded), strict=True):  # fmt: skip
        if eager is not None:
            assert_same(eager, over_rows)
    assert padded.bucket_sizes  # the rows did run padded
    assert all(size == bucket_rows(size) for size in padded.bucket_sizes)


def test_padded_rows_on_the_cpus_blocks_and_with_raw_keys_kept():
    # The CPU's position blocks read the same rows; a prompt KV that keeps raw keys (what a chunk's entry is cut
    # from) projects its own q/k/v, and the padded rows still carry the hidden states and the MLP.
    engine, prompt, parts = engine_with_prompt("qwen2")
    for kw in ({"block_size": 8}, {"keep_raw": True}):
        _, eager = run_rule(engine, prompt, parts, "paper", EagerLayerSteps(engine.lm), **kw)
        _, padded = run_rule(engine, prompt, parts, "paper", GraphedLayerSteps(engine.lm, capture=False), **kw)
        assert_same(eager, padded)
        if kw.get("keep_raw"):
            torch.testing.assert_close(eager.kv.raw_keys, padded.kv.raw_keys, atol=1e-5, rtol=0)


def test_ratio_one_is_a_full_prefill_and_zero_full_reuse_over_padded_rows():
    engine, prompt, _ = engine_with_prompt()
    full, reuse = engine.prefill(prompt, "full"), engine.prefill(prompt, "reuse")
    engine.prefiller.steps = GraphedLayerSteps(engine.lm, capture=False)
    for mode, ratio, reference in (("blend", 1.0, full), ("blend", 0.0, reuse), ("reuse", None, reuse)):
        opts = {} if ratio is None else {"recompute_ratio": ratio}
        got = engine.prefill(prompt, mode, **opts)
        torch.testing.assert_close(got.logits, reference.logits, atol=1e-4, rtol=0)
        for mine, theirs in zip(got.cache.layers, reference.cache.layers, strict=True):
            torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-4, rtol=0)
            torch.testing.assert_close(mine.values, theirs.values, atol=1e-4, rtol=0)
    text = engine.generate(prompt, mode="blend", max_new_tokens=4, stop=()).text
    engine.prefiller.steps = None
    assert engine.generate(prompt, mode="blend", max_new_tokens=4, stop=()).text == text


def test_large_sets_run_eagerly_and_buckets_are_bounded():
    engine, prompt, parts = engine_with_prompt()
    steps = GraphedLayerSteps(engine.lm, capture=False, max_rows=8, max_buckets=2)
    _, eager = run_rule(engine, prompt, parts, "paper", None)
    _, bounded = run_rule(engine, prompt, parts, "paper", steps)
    assert_same(eager, bounded)
    assert all(size <= 8 for size in steps.bucket_sizes)  # the chunk tokens' layers ran eagerly
    for a in (1, 3, 7):
        steps.rows(torch.zeros(a, engine.lm.shape.hidden_size), None, None)
    assert steps.bucket_sizes == [4, 8]  # the two used last, the least recent first


def test_rows_for_finish_only_refuse_qkv():
    engine, _, _ = engine_with_prompt()
    hidden = torch.randn(3, engine.lm.shape.hidden_size)
    for steps in (EagerLayerSteps(engine.lm), GraphedLayerSteps(engine.lm, capture=False)):
        with pytest.raises(ValueError, match="pass cos and sin"):
            steps.rows(hidden, None, None).qkv(0)


def test_each_thread_has_buckets_of_its_own():
    engine, _, _ = engine_with_prompt()
    steps = GraphedLayerSteps(engine.lm, capture=False)
    steps.rows(torch.zeros(5, engine.lm.shape.hidden_size), None, None)
    seen = []
    worker = threading.Thread(target=lambda: seen.append(steps.bucket_sizes))
    worker.start()
    worker.join()
    assert seen == [[]] and steps.bucket_sizes == [8]


def test_graphs_need_cuda():
    engine, _, _ = engine_with_prompt()
    with pytest.raises(ValueError, match="CUDA device"):
        GraphedLayerSteps(engine.lm)
    with pytest.raises(ValueError, match="at least 1"):
        GraphedLayerSteps(engine.lm, capture=False, max_rows=0)
    with pytest.raises(ConfigError, match="needs device='cuda'"):
        EngineConfig(prefill_graphs=True)
    with pytest.raises(ConfigError, match="True or False"):
        EngineConfig(prefill_graphs="yes")
