"""Invariants of the blended prefill on tiny random models: exactness at the ends of the ratio range,
exact re-positioning of cached keys, and a selection that follows the deviations and the schedule."""

from __future__ import annotations

import pytest
import torch
from reference_forward import reference_logits_with_cache

from cacheblend_rag import CacheBlendEngine, EngineConfig, PrefillMode, blend_rule
from cacheblend_rag.engine.prefill.planning import prefix_and_chunk_masks
from cacheblend_rag.fusion import FusionPlan, fuse, keep_counts, select_recompute_tokens, token_deviation
from cacheblend_rag.models import LayerwiseModel, rotate_keys
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words


def three_chunk_prompt(engine: CacheBlendEngine, chunk_len: int = 24):
    chunks = [random_words(s, chunk_len) for s in (11, 12, 13)]
    return engine.build_prompt(chunks, prefix=random_words(1, 5), suffix=random_words(2, 6))


def logits_of(engine, prompt, mode, **kw):
    return engine.prefill(prompt, mode, **kw).logits


def cache_tensors(prefill):
    layers = prefill.cache.layers
    return [(layer.keys[0], layer.values[0]) for layer in layers]


def test_blend_at_ratio_one_equals_full_prefill(tiny_engine):
    prompt = three_chunk_prompt(tiny_engine)
    full = tiny_engine.prefill(prompt, "full")
    blend = tiny_engine.prefill(prompt, "blend", recompute_ratio=1.0)
    torch.testing.assert_close(blend.logits, full.logits, atol=1e-4, rtol=0)
    for (kf, vf), (kb, vb) in zip(cache_tensors(full), cache_tensors(blend), strict=False):
        torch.testing.assert_close(kb, kf, atol=1e-4, rtol=0)
        torch.testing.assert_close(vb, vf, atol=1e-4, rtol=0)
    assert blend.metrics.recomputed_tokens == prompt.num_tokens - len(prompt.prefix_ids)


def test_blend_at_ratio_zero_equals_full_reuse(tiny_engine):
    prompt = three_chunk_prompt(tiny_engine)
    reuse = tiny_engine.prefill(prompt, "reuse")
    blend = tiny_engine.prefill(prompt, "blend", recompute_ratio=0.0)
    torch.testing.assert_close(blend.logits, reuse.logits, atol=1e-4, rtol=0)
    for (kr, vr), (kb, vb) in zip(cache_tensors(reuse), cache_tensors(blend), strict=False):
        torch.testing.assert_close(kb, kr, atol=1e-4, rtol=0)
        torch.testing.assert_close(vb, vr, atol=1e-4, rtol=0)
    # Only the suffix is recomputed after the check layers.
    assert blend.metrics.recomputed_tokens == len(prompt.suffix_ids)


def test_cached_modes_match_the_models_own_forward_over_a_filled_cache(tiny_engine):
    prompt = three_chunk_prompt(tiny_engine)
    reuse = logits_of(tiny_engine, prompt, "reuse")
    prefix = logits_of(tiny_engine, prompt, "prefix")
    torch.testing.assert_close(reuse, reference_logits_with_cache(tiny_engine, prompt, 3), atol=1e-4, rtol=0)
    torch.testing.assert_close(prefix, reference_logits_with_cache(tiny_engine, prompt, 1), atol=1e-4, rtol=0)
    # Prefix caching loses nothing: the first chunk's cached KV is what a full prefill computes there.
    torch.testing.assert_close(prefix, logits_of(tiny_engine, prompt, "full"), atol=1e-4, rtol=0)


def test_reuse_really_differs_from_full(tiny_engine):
    # Guards the two tests above from passing trivially: on these models cross-chunk attention matters.
    prompt = three_chunk_prompt(tiny_engine)
    diff = (logits_of(tiny_engine, prompt, "reuse") - logits_of(tiny_engine, prompt, "full")).abs().max()
    assert diff > 1e-2


def test_single_chunk_at_front_blend_equals_prefix_caching(tiny_engine):
    prompt = tiny_engine.build_prompt([random_words(21, 30)], prefix=random_words(1, 5), suffix=random_words(2, 6))
    prefix = logits_of(tiny_engine, prompt, "prefix")
    for r in (0.0, 0.15, 1.0):
        torch.testing.assert_close(
            logits_of(tiny_engine, prompt, "blend", recompute_ratio=r), prefix, atol=1e-4, rtol=0
        )
    torch.testing.assert_close(prefix, logits_of(tiny_engine, prompt, "full"), atol=1e-4, rtol=0)


