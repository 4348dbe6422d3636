"""One product for a layer's queries, keys and values (`models.fused.fuse_qkv`): the model's own projections become
views of the fused weight (nothing held twice, the model's forward unchanged), a second engine over the same model
fuses nothing again, models it cannot fuse are left alone, and the fused rows equal the three products. And the
norms the layer-wise model runs as torch's fused `rms_norm` equal the modules' own, bit for bit."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.models.adapter import LayerwiseModel, rms_norm, signed_sin
from cacheblend_rag.models.fused import fuse_qkv
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2's projections have biases
def test_projections_become_views_of_the_fused_weight_and_the_forward_is_unchanged(family):
    model = make_tiny_model(family, 0)
    ids = torch.arange(3, 40)[None]
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    originals = [(a.q_proj.weight.clone(), a.k_proj.weight.clone(), a.v_proj.weight.clone())
                 for a in (layer.self_attn for layer in model.model.layers)]  # fmt: skip
    fused = fuse_qkv(model)
    assert fused is not None and len(fused) == len(model.model.layers)
    for f, layer, (q, k, v) in zip(fused, model.model.layers, originals, strict=True):
        attn = layer.self_attn
        assert torch.equal(f.weight, torch.cat((q, k, v)))
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            assert same_memory(proj.weight, f.weight)  # one tensor: the model holds no second copy
            assert isinstance(proj.weight, nn.Parameter)
        if family == "qwen2":
            assert f.bias is not None and same_memory(attn.k_proj.bias, f.bias)
            assert torch.equal(f.bias, torch.cat((attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)))
        else:
            assert f.bias is None
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, before)


def test_a_second_engine_over_the_same_model_reads_the_same_fused_weights():
    model, tokenizer = make_tiny_model("llama", 0), make_tiny_tokenizer()
    first = CacheBlendEngine(model, tokenizer)
    second = CacheBlendEngine(model, tokenizer)
    try:
        assert first.lm.fused_qkv is not None and second.lm.fused_qkv is not None
        for a, b in zip(first.lm.fused_qkv, second.lm.fused_qkv, strict=True):
            assert a.weight.data_ptr() == b.weight.data_ptr() and torch.equal(a.weight, b.weight)
    finally:
        first.close()
        second.close()


class LoggedLinear(nn.Linear):
    """A subclass of nn.Linear (as quantized or adapter layers are): its forward may not be the plain product."""


def test_a_model_with_projections_other_than_plain_linears_is_left_alone():
    model = make_tiny_model("llama", 0)
    attn = model.model.layers[1].self_attn
    wrapped = LoggedLinear(attn.k_proj.in_features, attn.k_proj.out_features, bias=False)
    wrapped.weight = attn.k_proj.weight
    attn.k_proj = wrapped
    q_before = model.model.layers[0].self_attn.q_proj.weight
    assert fuse_qkv(model) is None
    assert model.model.layers[0].self_attn.q_proj.weight is q_before  # nothing was rebound, not even layer 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])  # qwen3 normalizes q and k per head
def test_fused_rows_equal_the_three_products(family):
    model = make_tiny_model(family, 0)
    plain = LayerwiseModel(model)
    fused = LayerwiseModel(model, fused_qkv=fuse_qkv(model))
    x = torch.randn(9, model.config.hidden_size)
    cos, sin = plain.rope(torch.arange(20, 29))
    cos, sin_signed = cos[:, None], signed_sin(sin)[:, None]  # [T, 1, D]
    with torch.inference_mode():
        for layer_idx in range(plain.shape.num_layers):
            expected = plain.rotated_qkv(layer_idx, x, cos, sin_signed)
            for got, want in zip(fused.rotated_qkv(layer_idx, x, cos, sin_signed), expected, strict=True):
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize(("x_dtype", "w_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                  (torch.float16, torch.float16), (torch.bfloat16, torch.float32),
                                                  (torch.float32, torch.bfloat16)])  # fmt: skip
@pytest.mark.parametrize("inference", [True, False])  # torch runs rms_norm as one op, or as its parts, under each
def test_the_fused_rms_norm_equals_the_modules_own_forward(family, x_dtype, w_dtype, inference):
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    norm = getattr(module, f"{family.title()}RMSNorm")(64, eps=1e-6).to(w_dtype)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(norm.weight.shape, generator=generator) + 0.5)
    x = (torch.randn(3, 29, norm.weight.shape[0], generator=generator) * 4).to(x_dtype)
    with torch.inference_mode(inference), torch.no_grad():
        ours, theirs = rms_norm(norm, x), norm(x)
    assert ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs)
