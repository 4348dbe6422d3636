"""Captured chunk KV: a full prefill stores the chunks it computed, so a cold request prefills nothing twice."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.models import rotate_keys, unrotate_keys
from cacheblend_rag.testing import make_tiny_model, random_words

PREFIX = random_words(40, 5)


def engine_with(family: str, tokenizer, **config) -> CacheBlendEngine:
    config = EngineConfig(chunk_separator="", **config)
    return CacheBlendEngine(make_tiny_model(family), tokenizer, config=config)


def three_chunks(engine: CacheBlendEngine):
    chunks = [random_words(41, 20), random_words(42, 16), random_words(43, 24)]
    return chunks, engine.build_prompt(chunks, prefix=PREFIX, suffix=random_words(44, 6))


def entry(engine: CacheBlendEngine, prompt, j: int, captured: bool = False):
    kv = engine.store.get(engine.chunk_key(prompt.prefix_ids, prompt.chunk_ids[j], captured=captured))
    assert kv is not None, f"chunk {j} is not stored"
    return kv.keys, kv.values


def test_unrotating_a_rotated_key_gives_the_raw_key_back(family, tiny_tokenizer):
    engine = engine_with(family, tiny_tokenizer)
    raw = torch.randn(2, 300, engine.lm.shape.head_dim)
    cos, sin = engine.lm.rope(torch.arange(1000, 1300), torch.float32)
    torch.testing.assert_close(unrotate_keys(rotate_keys(raw, cos, sin), cos, sin), raw, atol=1e-5, rtol=0)


def test_captured_kv_equals_a_prefill_after_the_same_context(family, tiny_tokenizer):
    capturing = engine_with(family, tiny_tokenizer, chunk_context="captured", miss_policy="full")
    chunks, prompt = three_chunks(capturing)
    cold = capturing.generate(prompt, max_new_tokens=2)
    capturing.wait_for_fills()
    assert cold.metrics.mode == "full" and cold.metrics.chunks_captured == 3
    # the same entries prefilled apart, each after the chunks before it in that prompt
    separate = engine_with(family, tiny_tokenizer, miss_policy="blend")
    separate.precompute(chunks, prefix=PREFIX, context=[[], chunks[:1], chunks[:2]])
    for j in range(3):  # the first chunk's entry is its own (isolated), the others' their captured ones
        for got, want in zip(entry(capturing, prompt, j, captured=j > 0), entry(separate, prompt, j), strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # so full KV reuse of the prompt that captured them is a full prefill
    full = capturing.prefill(prompt, "full").logits
    reuse = capturing.prefill(prompt, "reuse")
    assert reuse.metrics.chunks_hit == 3
    torch.testing.assert_close(reuse.logits, full, atol=1e-4, rtol=0)


def test_exact_capture_stores_the_first_chunk_from_the_prompt_and_fills_the_rest_alone(family, tiny_tokenizer):
    engine = engine_with(family, tiny_tokenizer, miss_policy="full", chunk_context="isolated")
    chunks, prompt = three_chunks(engine)
    cold = engine.generate(prompt, max_new_tokens=2)
    assert cold.metrics.chunks_missed == 3 and cold.metrics.chunks_captured == 1
    engine.wait_for_fills()
    # every entry is the isolated one a precompute builds, the first cut from the full prefill
    isolated = engine_with(family, tiny_tokenizer, miss_policy="blend")
    isolated.precompute(chunks, prefix=PREFIX, context=None)
    for j in range(3):
        assert engine.chunk_key(prompt.prefix_ids, prompt.chunk_ids[j]) == isolated.chunk_key(
            prompt.prefix_ids, prompt.chunk_ids[j]
        )
        for got, want in zip(entry(engine, prompt, j), entry(isolated, prompt, j), strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_a_full_request_stores_what_it_computed_and_fills_nothing(family, tiny_tokenizer):
    engine = engine_with(family, tiny_tokenizer, miss_policy="blend")
    chunks, prompt = three_chunks(engine)
    # B's entry is prefilled after A: in this prompt the full prefill computes it exactly so
    engine.set_chunk_context(chunks, [[], chunks[:1], []], prefix=PREFIX)
    full = engine.prefill(prompt, "full")
    assert full.metrics.chunks_captured == 2
    keys = [engine.chunk_key(prompt.prefix_ids, ids) for ids in prompt.chunk_ids]
    assert [k in engine.store for k in keys] == [True, True, False]  # C's entry is isolated: not in this prompt


def test_capture_all_keys_its_entries_apart_from_isolated_ones(family, tiny_tokenizer):
    engine = engine_with(family, tiny_tokenizer, chunk_context="captured", miss_policy="full")
    _, prompt = three_chunks(engine)
    for ids in prompt.chunk_ids:
        assert engine.chunk_key(prompt.prefix_ids, ids) != engine.chunk_key(prompt.prefix_ids, ids, captured=True)
    own = [engine.chunk_key(prompt.prefix_ids, ids) for ids in prompt.chunk_ids]
    captured = [engine.chunk_key(prompt.prefix_ids, ids, captured=True) for ids in prompt.chunk_ids]
    assert engine.prompt_keys(prompt, with_prefix=False) == own  # nothing stored: a miss stores its own entry
    engine.generate(prompt, max_new_tokens=1)  # cold: the miss policy answers with a full prefill
    engine.wait_for_fills()
    assert engine.prompt_keys(prompt, with_prefix=False) == [own[0], *captured[1:]]  # the first chunk reads its own
    read = engine.prefill(prompt, "reuse").metrics
    assert (read.chunks_hit, read.chunks_hit_captured) == (3, 2) and "captured=2 " in read.summary()


def test_the_first_chunk_of_a_prompt_never_reads_kv_captured_after_other_chunks(family, tiny_tokenizer):
    # Captured in the order C, A, B: A's and B's entries were computed after other chunks. Asked in the order
    # A, B, C, the first chunk A (real context: the prefix alone) is a miss of its own, isolated, entry and is
    # prefilled alone; B reads its captured entry; C, captured first, reads its own entry.
    engine = engine_with(family, tiny_tokenizer, chunk_context="captured", miss_policy="blend")
    chunks, prompt = three_chunks(engine)
    earlier = engine.build_prompt([chunks[2], chunks[0], chunks[1]], prefix=PREFIX, suffix=random_words(45, 6))
    # the earlier request was cold, and the miss policy answered it in full (an engine on the same store)
    config = EngineConfig(chunk_separator="", miss_policy="full")
    first = CacheBlendEngine(engine.model, tiny_tokenizer, config=config, store=engine.store)
    assert first.generate(earlier, max_new_tokens=1).metrics.chunks_captured == 3
    first.wait_for_fills()
    reuse = engine.prefill(prompt, "reuse")
    assert (reuse.metrics.chunks_missed, reuse.metrics.chunks_hit) == (1, 2)
    assert reuse.metrics.chunks_hit_captured == 1  # B; C, captured first, is read from its own entry
    isolated = engine_with(family, tiny_tokenizer, miss_policy="blend")
    isolated.precompute(chunks[:1], prefix=PREFIX)
    for got, want in zip(entry(engine, prompt, 0), entry(isolated, prompt, 0), strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # a chunk after the first with no captured entry reads its own (C, captured first, in second place here)
    later = engine.build_prompt([chunks[0], chunks[2]], prefix=PREFIX, suffix=random_words(46, 6))
    assert engine.prefill(later, "reuse").metrics.chunks_hit == 2
    # a full prefill asked for (a reference, say) stores no KV as it is in its prompt: C after A is not captured
    assert engine.prefill(later, "full").metrics.chunks_captured == 0
    assert engine.chunk_key(prompt.prefix_ids, prompt.chunk_ids[2], captured=True) not in engine.store


def test_each_chunk_context_reads_and_stores_the_captured_entries_it_names():
    assert EngineConfig().capture_policy == "all" and EngineConfig().group_tokens == 3072  # the default: grouped
    assert EngineConfig(chunk_context="captured").capture_policy == "all"
    assert EngineConfig(chunk_context="captured").group_tokens == 0
    assert EngineConfig(chunk_context="isolated").capture_policy == "exact"
    with pytest.raises(ConfigError, match="chunk_context must be one of grouped, captured, isolated"):
        EngineConfig(chunk_context="everything")
    with pytest.raises(ConfigError, match="chunk_context='isolated'"):
        EngineConfig(capture="exact")


def test_a_guard_escalation_to_a_full_recompute_adds_the_captured_entries(family, tiny_tokenizer):
    from cacheblend_rag import Guard

    always = Guard(min_margin=1.0, ratios=(1.0,))  # every request is a near tie: straight to r = 1
    engine = engine_with(family, tiny_tokenizer, chunk_context="captured", miss_policy="blend", guard=always)
    chunks, prompt = three_chunks(engine)
    engine.precompute(chunks, prefix=PREFIX, context=None)  # own entries only
    blended = engine.prefill(prompt, "blend")
    assert blended.metrics.escalations == [1.0] and blended.metrics.chunks_captured == 2  # the two after the first
    separate = engine_with(family, tiny_tokenizer, miss_policy="blend")
    separate.precompute(chunks, prefix=PREFIX, context=[[], chunks[:1], chunks[:2]])
    for j in (1, 2):
        for got, want in zip(entry(engine, prompt, j, captured=True), entry(separate, prompt, j), strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert engine.prefill(prompt, "blend").metrics.chunks_captured == 0  # stored: nothing to add
