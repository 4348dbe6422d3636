"""The exactness invariants on a CUDA device; skipped where none is present."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_cuda_blend_ends_match_full_and_reuse(family):
    engine = CacheBlendEngine(
        make_tiny_model(family),
        make_tiny_tokenizer(),
        config=EngineConfig(miss_policy="blend", device="cuda", chunk_separator=""),
    )
    prompt = engine.build_prompt(
        [random_words(s, 30) for s in (1, 2, 3)], prefix=random_words(4, 5), suffix=random_words(5, 6)
    )
    full = engine.prefill(prompt, "full").logits
    torch.testing.assert_close(engine.prefill(prompt, "blend", recompute_ratio=1.0).logits, full, atol=1e-4, rtol=0)
    reuse = engine.prefill(prompt, "reuse").logits
    torch.testing.assert_close(engine.prefill(prompt, "blend", recompute_ratio=0.0).logits, reuse, atol=1e-4, rtol=0)
    assert engine.lm.device.type == "cuda"


def test_cuda_bf16_generation_runs():
    engine = CacheBlendEngine(
        make_tiny_model("qwen2"),
        make_tiny_tokenizer(),
        config=EngineConfig(miss_policy="blend", device="cuda", dtype="bfloat16", chunk_separator=""),
    )
    out = engine.generate(
        [random_words(7, 20), random_words(8, 20)],
        prefix=random_words(4, 5),
        suffix=random_words(5, 6),
        max_new_tokens=5,
    )
    assert out.metrics.prompt_tokens == 51


def test_cuda_contextual_chunk_kv_after_its_predecessor_makes_reuse_exact():
    engine = CacheBlendEngine(
        make_tiny_model("qwen2"),
        make_tiny_tokenizer(),
        config=EngineConfig(miss_policy="full", device="cuda", chunk_separator=""),
    )
    a, b = random_words(31, 24), random_words(32, 20)
    prompt = engine.build_prompt([a, b], prefix=random_words(33, 5), suffix=random_words(34, 6))
    engine.set_chunk_context([a, b], [[], [a]], prefix=random_words(33, 5))
    cold = engine.generate(prompt, max_new_tokens=2)  # a full prefill; the chunks are stored in the background
    assert cold.metrics.mode == "full" and engine.wait_for_fills(timeout=60)
    full = engine.prefill(prompt, "full").logits
    warm = engine.prefill(prompt, "reuse")
    assert warm.metrics.chunks_hit == 2
    torch.testing.assert_close(warm.logits, full, atol=1e-4, rtol=0)
