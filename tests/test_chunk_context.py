"""Contextual chunk KV: a chunk's entry prefilled after other text, its key, and the neighbour search."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.engine.chunks.context import ChunkContexts, context_digest
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.retrieval.neighbours import nearest_neighbours, neighbour_context
from cacheblend_rag.store import chunk_key
from cacheblend_rag.testing import make_tiny_model, random_words


def two_chunk_prompt(engine: CacheBlendEngine):
    a, b = random_words(31, 24), random_words(32, 20)
    return [a, b], engine.build_prompt([a, b], prefix=random_words(33, 5), suffix=random_words(34, 6))


def test_chunk_after_its_predecessor_makes_full_reuse_exact(tiny_engine):
    (a, b), prompt = two_chunk_prompt(tiny_engine)
    full = tiny_engine.prefill(prompt, "full").logits
    isolated = tiny_engine.prefill(prompt, "reuse").logits
    assert (isolated - full).abs().max() > 1e-3  # chunks cached alone: reuse is not exact
    # B cached after its real predecessor A (A's real context is the prefix alone): reuse is a full prefill
    tiny_engine.precompute([a, b], prefix=random_words(33, 5), context=[[], [a]])
    contextual = tiny_engine.prefill(prompt, "reuse")
    assert contextual.metrics.chunks_hit == 2  # both read from the store, none prefilled in the request
    torch.testing.assert_close(contextual.logits, full, atol=1e-4, rtol=0)
    # and the blend's ends still hold on contextual entries: r = 1 is full, r = 0 is full reuse
    torch.testing.assert_close(tiny_engine.prefill(prompt, "blend", recompute_ratio=1.0).logits, full, atol=1e-4,
                               rtol=0)  # fmt: skip
    torch.testing.assert_close(
        tiny_engine.prefill(prompt, "blend", recompute_ratio=0.0).logits, contextual.logits, atol=1e-4, rtol=0
    )


def test_the_first_chunk_of_a_prompt_reads_its_isolated_entry(tiny_engine, tiny_tokenizer):
    # A cached after B and B after A: asked in the order A, B, reuse is a full prefill only if A, whose real
    # context is the prefix alone, is read from its isolated entry, and B from its entry after A
    (a, b), prompt = two_chunk_prompt(tiny_engine)
    full = tiny_engine.prefill(prompt, "full").logits
    assert tiny_engine.precompute([a, b], prefix=random_words(33, 5), context=[[b], [a]]) == (0, 2)
    warm = tiny_engine.prefill(prompt, "reuse")
    assert (warm.metrics.chunks_hit, warm.metrics.chunks_missed) == (2, 0)  # precompute stored both entries
    torch.testing.assert_close(warm.logits, full, atol=1e-4, rtol=0)
    isolated_a = chunk_key(tiny_engine.fingerprint, tiny_engine.dtype, prompt.prefix_ids, prompt.chunk_ids[0])
    assert tiny_engine.prompt_keys(prompt, with_prefix=False) == [
        isolated_a,
        tiny_engine.chunk_key(prompt.prefix_ids, prompt.chunk_ids[1]),
    ]
    # contexts recorded, nothing stored: the head chunk is prefilled alone and stored under its isolated key
    cold = CacheBlendEngine(tiny_engine.model, tiny_tokenizer, config=EngineConfig(miss_policy="blend",
                                                                                   chunk_separator=""))  # fmt: skip
    cold.set_chunk_context([a, b], [[b], [a]], prefix=random_words(33, 5))
    first = cold.prefill(prompt, "reuse")
    assert first.metrics.chunks_missed == 2
    torch.testing.assert_close(first.logits, full, atol=1e-4, rtol=0)
    assert isolated_a in cold.store and cold.chunk_key(prompt.prefix_ids, prompt.chunk_ids[0]) not in cold.store


def test_a_chunk_cached_after_a_later_chunk_of_the_prompt_reads_its_isolated_entry(family, tiny_tokenizer):
    # B's entry is prefilled after C. In the prompt A, B, C it would have read C before C is shown, so B reads
    # its isolated entry there; in A, C, B it reads that entry (C does come before B), and C, cached after A and
    # B, reads its isolated one. C is exact in A, B, C.
    def engine_(policy="blend"):
        return CacheBlendEngine(make_tiny_model(family), tiny_tokenizer,
                                config=EngineConfig(miss_policy=policy, chunk_separator=""))  # fmt: skip

    engine = engine_()
    prefix = random_words(33, 5)
    a, b, c = random_words(41, 16), random_words(42, 18), random_words(43, 14)
    abc = engine.build_prompt([a, b, c], prefix=prefix, suffix=random_words(34, 6))
    acb = engine.build_prompt([a, c, b], prefix=prefix, suffix=random_words(34, 6))
    contexts = [[], [c], [a, b]]
    engine.precompute([a, b, c], prefix=prefix, context=contexts)
    assert [p.isolated for p in engine.placements(abc)] == [True, True, False]
    assert [p.isolated for p in engine.placements(acb)] == [True, True, False]
    isolated_b = chunk_key(engine.fingerprint, engine.dtype, abc.prefix_ids, abc.chunk_ids[1])
    after_c = engine.chunk_key(abc.prefix_ids, abc.chunk_ids[1])
    assert after_c != isolated_b
    assert engine.prompt_keys(abc, with_prefix=False)[1] == isolated_b
    assert engine.prompt_keys(acb, with_prefix=False)[2] == after_c
    warm = engine.prefill(abc, "reuse")
    assert (warm.metrics.chunks_hit, warm.metrics.chunks_missed) == (3, 0)  # precompute stored both entries of B

    # the same prompt on an engine where B has no context at all: the same KV, so the same logits
    plain = engine_()
    plain.precompute([a, b, c], prefix=prefix, context=[[], [], [a, b]])
    torch.testing.assert_close(warm.logits, plain.prefill(abc, "reuse").logits, atol=1e-5, rtol=0)
    # and the entry after C really differs (so reading it would show)
    assert not torch.allclose(engine.store.get(after_c).values, engine.store.get(isolated_b).values, atol=1e-3)

    # cold: a chunk missed at such a place is prefilled alone, and the fill after a full prefill stores both of
    # its entries, so the next request finds every chunk
    cold = engine_("full")
    cold.set_chunk_context([a, b, c], contexts, prefix=prefix)
    assert cold.generate(abc, max_new_tokens=2).metrics.chunks_missed == 3
    cold.wait_for_fills()
    assert isolated_b in cold.store and after_c in cold.store
    again = cold.prefill(abc, "reuse")
    assert (again.metrics.chunks_hit, again.metrics.chunks_missed) == (3, 0)
    torch.testing.assert_close(again.logits, warm.logits, atol=1e-5, rtol=0)


def test_the_recorded_context_changes_the_entry_and_its_key(tiny_engine):
    (a, b), prompt = two_chunk_prompt(tiny_engine)
    prefix_ids, ids = prompt.prefix_ids, prompt.chunk_ids[1]
    isolated_key = chunk_key(tiny_engine.fingerprint, tiny_engine.dtype, prefix_ids, ids)
    assert tiny_engine.chunk_key(prefix_ids, ids) == isolated_key  # no context: the key entries always had
    assert tiny_engine.set_chunk_context([a, b], [[], [a]], prefix=random_words(33, 5)) == 1
    after_a = tiny_engine.chunk_key(prefix_ids, ids)
    tiny_engine.set_chunk_context([a, b], [[], [random_words(35, 24)]], prefix=random_words(33, 5))
    after_other = tiny_engine.chunk_key(prefix_ids, ids)
    assert len({isolated_key, after_a, after_other}) == 3  # another context is another entry, never a mix
    tiny_engine.precompute([a, b], prefix=random_words(33, 5), context=None)
    assert tiny_engine.chunk_key(prefix_ids, ids) == isolated_key
    assert tiny_engine.store.get(isolated_key) is not None


def test_a_chunk_missing_at_request_time_is_stored_with_its_context(family, tiny_tokenizer):
    engine = CacheBlendEngine(make_tiny_model(family), tiny_tokenizer,
                              config=EngineConfig(miss_policy="full", chunk_separator=""))  # fmt: skip
    (a, b), prompt = two_chunk_prompt(engine)
    engine.set_chunk_context([a, b], [[], [a]], prefix=random_words(33, 5))
    cold = engine.generate(prompt, max_new_tokens=2)
    assert cold.metrics.chunks_missed == 2
    full = engine.prefill(prompt, "full").logits
    warm = engine.prefill(prompt, "reuse")  # the deferred fill stored B after A
    assert warm.metrics.chunks_hit == 2
    torch.testing.assert_close(warm.logits, full, atol=1e-4, rtol=0)


def test_context_arguments_are_checked(tiny_engine):
    chunks = [random_words(1, 5), random_words(2, 5)]
    with pytest.raises(ConfigError, match="one list of texts per chunk"):
        tiny_engine.precompute(chunks, prefix="p", context=[["x"]])
    with pytest.raises(ConfigError, match="one list of texts per chunk"):
        tiny_engine.precompute(chunks, prefix="p", context=["x", "y"])
    with pytest.raises(ConfigError, match="'keep', None"):
        tiny_engine.precompute(chunks, prefix="p", context="nearest")
    with pytest.raises(ConfigError, match="left the product.*one list of texts per chunk"):
        tiny_engine.precompute(chunks, prefix="p", context="neighbours")
    with pytest.raises(ConfigError, match="non-empty text"):
        tiny_engine.precompute(chunks, prefix="p", context=[[""], []])
    with pytest.raises(ConfigError, match="its own context"):
        tiny_engine.precompute(chunks, prefix="p", context=[[chunks[0]], []])
    with pytest.raises(ConfigError, match="neighbour context left the product"):
        EngineConfig(context_neighbours=2)


def test_chunk_contexts_hold_each_part_once_and_forget_cleanly():
    contexts = ChunkContexts()
    shared = list(range(100, 140))
    for i in range(50):
        contexts.assign([i, i + 1], [shared, [7, i]])
    assert len(contexts) == 50
    assert contexts.tokens([3, 4]) == (*shared, 7, 3)
    assert contexts.digest([3, 4]) == context_digest([*shared, 7, 3])
    assert contexts.digest([999]) == "" and contexts.tokens([999]) == ()
    contexts.assign([3, 4], [])
    assert contexts.digest([3, 4]) == ""
    contexts.clear()
    assert len(contexts) == 0


def test_chunk_contexts_tell_which_chunks_have_read_a_later_chunk_of_a_prompt():
    contexts = ChunkContexts()
    a, b, c, d = [1, 2], [3, 4], [5, 6], [7, 8]
    assert contexts.holds_later([a, b, c]) == [False, False, False]  # nothing recorded
    contexts.assign(a, [c])  # A after C
    contexts.assign(b, [a, d])  # B after A and D (D in no prompt below)
    contexts.assign(c, [b])  # C after B
    assert contexts.holds_later([a, b, c]) == [True, False, False]
    assert contexts.holds_later([c, b, a]) == [True, True, False]
    assert contexts.holds_later([b, a, c]) == [True, True, False]
    assert contexts.holds_later([b, c, a, b]) == [True, True, False, False]  # B placed again after C
    assert contexts.holds_later([d, b]) == [False, False]  # D has no context; B's context is before it


def test_nearest_neighbours_leave_out_the_chunk_and_its_copies():
    rng = np.random.default_rng(0)
    base = rng.normal(size=(4, 8)).astype(np.float32)
    pool = np.stack([base[0], base[0] + 0.1 * base[1], base[0] + 0.5 * base[2], base[3], base[0]])
    pool /= np.linalg.norm(pool, axis=1, keepdims=True)
    texts = ["a", "near", "mid", "far", "a"]  # row 4 is a copy of row 0
    found = nearest_neighbours(pool[:1], pool, 2, query_texts=["a"], pool_texts=texts)
    assert found == [[1, 2]]  # most similar first; neither itself nor its copy
    assert neighbour_context(["near", "mid"]) == ["mid", "near"]  # the nearest sits right before the chunk
    assert nearest_neighbours(pool[:1], pool, 0, query_texts=["a"], pool_texts=texts) == [[]]


TOPICS = [
    "Cats sleep for most of the day and hunt small birds and mice at dusk.",
    "Rockets burn liquid oxygen and kerosene to lift satellites into orbit.",
    "A house cat purrs when content and chases mice through the garden at night.",
    "The launch vehicle's first stage fires its engines to push the payload to orbit.",
]


def test_the_index_gives_each_chunk_its_nearest_chunks_nearest_last():
    from cacheblend_rag.retrieval import Chunk, ChunkIndex

    index = ChunkIndex.build([Chunk(t, "doc", i, 20) for i, t in enumerate(TOPICS)], show_progress=False)
    contexts = index.neighbour_contexts(2)
    assert [c[-1] for c in contexts] == [TOPICS[2], TOPICS[3], TOPICS[0], TOPICS[1]]  # the same topic, right before
    assert all(len(c) == 2 and TOPICS[i] not in c for i, c in enumerate(contexts))
    assert index.neighbour_contexts(0) == [[], [], [], []]


def test_precompute_follows_the_engines_chunk_context_and_records_no_context_by_itself(tiny_tokenizer):
    chunks = [random_words(60 + i, 12) for i in range(4)]
    for chunk_context, stored_captured in [("grouped", True), ("captured", False), ("isolated", False)]:
        config = EngineConfig(chunk_separator="", chunk_context=chunk_context)
        engine = CacheBlendEngine(make_tiny_model("llama"), tiny_tokenizer, config=config)
        assert engine.precompute(chunks, prefix="p") == (0, 4) and len(engine.chunks.contexts) == 0
        prompt = engine.build_prompt(chunks, prefix="p", suffix="q")
        captured = [engine.chunk_key(prompt.prefix_ids, ids, captured=True) in engine.store for ids in prompt.chunk_ids]
        assert any(captured) == stored_captured, chunk_context  # grouped: a group's later chunks as it held them
        assert engine.precompute(chunks, prefix="p") == (4, 0)