def test_first_chunk_kv_equals_in_context_prefill(tiny_engine):
    # A chunk precomputed right after the prefix is exactly what an in-context prefill holds there.
    prompt = three_chunk_prompt(tiny_engine)
    full = tiny_engine.prefill(prompt, "full")
    start, end = prompt.chunk_spans[0]
    key = tiny_engine.chunk_key(prompt.prefix_ids, prompt.chunk_ids[0])
    assert tiny_engine.store.get(key) is not None  # full mode stored it from its own prefill (capture)
    tiny_engine.clear_store()
    tiny_engine.prefill(prompt, "reuse")  # now prefilled on its own, after the prefix
    kv = tiny_engine.store.get(key)
    lm = tiny_engine.lm
    cos, sin = lm.rope(torch.arange(start, end))
    for layer_idx, (kf, vf) in enumerate(cache_tensors(full)):
        torch.testing.assert_close(rotate_keys(kv.keys[layer_idx], cos, sin), kf[:, start:end], atol=1e-5, rtol=0)
        torch.testing.assert_close(kv.values[layer_idx], vf[:, start:end], atol=1e-5, rtol=0)


def test_repositioned_keys_match_keys_computed_in_place(family):
    # Layer 0 keys depend on the token and its position only: a key cached at one offset and rotated to
    # another must equal the key an in-context prefill computes there.
    model = make_tiny_model(family)
    lm = LayerwiseModel(model)
    ids = torch.randint(3, 99, (40,), generator=torch.Generator().manual_seed(5))
    x = lm.normed_input(0, lm.embed(ids))
    raw_k, _ = lm.project_kv(0, x)  # [Hkv, T, D]
    for offset in (0, 17, 300):
        positions = torch.arange(offset, offset + 40)
        cos, sin = lm.rope(positions)
        ours = rotate_keys(raw_k, cos, sin)
        # transformers' own path: full forward with a cache, reading layer-0 keys at those positions
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[None], position_ids=positions[None], cache=cache, use_cache=True)
        torch.testing.assert_close(ours, cache.layers[0].keys[0], atol=1e-5, rtol=0)
    # Rotating twice composes: rotate to p then by d equals rotate to p + d.
    cos_a, sin_a = lm.rope(torch.arange(10, 50))
    cos_d, sin_d = lm.rope(torch.full((40,), 25))
    cos_b, sin_b = lm.rope(torch.arange(35, 75))
    torch.testing.assert_close(
        rotate_keys(rotate_keys(raw_k, cos_a, sin_a), cos_d, sin_d),
        rotate_keys(raw_k, cos_b, sin_b),
        atol=1e-4,
        rtol=0,
    )


def test_planted_outlier_is_always_selected():
    torch.manual_seed(0)
    k = torch.randn(2, 20, 8)
    v = torch.randn(2, 20, 8)
    k_cached = k + 0.01 * torch.randn_like(k)
    v_cached = v + 0.01 * torch.randn_like(v)
    k[:, 6] += 100.0
    v[:, 13] += 100.0
    assert select_recompute_tokens(token_deviation(k, k_cached), 1).tolist() == [6]
    assert select_recompute_tokens(token_deviation(v, v_cached), 1).tolist() == [13]


def chunks_reused_plan(prompt, keep: int) -> FusionPlan:
    """The prefix exact, every chunk token reused, the suffix computed; `keep` reused tokens kept after the one
    check layer (1), ranked by key deviation."""
    exact, reused = prefix_and_chunk_masks(prompt)
    return FusionPlan(prompt.input_ids(), torch.arange(prompt.num_tokens), exact, reused, (1,), (keep,), "key")


def test_planted_outlier_in_loaded_kv_is_recomputed(family):
    # Corrupt one reused token's cached key on the first check layer: its deviation explodes, so the fusor
    # must pick it even at the smallest ratio that recomputes anything.
    model = make_tiny_model(family)
    engine = CacheBlendEngine(
        model, make_tiny_tokenizer(), config=EngineConfig(miss_policy="blend", chunk_separator="")
    )
    prompt = three_chunk_prompt(engine)
    engine.prefill(prompt, "reuse")  # fills the store
    n = prompt.num_tokens
    start, _ = prompt.chunk_spans[1]
    victim = start + 7
    parts = [engine.store.get(k) for k in engine.prompt_keys(prompt)]
    load = engine.chunks.layer_loader(parts)

    def planted(layer_idx):
        k, v = load(layer_idx)
        if layer_idx == 1:
            k[:, victim] += 100.0
        return k, v

    plan = chunks_reused_plan(prompt, keep=1)
    result = fuse(engine.lm, plan, engine.chunks.prompt_kv(parts, n, load=planted))
    assert victim in result.selected_positions.tolist()
    assert result.recomputed_per_layer[2] == 1 + len(prompt.suffix_ids)


