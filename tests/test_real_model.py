"""The same invariants on a real packaged model (SmolLM2-135M-Instruct, 30 layers), plus a sanity answer."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, EngineConfig

pytestmark = pytest.mark.real_model

CHUNKS = [
    "The kingdom of Zorbania lies in the northern mountains. Its capital is Quillton, a city of stone bridges "
    "built along the river Vess. Quillton has been the capital since the year 1204.",
    "Zorbania's main exports are wool, copper and a blue cheese called vessa. Most of its farms are small and "
    "family-owned, and the copper mines are in the eastern valleys near the border.",
    "The national sport of Zorbania is ice rowing, played on frozen lakes in winter. The yearly championship is "
    "held on Lake Marn and draws crowds from all over the kingdom.",
]
QUESTION = "What is the capital of Zorbania?"


@pytest.fixture(scope="module")
def engine() -> CacheBlendEngine:
    return CacheBlendEngine.from_pretrained(
        "smollm2-135m-instruct", config=EngineConfig(miss_policy="blend", dtype="float32"), show_progress=False
    )


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.build_prompt(CHUNKS, QUESTION)


def test_real_blend_at_ratio_one_equals_full_prefill(engine, prompt):
    full = engine.prefill(prompt, "full").logits
    blend = engine.prefill(prompt, "blend", recompute_ratio=1.0).logits
    torch.testing.assert_close(blend, full, atol=1e-4, rtol=0)


def test_real_blend_at_ratio_zero_equals_full_reuse(engine, prompt):
    reuse = engine.prefill(prompt, "reuse").logits
    blend = engine.prefill(prompt, "blend", recompute_ratio=0.0).logits
    torch.testing.assert_close(blend, reuse, atol=1e-4, rtol=0)
    assert (reuse - engine.prefill(prompt, "full").logits).abs().max() > 1e-2


def test_real_blend_with_a_shallow_first_pass_keeps_both_ends_of_the_ratio_range(engine, prompt):
    from cacheblend_rag import BlendConfig

    full, reuse = engine.prefill(prompt, "full").logits, engine.prefill(prompt, "reuse").logits
    at_one = engine.prefill(prompt, "blend", blend=BlendConfig(1.0, probe_depth=0.25)).logits
    at_zero = engine.prefill(prompt, "blend", blend=BlendConfig(0.0, probe_depth=0.25)).logits
    torch.testing.assert_close(at_one, full, atol=1e-4, rtol=0)
    torch.testing.assert_close(at_zero, reuse, atol=1e-4, rtol=0)


def test_real_single_front_chunk_blend_equals_prefix_caching(engine):
    p = engine.build_prompt(CHUNKS[:1], QUESTION)
    torch.testing.assert_close(
        engine.prefill(p, "blend", recompute_ratio=0.15).logits,
        engine.prefill(p, "prefix").logits,
        atol=1e-4,
        rtol=0,
    )


def test_real_blend_is_closer_to_full_than_reuse(engine, prompt):
    full = torch.log_softmax(engine.prefill(prompt, "full").logits, -1)

    def kl(mode, **kw):
        other = torch.log_softmax(engine.prefill(prompt, mode, **kw).logits, -1)
        return torch.sum(full.exp() * (full - other)).item()

    assert kl("blend", recompute_ratio=0.3) < kl("reuse")


def test_real_model_answers_from_the_chunks(engine):
    for mode in ("full", "blend"):
        result = engine.generate(CHUNKS, QUESTION, mode=mode, max_new_tokens=24)
        assert "Quillton" in result.text, (mode, result.text)
    again = engine.generate(CHUNKS, QUESTION, mode="blend", max_new_tokens=4)
    assert again.metrics.chunks_hit == 3 and again.metrics.chunks_missed == 0
