"""The attention temperature on stale chunk KV (`EngineConfig.stale_key_temperature`): which keys it touches, and
that it leaves the exact paths exact. Tiny seeded models."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, ChunkKV, EngineConfig
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

CHUNKS = [random_words(s, 20) for s in (21, 22, 23)]
PREFIX, QUESTION = random_words(1, 5), random_words(2, 6)


def engine_at(temperature: float, model=None, store=None) -> CacheBlendEngine:
    config = EngineConfig(miss_policy="blend", chunk_separator="", stale_key_temperature=temperature)
    return CacheBlendEngine(model or make_tiny_model("qwen2"), make_tiny_tokenizer(), config=config, store=store)


def test_it_divides_the_keys_of_every_chunk_but_the_first_on_layers_after_the_first():
    """Reuse at T equals reuse over entries whose keys on layers 1.. were divided by T, for every chunk but the
    first (its entry is exact after the prefix); the prefix, the values and layer 0 are left alone."""
    plain = engine_at(1.0)
    warm = engine_at(1.25, plain.model, plain.store)
    prompt = plain.build_prompt(CHUNKS, prefix=PREFIX, suffix=QUESTION)
    plain.prefill(prompt, "reuse")  # stores the isolated entries
    tempered = warm.prefill(prompt, "reuse").logits
    keys = plain.prompt_keys(prompt, with_prefix=False)
    stored = {k: plain.store.get(k) for k in keys}
    for k in keys[1:]:
        kv = stored[k]
        scaled = kv.keys.clone()
        scaled[1:] /= 1.25
        plain.store.put(ChunkKV(kv.key, scaled, kv.values))
    by_hand = plain.prefill(prompt, "reuse").logits
    torch.testing.assert_close(tempered, by_hand, rtol=1e-5, atol=1e-5)
    for k in keys:
        plain.store.put(stored[k])
    assert not torch.allclose(tempered, plain.prefill(prompt, "reuse").logits, atol=1e-3)  # it does change reuse


def test_the_stored_entries_are_never_changed():
    engine = engine_at(0.8)
    prompt = engine.build_prompt(CHUNKS, prefix=PREFIX, suffix=QUESTION)
    engine.prefill(prompt, "blend")
    before = {k: engine.store.get(k).keys.clone() for k in engine.prompt_keys(prompt)}
    engine.prefill(prompt, "reuse")
    engine.generate(CHUNKS, prefix=PREFIX, suffix=QUESTION, max_new_tokens=3)
    for k, keys in before.items():
        assert torch.equal(engine.store.get(k).keys, keys)


def test_exact_paths_stay_exact():
    """One chunk after the prefix (its entry is exact there) reuses it untouched, and a blend at r = 1 equals the
    model's own full prefill whatever the temperature."""
    engine = engine_at(1.5)
    one = engine.build_prompt(CHUNKS[:1], prefix=PREFIX, suffix=QUESTION)
    engine.prefill(one, "reuse")
    full = engine.prefill(one, "full").logits  # the model's own forward
    torch.testing.assert_close(engine.prefill(one, "reuse").logits, full, rtol=1e-4, atol=1e-4)
    three = engine.build_prompt(CHUNKS, prefix=PREFIX, suffix=QUESTION)
    full3 = engine.prefill(three, "full").logits
    torch.testing.assert_close(engine.prefill(three, "blend", recompute_ratio=1.0).logits, full3, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), "1.1", True])
def test_stale_key_temperature_is_checked(bad):
    with pytest.raises(ConfigError, match="stale_key_temperature"):
        EngineConfig(stale_key_temperature=bad)
