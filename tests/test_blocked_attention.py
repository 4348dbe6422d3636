"""Attention as bf16 products over blocks of queries (`models.attention.blocked_attention`), which a bf16 engine on a
CPU runs in the model's own forward and in the blend's recomputed rows: the float32 attention's result within bf16's
error, for causal queries aligned at the end and for any bool mask; the model's forward routes only what it can take
to it (one sequence, no mask) and the rest to SDPA; and the blend's ends still hold over it."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.models.attention import (
    ATTENTION_BLOCK,
    BLOCKED_ATTENTION,
    blocked_attention,
    causal_mask,
    use_blocked_attention,
    written_out_attention,
)
from cacheblend_rag.models.packed import packing_available
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words


def reference(query, keys, values, mask):
    """float32 attention written out: [H, A, D] -> [A, H, D]."""
    return written_out_attention(query.float(), keys.float(), values.float(), mask, 0.25).transpose(0, 1)


def tensors(heads, kv_heads, rows, keys, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, rows, 16, generator=g).bfloat16()
    k, v = (torch.randn(kv_heads, keys, 16, generator=g).bfloat16() for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("heads", [(6, 2), (4, 4)])  # grouped-query and one KV head per query head
@pytest.mark.parametrize(
    ("rows", "keys"), [(1, 1), (1, 300), (7, 7), (ATTENTION_BLOCK, 200), (ATTENTION_BLOCK + 1, 300), (200, 200)]
)
def test_causal_queries_at_the_end_attend_as_float32_does(heads, rows, keys):
    q, k, v = tensors(*heads, rows, keys, seed=rows + keys)
    positions = torch.arange(keys)
    ours = blocked_attention(q, k, v, None, 0.25)
    assert ours.shape == (rows, heads[0], 16) and ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), reference(q, k, v, causal_mask(positions[keys - rows :], positions)),
                               atol=2e-2, rtol=2e-2)  # fmt: skip


@pytest.mark.parametrize("kind", ["subset", "window", "random"])
def test_any_bool_mask_attends_as_float32_does(kind):
    keys = 260
    g = torch.Generator().manual_seed(5)
    positions = torch.arange(keys)
    chosen = torch.sort(torch.randperm(keys, generator=g)[:90]).values  # a blend's recomputed rows, in order
    mask = {
        "subset": causal_mask(chosen, positions),
        "window": causal_mask(chosen, positions, window=40),
        "random": (torch.rand(90, keys, generator=g) > 0.6) | (positions == 0),  # every row sees the first key
    }[kind]
    q, k, v = tensors(6, 2, 90, keys, seed=9)
    torch.testing.assert_close(blocked_attention(q, k, v, mask, 0.25).float(), reference(q, k, v, mask),
                               atol=2e-2, rtol=2e-2)  # fmt: skip


def test_a_row_that_may_see_no_key_is_nan_and_leaves_the_others_alone():
    q, k, v = tensors(6, 2, 5, 50, seed=2)
    mask = causal_mask(torch.arange(45, 50), torch.arange(50))
    mask[2] = False
    out = blocked_attention(q, k, v, mask, 0.25)
    assert out[2].isnan().all()
    rows = [0, 1, 3, 4]
    torch.testing.assert_close(out[rows].float(), reference(q, k, v, mask)[rows], atol=2e-2, rtol=2e-2)


needs_bf16 = pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.bfloat16), reason="oneDNN runs no bf16 products on this CPU"
)


def bf16_model(family="qwen2"):
    return make_tiny_model(family, seed=4).to(torch.bfloat16).eval()


@needs_bf16
def test_the_model_forward_runs_blocked_attention_only_where_it_applies():
    model, plain = bf16_model(), bf16_model()
    use_blocked_attention(model)
    assert model.config._attn_implementation == BLOCKED_ATTENTION
    ids = torch.randint(5, model.config.vocab_size, (2, 90), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        one, one_plain = model(input_ids=ids[:1]).logits, plain(input_ids=ids[:1]).logits
        torch.testing.assert_close(one.float(), one_plain.float(), atol=5e-2, rtol=5e-2)
        assert not torch.equal(one, one_plain)  # the blocked kernel ran
        # two sequences, one padded: a mask, so SDPA's own attention, as the plain model's
        pad = torch.ones_like(ids)
        pad[1, :10] = 0
        padded, padded_plain = (m(input_ids=ids, attention_mask=pad).logits for m in (model, plain))
        assert torch.equal(padded, padded_plain)


@needs_bf16
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_bf16_engine_attends_blocked_and_the_blends_ends_hold(family):
    config = EngineConfig(device="cpu", dtype="bfloat16")
    engine = CacheBlendEngine(bf16_model(family), make_tiny_tokenizer(), config=config)
    assert engine.lm.blocked
    chunks = [random_words(s, 40) for s in (31, 32, 33)]
    prompt = engine.build_prompt(chunks, prefix=random_words(1, 5), suffix=random_words(2, 6))
    full, reuse = engine.prefill(prompt, "full").logits, engine.prefill(prompt, "reuse").logits
    # r = 1 is the full prefill to bf16's rounding (its layers' own path differs from the model's forward in the
    # order of a few roundings: 0.02-0.04 with torch's kernel too), far from full reuse's distance
    at_one = engine.prefill(prompt, "blend", recompute_ratio=1.0).logits
    assert (at_one - full).abs().max() < 0.06 < 0.15 < (reuse - full).abs().max()
    assert torch.equal(engine.prefill(prompt, "blend", recompute_ratio=0.0).logits, reuse)
    answer = engine.generate(prompt, mode="full", max_new_tokens=5, temperature=0.0)
    assert len(answer.token_ids) >= 1
