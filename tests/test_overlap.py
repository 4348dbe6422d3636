"""Near copies (overlapping windows of one text) are never cached one after the other: not as neighbours, not in
one group of grouped precompute."""

from __future__ import annotations

import numpy as np

from cacheblend_rag.retrieval.groups import cut_groups, similarity_groups
from cacheblend_rag.retrieval.neighbours import nearest_neighbours
from cacheblend_rag.retrieval.overlap import near_copies
from cacheblend_rag.testing import random_words

TEXT = random_words(7, 400)
WORDS = TEXT.split()


def window(start: int, length: int = 200) -> str:
    return " ".join(WORDS[start : start + length])


def test_overlapping_windows_are_near_copies_and_unrelated_texts_are_not():
    assert near_copies(window(0), window(0))
    assert near_copies(window(0), window(100))  # half of each is the other's
    assert not near_copies(window(0), window(200))  # adjacent, no shared run
    assert not near_copies(window(0), random_words(8, 200))
    assert near_copies(window(0).upper(), window(50))  # case is not a difference


def test_a_small_overlap_is_not_a_near_copy_but_a_large_one_is():
    # a splitter's usual overlap: 10 of 200 words shared with the next window
    assert not near_copies(window(0), window(190))
    assert near_copies(window(0), window(160))  # 40 of 200 words: about a sixth of the shingles


def test_neighbours_leave_out_near_copies():
    texts = [window(0), window(100), random_words(9, 200), random_words(10, 200)]
    vectors = np.array([[1.0, 0.0], [1.0, 0.0], [0.8, 0.6], [0.6, 0.8]], dtype=np.float32)
    found = nearest_neighbours(vectors, vectors, 2, query_texts=texts, pool_texts=texts)
    assert found[0] == [2, 3] and found[1] == [2, 3]  # each window's nearest is the other: left out
    assert found[2][0] == 3 and found[2][1] in (0, 1)  # one of the two copies, never both


def test_groups_never_place_a_chunk_after_its_near_copy():
    texts = [window(0), window(100), window(200), random_words(11, 200), random_words(12, 200)]
    lengths = [10] * len(texts)
    # a chain of the windows in a row: each overlaps the one before, so each starts a group
    assert cut_groups([0, 1, 2], lengths, 100, texts=texts) == [[0], [1], [2]]
    assert cut_groups([0, 1, 3], lengths, 100, texts=texts) == [[0], [1, 3]]
    assert cut_groups([0, 3, 1], lengths, 100, texts=texts) == [[0, 3], [1]]  # a near copy further back counts
    assert cut_groups([0, 1, 3], lengths, 100) == [[0, 1, 3]]  # without texts: by size alone
    vectors = np.array([[1.0, 0.0], [0.99, 0.14], [0.98, 0.2], [0.0, 1.0], [0.1, 0.99]], dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    for group in similarity_groups(vectors, texts, lengths, 100):
        for a, i in enumerate(group):
            assert not any(near_copies(texts[i], texts[j]) for j in group[:a]), group


def test_a_prompts_near_copies_are_every_pair_that_shares_enough():
    # `copies_before` settles most chunks with one intersection against all the chunks before; it must give what
    # checking every pair gives, on prompts of windows of one text, repeats, short chunks and unrelated ones.
    import random

    from cacheblend_rag.engine.chunks.context import copies_before
    from cacheblend_rag.retrieval.overlap import near_copy_ids

    def every_pair(chunks):
        return [tuple(dict.fromkeys(b for b in chunks[:j] if b != c and near_copy_ids(c, b)))
                for j, c in enumerate(chunks)]  # fmt: skip

    rng = random.Random(0)
    found = 0
    for _ in range(300):
        text = [rng.randrange(30) for _ in range(400)]
        chunks: list[tuple[int, ...]] = []
        for _ in range(rng.randint(1, 8)):
            kind = rng.random()
            if kind < 0.3 and chunks:
                chunks.append(rng.choice(chunks))
            elif kind < 0.6:
                start = rng.randrange(350)
                chunks.append(tuple(text[start : start + rng.randint(1, 60)]))
            else:
                vocab = 30 if rng.random() < 0.5 else 5000
                chunks.append(tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 80))))
        expected = every_pair(chunks)
        assert copies_before(chunks) == expected, chunks
        found += sum(map(len, expected))
    assert found > 50  # the prompts hold near copies to find (62)
