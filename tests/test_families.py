"""Decoder families, each a tiny random model built from its own `transformers` config class: the families the
engine serves blend exactly, the others are refused with `UnsupportedModelError` before anything else can fail."""

from __future__ import annotations

import pytest
import torch
from family_models import FAMILIES, REFUSED, WINDOW, family_config, family_model

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.errors import UnsupportedModelError
from cacheblend_rag.models import check_supported
from cacheblend_rag.models.support import SUPPORTED_FAMILIES
from cacheblend_rag.testing import make_tiny_tokenizer, random_words

SUPPORTED = sorted(set(FAMILIES) & SUPPORTED_FAMILIES)
UNSUPPORTED = sorted(set(FAMILIES) - SUPPORTED_FAMILIES) + sorted(REFUSED)
CHUNK_WORDS = 96  # three chunks, a prefix and a suffix: ~300 tokens, past every window of WINDOW tokens


def engine_of(family: str) -> CacheBlendEngine:
    config = EngineConfig(device="cpu", dtype="float32", miss_policy="blend", chunk_separator="")
    return CacheBlendEngine(family_model(family), make_tiny_tokenizer(), config=config)


def three_chunk_prompt(engine: CacheBlendEngine):
    chunks = [random_words(seed, CHUNK_WORDS) for seed in (11, 12, 13)]
    return engine.build_prompt(chunks, prefix=random_words(1, 5), suffix=random_words(2, 6))


def models_own_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The last token's logits of transformers' own forward over the whole prompt ([N] -> [vocab] float32)."""
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0, -1].float()


def test_at_least_sixteen_of_the_twenty_families_are_served():
    assert len(SUPPORTED) >= 16, SUPPORTED


@pytest.mark.parametrize("family", SUPPORTED)
def test_family_full_equals_its_model_blend_at_one_equals_full_and_at_zero_equals_reuse(family):
    engine = engine_of(family)
    prompt = three_chunk_prompt(engine)
    assert prompt.num_tokens > 4 * WINDOW
    full = engine.prefill(prompt, "full")
    torch.testing.assert_close(full.logits, models_own_logits(engine.model, prompt.input_ids()), atol=1e-4, rtol=0)
    reuse = engine.prefill(prompt, "reuse")  # stores the chunks' KV
    assert (reuse.logits - full.logits).abs().max() > 1e-3  # reuse is not full: the checks below can fail
    at_one = engine.prefill(prompt, "blend", recompute_ratio=1.0)
    torch.testing.assert_close(at_one.logits, full.logits, atol=1e-4, rtol=0)
    at_zero = engine.prefill(prompt, "blend", recompute_ratio=0.0)
    torch.testing.assert_close(at_zero.logits, reuse.logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", UNSUPPORTED)
def test_unsupported_family_is_refused_by_its_config_with_the_reason(family):
    with pytest.raises(UnsupportedModelError, match=repr(family)):
        check_supported(family_config(family))


@pytest.mark.parametrize("family", UNSUPPORTED)
def test_unsupported_model_handed_to_the_engine_is_refused_before_it_is_touched(family):
    model = family_model(family)
    with pytest.raises(UnsupportedModelError, match=repr(family)):
        CacheBlendEngine(model, make_tiny_tokenizer(), config=EngineConfig(device="cpu"))


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text", "granitemoehybrid", "lfm2"])
def test_layers_that_are_not_attention_are_named_as_the_reason(family):
    with pytest.raises(UnsupportedModelError, match="running state depends on every earlier token"):
        check_supported(family_config(family))


def models_own_greedy(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> list[int]:
    """`steps` greedy tokens from transformers' own forward over the whole sequence each step (no cache)."""
    out: list[int] = []
    for _ in range(steps):
        token = int(models_own_logits(model, torch.cat((ids, torch.tensor(out, dtype=torch.long)))).argmax())
        out.append(token)
    return out


# windowed layers beside full ones (OLMo 3), soft-capping (Gemma 2), sinks and experts (GPT-OSS), layers without
# RoPE (SmolLM3), two RoPE bases (Gemma 3)
@pytest.mark.parametrize("family", ["olmo3", "gemma2", "gpt_oss", "smollm3", "gemma3_text"])
def test_decoding_after_a_blend_past_the_window_gives_the_models_own_greedy_tokens(family):
    engine = engine_of(family)
    prompt = three_chunk_prompt(engine)
    engine.prefill(prompt, "reuse")  # stores the chunks' KV: the blend below reads it
    blend = engine.generate(prompt, mode="blend", recompute_ratio=1.0, max_new_tokens=6, temperature=0.0)
    assert blend.metrics.mode == "blend" and prompt.num_tokens > WINDOW
    assert blend.token_ids == models_own_greedy(engine.model, prompt.input_ids(), 6)
