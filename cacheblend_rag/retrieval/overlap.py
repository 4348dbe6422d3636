"""Chunks that repeat each other's text: never cache one after the other.

Corpora are often split with overlapping windows (a text splitter's `chunk_overlap`, or data sets cut into sliding
windows), so a chunk's most similar chunk is often a window that holds much of the same text. A chunk's KV
prefilled after such a near copy is computed while the model reads its own words a second time: on the fidelity
benchmark one MuSiQue passage cached after two windows holding most of it took full KV reuse from 0.35 to 4.8
nats from full recompute (research/README.md, "Near copies in a chunk's context"). Contextual chunk KV (the
neighbours a chunk is prefilled after, the groups of grouped precompute) therefore leaves near copies apart.

Two texts are near copies when they share at least `NEAR_COPY_SHARE` of the word 8-grams of the shorter one; two
chunks of token ids, when they share that share of the shorter one's token 8-grams (`near_copy_ids`, what the
engine checks a prompt's chunks with: a captured entry names the near copies it was cached after, and a prompt
reads it only where it shows them before the chunk too).
"""

from __future__ import annotations

import functools
import re

SHINGLE_TOKENS = 8  # tokens per shingle of a chunk's ids
SHINGLE_WORDS = 8  # words per shingle: runs this long are rarely shared by texts that do not copy each other
NEAR_COPY_SHARE = 0.1  # share of the shorter text's shingles held by the other text that makes them near copies

_WORD = re.compile(r"\w+")


@functools.lru_cache(maxsize=4096)  # a set of a 2,000-character chunk is ~25 KB: ~100 MB at most
def shingles(text: str) -> frozenset[int]:
    """The hashes of `text`'s runs of `SHINGLE_WORDS` words (lower-cased; a shorter text is one run)."""
    words = _WORD.findall(text.lower())
    return frozenset(hash(tuple(words[i : i + SHINGLE_WORDS])) for i in range(max(len(words) - SHINGLE_WORDS + 1, 1)))


def near_copies(a: str, b: str) -> bool:
    """Whether `a` and `b` share at least `NEAR_COPY_SHARE` of the shorter one's shingles (equal texts do)."""
    return a == b or _share_enough(shingles(a), shingles(b))


@functools.lru_cache(maxsize=1024)  # a set of a 512-token chunk is ~30 KB: ~30 MB at most
def token_shingles(ids: tuple[int, ...]) -> frozenset[int]:
    """The hashes of the runs of `SHINGLE_TOKENS` token ids of a chunk (a shorter chunk is one run)."""
    n = SHINGLE_TOKENS
    return frozenset(hash(ids[i : i + n]) for i in range(max(len(ids) - n + 1, 1)))


def near_copy_ids(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether chunks `a` and `b` (token ids) share at least `NEAR_COPY_SHARE` of the shorter one's token
    shingles (equal chunks do)."""
    return a == b or _share_enough(token_shingles(a), token_shingles(b))


def _share_enough(sa: frozenset[int], sb: frozenset[int]) -> bool:
    """Whether one set of shingles holds at least `NEAR_COPY_SHARE` of the smaller one's."""
    if len(sa) > len(sb):
        sa, sb = sb, sa
    return len(sa & sb) >= NEAR_COPY_SHARE * max(len(sa), 1)