@pytest.mark.parametrize("keep", [12, "all"])
def test_one_masked_attention_call_equals_position_blocks(family, keep):
    # A GPU attends the selected queries in one call (block_size=0), a CPU in position blocks: the same
    # arithmetic, scattered queries (under an additive mask) and the prompt's tail (the causal square, its
    # padded rows dropped: every layer when all chunk tokens are kept) included.
    engine = CacheBlendEngine(
        make_tiny_model(family), make_tiny_tokenizer(), config=EngineConfig(miss_policy="blend", chunk_separator="")
    )
    prompt = three_chunk_prompt(engine, chunk_len=40)
    engine.prefill(prompt, "reuse")  # fills the store
    n = prompt.num_tokens
    parts = [engine.store.get(k) for k in engine.prompt_keys(prompt)]
    kept = 12 if keep == 12 else sum(len(c) for c in prompt.chunk_ids)
    plan = chunks_reused_plan(prompt, keep=kept)
    results = [fuse(engine.lm, plan, engine.chunks.prompt_kv(parts, n), block_size=size) for size in (0, 8, 512, None)]
    one_call = results[0]
    assert one_call.selected_positions.numel() == kept + len(prompt.suffix_ids)
    for other in results[1:]:
        assert torch.equal(other.selected_positions, one_call.selected_positions)
        torch.testing.assert_close(other.logits, one_call.logits, atol=1e-5, rtol=0)
        for a, b in zip(other.keys + other.values, one_call.keys + one_call.values, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tail", [1, 7, 30])
def test_attention_of_the_prompts_tail_without_a_mask_equals_the_masked_call(family, tail):
    # `attend(..., mask=None)` with fewer queries than keys: the queries are the last tokens, padded to the causal
    # square and cut again. Same result as the boolean and the additive mask of their positions.
    from cacheblend_rag.fusion import attention_mask
    from cacheblend_rag.models import causal_mask

    lm = LayerwiseModel(make_tiny_model(family))
    shape = lm.shape
    g = torch.Generator().manual_seed(tail)
    n = 40
    query = torch.randn(shape.num_heads, tail, shape.head_dim, generator=g)
    keys = torch.randn(shape.num_kv_heads, n, shape.head_dim, generator=g)
    values = torch.randn(shape.num_kv_heads, n, shape.head_dim, generator=g)
    q_pos, k_pos = torch.arange(n - tail, n), torch.arange(n)
    unmasked = lm.attend(1, query, keys, values, None)
    assert unmasked.shape == (tail, shape.hidden_size)
    for mask in (causal_mask(q_pos, k_pos), attention_mask(q_pos, k_pos, query.dtype)):
        torch.testing.assert_close(unmasked, lm.attend(1, query, keys, values, mask), atol=1e-5, rtol=0)


@pytest.mark.parametrize("block_size", [0, 512])
def test_recording_the_questions_attention_leaves_the_reuse_pass_unchanged(family, block_size):
    # The attention rule's first pass records where the question looks (`attention_from`); its queries are then
    # all the tokens being recomputed, so their output is taken from the recorded probabilities instead of a
    # second attention call. The pass must give what it gives without recording: logits and every layer's KV.
    from cacheblend_rag.engine.prefill.planning import question_mask, reuse_plan

    engine = CacheBlendEngine(
        make_tiny_model(family), make_tiny_tokenizer(), config=EngineConfig(miss_policy="blend", chunk_separator="")
    )
    prompt = three_chunk_prompt(engine, chunk_len=40)
    engine.prefill(prompt, "reuse")  # fills the store
    parts = [engine.store.get(k) for k in engine.prompt_keys(prompt)]
    runs = [
        fuse(
            engine.lm,
            reuse_plan(prompt),
            engine.chunks.prompt_kv(parts, prompt.num_tokens),
            block_size=block_size,
            attention_from=rows,
        )  # fmt: skip
        for rows in (None, question_mask(prompt))
    ]
    plain, recorded = runs
    assert plain.attention is None and recorded.attention is not None
    torch.testing.assert_close(recorded.logits, plain.logits, atol=1e-5, rtol=0)
    for a, b in zip(recorded.keys + recorded.values, plain.keys + plain.values, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_logits_left_for_later_come_from_one_lm_head_product_as_they_would_alone():
    # The attention rule fuses its first pass and its blend with `logits_later`, then reads both results' logits
    # from one LM head product (`logits_of`): the logits each fuse gives by itself.
    from cacheblend_rag.engine.prefill.planning import reuse_plan
    from cacheblend_rag.errors import CacheBlendError
    from cacheblend_rag.fusion import logits_of

    engine = CacheBlendEngine(
        make_tiny_model("llama"), make_tiny_tokenizer(), config=EngineConfig(miss_policy="blend", chunk_separator="")
    )
    prompt = three_chunk_prompt(engine, chunk_len=40)
    engine.prefill(prompt, "reuse")  # fills the store
    parts = [engine.store.get(k) for k in engine.prompt_keys(prompt)]
    plans = [reuse_plan(prompt), chunks_reused_plan(prompt, keep=12)]
    alone = [fuse(engine.lm, plan, engine.chunks.prompt_kv(parts, prompt.num_tokens)) for plan in plans]
    later = [fuse(engine.lm, plan, engine.chunks.prompt_kv(parts, prompt.num_tokens), logits_later=True)
             for plan in plans]  # fmt: skip
    assert all(r.logits is None and r.hidden is not None for r in later)
    logits_of(engine.lm, later)
    for a, b in zip(later, alone, strict=True):
        assert a.hidden is None
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=0)
    with pytest.raises(CacheBlendError, match="logits_later"):
        logits_of(engine.lm, alone)


def test_attention_output_from_recorded_weights_equals_attend(family):
    # `attend_from_weights` over `attention_weights`' probabilities is `attend` under the same mask, grouped
    # query heads included.
    from cacheblend_rag.models import causal_mask

    lm = LayerwiseModel(make_tiny_model(family))
    shape = lm.shape
    g = torch.Generator().manual_seed(3)
    n, a = 40, 9
    query = torch.randn(shape.num_heads, a, shape.head_dim, generator=g)
    keys = torch.randn(shape.num_kv_heads, n, shape.head_dim, generator=g)
    values = torch.randn(shape.num_kv_heads, n, shape.head_dim, generator=g)
    mask = causal_mask(torch.tensor([3, 8, 15, 16, 20, 27, 33, 38, 39]), torch.arange(n))
    probs = lm.attention_weights(1, query, keys, mask)
    expected = lm.attend(1, query, keys, values, mask)
    torch.testing.assert_close(lm.attend_from_weights(1, probs, values), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("ratio", [0.05, 0.15, 0.3])
def test_selected_count_follows_the_schedule(tiny_engine, ratio):
    prompt = three_chunk_prompt(tiny_engine, chunk_len=40)
    blend_cfg = blend_rule("gradual", ratio)
    out = tiny_engine.prefill(prompt, PrefillMode.BLEND, blend=blend_cfg)
    reused = sum(len(c) for c in prompt.chunk_ids)
    computed = len(prompt.suffix_ids)
    counts = keep_counts(reused, blend_cfg.schedule())
    assert counts[0] > counts[1] > counts[2] or ratio * reused < 3
    per_layer = out.metrics.recomputed_per_layer
    assert per_layer[0] == prompt.num_tokens - len(prompt.prefix_ids)  # before the first check: everything
    assert per_layer[1:4] == [c + computed for c in counts]
    assert all(x == counts[-1] + computed for x in per_layer[4:])
    assert out.metrics.recomputed_tokens == counts[-1] + computed


def test_keep_counts_round_up_and_never_increase():
    assert keep_counts(100, (0.225, 0.1875, 0.15)) == (23, 19, 15)
    assert keep_counts(10, (0.01,)) == (1,)
    assert keep_counts(10, (0.0,)) == (0,)
    assert keep_counts(7, (1.0, 1.0)) == (7, 7)


def test_more_recompute_moves_closer_to_full(tiny_engine):
    prompt = three_chunk_prompt(tiny_engine, chunk_len=40)
    full = logits_of(tiny_engine, prompt, "full")
    err = {
        r: (logits_of(tiny_engine, prompt, "blend", recompute_ratio=r) - full).abs().max().item() for r in (0.0, 1.0)
    }
    assert err[1.0] < 1e-4 < err[0.0]
