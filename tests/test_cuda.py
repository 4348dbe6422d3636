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
