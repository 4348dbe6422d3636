"""Which stored entry each chunk of a prompt reads (`engine.chunks.placement`): the plan as a pure function of the
prompt, the entries the store records, the capture policy, near copies and recorded contexts. No model runs."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag.engine.chunks.context import ChunkContexts
from cacheblend_rag.engine.chunks.placement import EntryKeys, missing_chunks, place_chunks, to_capture

PREFIX = (1, 2, 3)
A = tuple(range(100, 140))
B = tuple(range(200, 240))
C = tuple(range(300, 340))
A2 = A[20:] + tuple(range(400, 420))  # an overlapping window of A's text: a near copy of A


def entry_keys(contexts: ChunkContexts | None = None, max_positions: int = 4096) -> EntryKeys:
    return EntryKeys("model-fingerprint", torch.float32, contexts or ChunkContexts(), max_positions)


def plan(keys: EntryKeys, chunks, stored=(), policy="all"):
    return place_chunks(keys, PREFIX, chunks, set(stored).__contains__, policy)


def capture_positions(placed) -> list[int]:
    return [p.position for p in to_capture(placed)]


@pytest.mark.parametrize("policy", ["exact", "all"])
def test_the_first_chunk_reads_only_its_isolated_entry(policy):
    keys = entry_keys()
    first = plan(keys, [A, B], policy=policy)[0]
    assert first.keys == (keys.isolated(PREFIX, A),)
    assert first.isolated and first.exact and first.first


def test_a_later_chunk_reads_its_captured_entry_then_its_own_under_all():
    keys = entry_keys()
    later = plan(keys, [A, B])[1]
    assert later.keys == (keys.captured(PREFIX, B), keys.own(PREFIX, B))
    assert not later.isolated and later.exact  # the captured entry is what this prompt computes for B


def test_a_later_chunk_reads_its_own_entry_under_exact_and_is_not_exact_without_a_context():
    keys = entry_keys()
    later = plan(keys, [A, B], policy="exact")[1]
    assert later.keys == (keys.own(PREFIX, B),)
    assert not later.exact  # its own entry was prefilled after the prefix alone, here it follows A


def test_without_a_context_a_chunks_own_entry_is_its_isolated_entry():
    keys = entry_keys()
    assert keys.own(PREFIX, B) == keys.isolated(PREFIX, B)
    assert keys.captured(PREFIX, B) not in (keys.own(PREFIX, B), keys.isolated((), B))


def test_near_copies_shown_before_a_chunk_put_the_entries_cached_after_them_first():
    keys = entry_keys()
    placed = plan(keys, [A, C, A2])[2]
    assert placed.keys == (keys.captured(PREFIX, A2, [A]), keys.captured(PREFIX, A2), keys.own(PREFIX, A2))
    assert plan(keys, [C, B, A2])[2].keys[0] == keys.captured(PREFIX, A2)  # no copy shown: the plain one first


def test_the_digest_of_near_copies_ignores_their_order():
    keys = entry_keys()
    assert keys.captured(PREFIX, C, [A, B]) == keys.captured(PREFIX, C, [B, A]) != keys.captured(PREFIX, C, [A])


def test_found_is_the_first_stored_key_and_a_miss_fills_the_last():
    keys = entry_keys()
    own, captured = keys.own(PREFIX, B), keys.captured(PREFIX, B)
    assert plan(keys, [A, B], stored=[own, captured])[1].found == captured
    only_own = plan(keys, [A, B], stored=[own])[1]
    assert only_own.found == own and not only_own.reads_captured
    assert plan(keys, [A, B], stored=[captured])[1].reads_captured
    miss = plan(keys, [A, B])[1]
    assert miss.found is None and miss.fill_key == own


def test_the_store_is_asked_in_order_until_an_entry_is_found():
    keys = entry_keys()
    asked = []

    def stored(key):
        asked.append(key)
        return key == keys.captured(PREFIX, B)

    place_chunks(keys, PREFIX, [A, B], stored, "all")
    assert asked == [keys.isolated(PREFIX, A), keys.captured(PREFIX, B)]


def test_a_full_prefill_captures_each_chunks_best_entry_once_unless_stored():
    keys = entry_keys()
    placed = plan(keys, [A, B, A])
    assert capture_positions(placed) == [0, 1]  # A's second place reads a captured entry, but A is captured once
    stored = plan(keys, [A, B], stored=[keys.isolated(PREFIX, A), keys.own(PREFIX, B)])
    assert capture_positions(stored) == [1]  # B's own entry is stored, its captured one is not
    assert capture_positions(plan(keys, [A, B], policy="exact")) == [0]


def test_missing_chunks_are_distinct_and_in_prompt_order():
    keys = entry_keys()
    placed = plan(keys, [B, A, B, C], stored=[keys.isolated(PREFIX, A)])
    assert missing_chunks(placed) == [B, C]  # A, second here, reads its own entry: the isolated one (no context)
    placed = plan(keys, [A, B], stored=[keys.isolated(PREFIX, A)])
    assert missing_chunks(placed) == [B]


def test_a_chunk_whose_context_holds_a_chunk_placed_after_it_reads_its_isolated_entry():
    contexts = ChunkContexts()
    contexts.assign(B, [C])  # B's own entry is prefilled after C
    keys = entry_keys(contexts)
    after_c = plan(keys, [A, C, B], policy="exact")
    assert after_c[2].keys == (keys.own(PREFIX, B),) and not after_c[2].isolated
    assert after_c[2].exact is False  # B follows A and C here, its context is C alone
    before_c = plan(keys, [A, B, C], policy="exact")
    assert before_c[1].isolated and before_c[1].keys == (keys.isolated(PREFIX, B),)
    assert not before_c[1].exact  # the isolated entry of a chunk after A is not what the prompt computes


def test_a_later_chunk_whose_context_is_exactly_the_chunks_before_it_is_captured_under_exact():
    contexts = ChunkContexts()
    contexts.assign(B, [A])
    keys = entry_keys(contexts)
    placed = plan(keys, [A, B], policy="exact")
    assert placed[1].exact and capture_positions(placed) == [0, 1]


def test_a_context_too_long_for_the_model_is_cut_from_its_start():
    contexts = ChunkContexts()
    contexts.assign(B, [A, C])
    keys = entry_keys(contexts, max_positions=len(PREFIX) + len(B) + 10)
    assert keys.context_of(PREFIX, B) == C[-10:]


def test_an_unknown_capture_policy_is_refused():
    with pytest.raises(ValueError, match="capture policy"):
        plan(entry_keys(), [A], policy="some")
