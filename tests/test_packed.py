"""Linear layers packed for oneDNN (`models.packed`), which a bf16 engine on a CPU uses: every prefill mode gives the
plain engine's values bit for bit (both attending with `blocked_attention`), a second engine over the packed model
still fuses q/k/v, and a weight changed after packing runs the plain product."""

from __future__ import annotations

import pytest
import torch

import cacheblend_rag.engine.engine as engine_module
from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.models.attention import use_blocked_attention
from cacheblend_rag.models.packed import PackedFusedQKV, PackedLinear, packing_available
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

pytestmark = pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.bfloat16), reason="oneDNN runs no bf16 products on this CPU"
)
BF16 = EngineConfig(device="cpu", dtype="bfloat16")


def bf16_engine(family: str, monkeypatch=None) -> CacheBlendEngine:
    if monkeypatch is not None:  # the plain engine: what the engine builds where packing is not available
        monkeypatch.setattr(engine_module, "packing_available", lambda device, dtype: False)
    engine = CacheBlendEngine(make_tiny_model(family, seed=3), make_tiny_tokenizer(), config=BF16)
    if monkeypatch is not None:
        monkeypatch.undo()
        use_blocked_attention(engine.model)  # the packed engine's attention too: only the products differ
    return engine


def prompt_of(engine: CacheBlendEngine):
    chunks = [random_words(s, 40) for s in (21, 22, 23)]
    return engine.build_prompt(chunks, prefix=random_words(1, 5), suffix=random_words(2, 6))


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2's projections have biases
def test_every_prefill_mode_over_packed_weights_equals_the_plain_engine_bit_for_bit(family, monkeypatch):
    packed, plain = bf16_engine(family), bf16_engine(family, monkeypatch)
    assert all(isinstance(f, PackedFusedQKV) for f in packed.lm.fused_qkv)
    assert isinstance(packed.model.model.layers[0].mlp.down_proj, PackedLinear)
    assert not isinstance(plain.model.model.layers[0].mlp.down_proj, PackedLinear)
    prompt = prompt_of(packed)
    for mode, ratio in [("full", None), ("blend", 1.0), ("blend", 0.0), ("blend", 0.3), ("reuse", None)]:
        a = packed.prefill(prompt, mode, recompute_ratio=ratio)
        b = plain.prefill(prompt, mode, recompute_ratio=ratio)
        assert torch.equal(a.logits, b.logits), (mode, ratio)
        for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values), (mode, ratio)


def test_a_second_engine_over_a_packed_model_fuses_and_packs_the_same_weights():
    first = bf16_engine("qwen2")
    second = CacheBlendEngine(first.model, first.tokenizer, config=BF16)
    assert second.lm.fused_qkv is not None
    for a, b in zip(first.lm.fused_qkv, second.lm.fused_qkv, strict=True):
        assert isinstance(b, PackedFusedQKV) and torch.equal(a.weight, b.weight)


def test_a_weight_written_after_packing_runs_the_plain_product():
    engine = bf16_engine("llama")
    linear = engine.model.model.layers[0].mlp.down_proj
    x = torch.randn(7, linear.in_features).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.mul_(2)
    assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight))
