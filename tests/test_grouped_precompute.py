"""Grouped precompute: a corpus's chunk KV from one full prefill per group of similar chunks.

The grouping (every chunk once, groups within their token budget, each chunk after the most similar one left), then
the engine: entries from a group's prefill equal a prefill of each chunk after the chunks before it in the group,
so full KV reuse of a prompt laid out as the group is a full prefill (1e-4), and nothing is computed twice.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.retrieval.groups import cut_groups, similarity_chain, similarity_groups
from cacheblend_rag.testing import make_tiny_model, random_words

PREFIX = random_words(60, 5)


def unit(rows: list[list[float]]) -> np.ndarray:
    v = np.asarray(rows, dtype=np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_the_chain_follows_the_most_similar_chunk_left_and_places_every_chunk_once():
    # 0 ~ 2 ~ 4 on one axis, 1 ~ 3 on another, 5 alone on a third
    vectors = unit([[1, 0, 0], [0, 1, 0], [0.9, 0.1, 0], [0.1, 0.9, 0], [0.8, 0.2, 0.1], [0, 0, 1]])
    texts = [f"t{i}" for i in range(6)]
    order = similarity_chain(vectors, texts)
    assert sorted(order) == list(range(6))
    assert order[:3] == [0, 2, 4]
    assert set(order[3:5]) == {1, 3}


def test_copies_of_a_text_are_never_each_others_next_chunk():
    vectors = unit([[1, 0], [1, 0], [0.9, 0.1], [0, 1]])
    order = similarity_chain(vectors, ["a", "a", "b", "c"], search=2)
    assert sorted(order) == [0, 1, 2, 3] and order[1] == 2  # not the copy of "a"


def test_groups_keep_to_their_token_budget_and_a_long_chunk_stands_alone():
    assert cut_groups([3, 1, 2, 0, 4], [10, 10, 30, 10, 5], group_tokens=20) == [[3, 1], [2], [0, 4]]
    vectors = unit([[1, 0], [0.9, 0.1], [0, 1], [0.1, 0.9]])
    groups = similarity_groups(vectors, list("abcd"), [5, 5, 5, 5], group_tokens=10)
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3]
    assert groups == [[0, 1], [3, 2]] or groups == [[0, 1], [2, 3]]
    with pytest.raises(ConfigError, match="group_tokens"):
        cut_groups([0], [5], group_tokens=0)


def engine_with(family: str, tokenizer, **config) -> CacheBlendEngine:
    return CacheBlendEngine(make_tiny_model(family), tokenizer, config=EngineConfig(chunk_separator="", **config))


def test_a_prompt_laid_out_as_its_group_reuses_kv_equal_to_a_full_prefill(family, tiny_tokenizer):
    engine = engine_with(family, tiny_tokenizer, miss_policy="blend")
    group = [random_words(61, 18), random_words(62, 14), random_words(63, 22)]
    other = [random_words(64, 12), random_words(65, 16)]
    assert engine.precompute_groups([group, other], prefix=PREFIX) == (0, 5)
    prompt = engine.build_prompt(group, prefix=PREFIX, suffix=random_words(66, 6))
    # the first chunk's isolated entry, the later chunks' captured ones: all exact at their places here
    separate = engine_with(family, tiny_tokenizer, miss_policy="blend")
    separate.precompute(group, prefix=PREFIX, context=[[], group[:1], group[:2]])
    for j in range(3):
        got = engine.store.get(engine.chunk_key(prompt.prefix_ids, prompt.chunk_ids[j], captured=j > 0))
        want = separate.store.get(separate.chunk_key(prompt.prefix_ids, prompt.chunk_ids[j]))
        assert got is not None and want is not None
        torch.testing.assert_close(got.keys, want.keys, atol=1e-4, rtol=0)
        torch.testing.assert_close(got.values, want.values, atol=1e-4, rtol=0)
    reuse = engine.prefill(prompt, "reuse")
    assert reuse.metrics.chunks_hit == 3 and reuse.metrics.chunks_hit_captured == 2
    torch.testing.assert_close(reuse.logits, engine.prefill(prompt, "full").logits, atol=1e-4, rtol=0)
    # in another order each chunk still has an entry: the first place reads the isolated one
    swapped = engine.build_prompt([group[2], other[0], group[0]], prefix=PREFIX, suffix=random_words(66, 6))
    assert engine.prefill(swapped, "reuse").metrics.chunks_missed == 0


def test_nothing_is_computed_twice_and_counts_say_what_was_stored(tiny_tokenizer):
    engine = engine_with("llama", tiny_tokenizer, miss_policy="blend")
    groups = [[random_words(70 + i, 10), random_words(80 + i, 12)] for i in range(3)]
    assert engine.precompute_groups(groups, prefix=PREFIX) == (0, 6)
    assert engine.precompute_groups(groups, prefix=PREFIX) == (6, 0)
    engine.precompute([groups[0][0]], prefix=PREFIX, context=None)  # isolated entries only: already there
    # a chunk keeps one captured entry: only a chunk first in its old group gets one now
    assert engine.precompute_groups([[groups[0][1], groups[1][0]]], prefix=PREFIX) == (1, 1)


def test_precompute_groups_a_corpus_by_similarity(tiny_tokenizer):
    engine = engine_with("llama", tiny_tokenizer, miss_policy="blend")
    chunks = [random_words(90 + i, 15) for i in range(5)]
    assert engine.precompute(chunks, prefix=PREFIX, context="groups", group_tokens=40) == (0, 5)
    prompt = engine.build_prompt(chunks, prefix=PREFIX, suffix=random_words(99, 4))
    reuse = engine.prefill(prompt, "reuse")
    assert reuse.metrics.chunks_missed == 0 and reuse.metrics.chunks_hit == 5


def test_grouped_precompute_needs_an_engine_that_reads_it(tiny_tokenizer):
    engine = engine_with("llama", tiny_tokenizer, chunk_context="isolated")
    with pytest.raises(ConfigError, match="chunk_context='grouped'"):
        engine.precompute_groups([[random_words(1, 5), random_words(2, 5)]], prefix=PREFIX)
    with pytest.raises(ConfigError, match="chunk_context='grouped'"):
        engine.precompute([random_words(1, 5)], prefix=PREFIX, context="groups")


def test_the_default_chunk_context_makes_precompute_grouped(tiny_tokenizer):
    engine = engine_with("llama", tiny_tokenizer, miss_policy="blend")
    chunks = [random_words(110 + i, 15) for i in range(4)]
    assert engine.precompute(chunks, prefix=PREFIX, group_tokens=40) == (0, 4)
    prompt = engine.build_prompt(chunks, prefix=PREFIX, suffix=random_words(99, 4))
    captured = [engine.chunk_key(prompt.prefix_ids, ids, captured=True) in engine.store for ids in prompt.chunk_ids]
    assert sum(captured) >= 2  # groups of two 15-token chunks: the second of each has its captured entry
    with pytest.raises(ConfigError, match="group_tokens must be a whole number"):
        engine.precompute(chunks, prefix=PREFIX, group_tokens=-1)


def test_one_progress_bar_counts_the_tokens_prefilled(tiny_tokenizer, capsys):
    engine = engine_with("llama", tiny_tokenizer, miss_policy="blend")
    groups = [[random_words(90 + i, 10), random_words(95 + i, 12)] for i in range(2)]
    engine.precompute_groups(groups, prefix=PREFIX, show_progress=True)
    bars = capsys.readouterr().err.replace("\r", "\n")
    prompts = [engine.build_prompt(g, prefix=PREFIX, suffix="x") for g in groups]
    alone = sum(len(p.chunk_ids[1]) for p in prompts)  # the later chunks' isolated entries
    full = sum(len(p.prefix_ids) + sum(map(len, p.chunk_ids)) + 1 for p in prompts)  # a group's prompt, one token after
    assert "prefilling chunk groups" not in bars and "precomputing chunk KV" in bars
    assert f"100%|██████████| {alone + full:.1f}/{alone + full:.1f}" in bars and "group 2 of 2" in bars
    engine.precompute_groups(groups, prefix=PREFIX, show_progress=True)  # all stored: nothing to count
    again = capsys.readouterr().err
    assert "0 chunks alone, then 0 groups" in again and "group 1" not in again
