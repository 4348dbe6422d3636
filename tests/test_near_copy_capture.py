"""A captured entry cached after a near copy of its chunk (an overlapping window of the same text) is read only
where the prompt shows that near copy before the chunk too; elsewhere the chunk reads its plain captured entry or
its own."""

from __future__ import annotations

import torch

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.engine.chunks.context import copies_before, copies_digest
from cacheblend_rag.retrieval.overlap import near_copy_ids
from cacheblend_rag.testing import make_tiny_model, random_words

PREFIX = random_words(60, 5)
TEXT = random_words(61, 60).split()
A = " ".join(TEXT[:40])  # two overlapping windows of one text: 20 words shared
A2 = " ".join(TEXT[20:])
B = random_words(62, 30)
C = random_words(63, 24)


def engine_with(family: str, tokenizer, **config) -> CacheBlendEngine:
    config = EngineConfig(chunk_separator="", **{"chunk_context": "captured", **config})
    return CacheBlendEngine(make_tiny_model(family), tokenizer, config=config)


def prompt_of(engine: CacheBlendEngine, chunks: list[str]):
    return engine.build_prompt(chunks, prefix=PREFIX, suffix=random_words(64, 6))


def test_overlapping_windows_are_near_copies_and_other_chunks_are_not(family, tiny_tokenizer):
    engine = engine_with(family, tiny_tokenizer)
    a, a2, b, c = prompt_of(engine, [A, A2, B, C]).chunk_ids
    assert near_copy_ids(a, a2) and near_copy_ids(a2, a) and near_copy_ids(b, b)
    assert not near_copy_ids(a, b) and not near_copy_ids(b, c)
    assert copies_before([b, a, c, a2]) == [(), (), (), (a,)]
    assert copies_before([a2, a]) == [(), (a2,)]
    assert copies_digest([a, b]) == copies_digest([b, a]) != copies_digest([a])


def test_an_entry_cached_after_a_near_copy_is_read_only_where_the_prompt_shows_it(family, tiny_tokenizer):
    engine = engine_with(family, tiny_tokenizer, miss_policy="full")
    cold = prompt_of(engine, [B, A, A2])  # A2 is captured after B and A, a window of its own text
    assert engine.generate(cold, max_new_tokens=1).metrics.chunks_captured == 3
    engine.wait_for_fills()
    b, a, a2 = cold.chunk_ids
    after_copy = engine.chunk_key(cold.prefix_ids, a2, captured=True, copies=[a])
    assert after_copy in engine.store
    assert engine.chunk_key(cold.prefix_ids, a2, captured=True) not in engine.store  # no plain captured entry
    # the prompt shows A before A2 again (with other chunks between): A2 reads the entry cached after A
    shown = prompt_of(engine, [A, C, A2])
    assert engine.prompt_keys(shown, with_prefix=False)[2] == after_copy
    # the prompt does not show A: A2 reads its own entry, never the one that has read A
    hidden = prompt_of(engine, [B, A2])
    assert engine.prompt_keys(hidden, with_prefix=False)[1] == engine.chunk_key(hidden.prefix_ids, a2)
    config = EngineConfig(chunk_separator="", miss_policy="blend")
    reader = CacheBlendEngine(engine.model, tiny_tokenizer, config=config, store=engine.store)
    reuse = reader.prefill(hidden, "reuse").metrics
    assert (reuse.chunks_hit, reuse.chunks_hit_captured, reuse.chunks_missed) == (1, 0, 1)  # B's isolated entry


def test_a_prompt_showing_the_same_near_copies_reads_kv_equal_to_a_prefill_after_them(family, tiny_tokenizer):
    capturing = engine_with(family, tiny_tokenizer, miss_policy="full")
    cold = prompt_of(capturing, [A, A2])
    capturing.generate(cold, max_new_tokens=1)
    capturing.wait_for_fills()
    a, a2 = cold.chunk_ids
    kv = capturing.store.get(capturing.chunk_key(cold.prefix_ids, a2, captured=True, copies=[a]))
    separate = engine_with(family, tiny_tokenizer, miss_policy="blend", chunk_context="isolated")
    separate.precompute([A2], prefix=PREFIX, context=[[A]])
    want = separate.store.get(separate.chunk_key(cold.prefix_ids, a2))
    for got, ref in zip((kv.keys, kv.values), (want.keys, want.values), strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    # full KV reuse of the prompt that captured them is a full prefill
    full = capturing.prefill(cold, "full").logits
    torch.testing.assert_close(capturing.prefill(cold, "reuse").logits, full, atol=1e-4, rtol=0)


def test_grouped_precompute_keys_a_chunk_after_its_near_copy_by_it(family, tiny_tokenizer):
    engine = engine_with(family, tiny_tokenizer, miss_policy="blend")
    engine.precompute_groups([[A, A2], [B, C]], prefix=PREFIX)
    prompt = prompt_of(engine, [A, A2])
    a, a2 = prompt.chunk_ids
    assert engine.chunk_key(prompt.prefix_ids, a2, captured=True, copies=[a]) in engine.store
    assert engine.chunk_key(prompt.prefix_ids, a2, captured=True) not in engine.store
    assert engine.prefill(prompt, "reuse").metrics.chunks_hit_captured == 1
    alone = prompt_of(engine, [C, A2])  # A2 without A before it reads its isolated entry, which groups store too
    reuse = engine.prefill(alone, "reuse").metrics
    assert (reuse.chunks_hit, reuse.chunks_hit_captured, reuse.chunks_missed) == (2, 0, 0)


def test_a_chunk_reads_an_entry_cached_after_some_of_the_near_copies_its_prompt_shows(family, tiny_tokenizer):
    engine = engine_with(family, tiny_tokenizer, miss_policy="full")
    a3 = " ".join(TEXT[10:50])  # a third window, overlapping both
    cold = prompt_of(engine, [B, A, A2])  # A2 cached after A only
    engine.generate(cold, max_new_tokens=1)
    engine.wait_for_fills()
    both = prompt_of(engine, [B, A, a3, A2])  # the prompt shows A and a3 before A2: it reads the entry after A
    a = both.chunk_ids[1]
    assert engine.prompt_keys(both, with_prefix=False)[3] == engine.chunk_key(
        both.prefix_ids, both.chunk_ids[3], captured=True, copies=[a]
    )
