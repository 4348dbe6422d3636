"""Contextual chunk KV: which text a chunk's KV is prefilled after, beside the shared prefix.

A chunk prefilled alone after the prefix has KV that never attended to the other chunks of a prompt; the blend
recomputes some tokens to restore that. A chunk prefilled after text like what precedes it in real prompts (its
nearest neighbours in the corpus) starts closer to a full prefill, so full KV reuse and the blend drift less.
Only the chunk's own KV is kept, so a contextual entry costs the same storage as an isolated one; the price is
the context's tokens, prefilled once per chunk at precompute time. The first chunk of a prompt follows the prefix
alone, so it reads the chunk's isolated entry, which `precompute` stores beside it; so does a chunk whose context
holds a chunk placed after it in the prompt (the rules are in `placement`).

`ChunkContexts` records, per chunk (by its tokens), the token ids of the text its entry is built after. The
context's digest is part of the entry's store key (`store.chunk_key`), so an entry always says which context
built it: after a re-index gives a chunk other neighbours, it is a new entry, never a silent mix with the old.
A chunk with no recorded context keeps the isolated entry (empty context, the key it always had).
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from array import array
from collections.abc import Sequence
from typing import Any

from ...errors import ConfigError, PromptError
from ..request.prompt import PromptTemplate, tokenize_chunks, tokenize_prefix
from ..request.request import check_chunks, check_encodable, check_part, check_text
from ..request.token_cache import TokenCache


def context_digest(context_ids: Sequence[int]) -> str:
    """sha256 of a context's token ids ("" for no context: the isolated entry)."""
    if not context_ids:
        return ""
    h = hashlib.sha256(struct.pack("<Q", len(context_ids)))
    h.update(array("q", context_ids).tobytes())
    return h.hexdigest()


def _chunk_id(ids: Sequence[int]) -> bytes:
    return hashlib.sha256(array("q", ids).tobytes()).digest()


def copies_before(chunk_ids: Sequence[Sequence[int]]) -> list[tuple[tuple[int, ...], ...]]:
    """Per position of a prompt's (or a group's) chunks, the distinct chunks before it that are near copies of it
    (`retrieval.overlap.near_copy_ids`: overlapping windows of one text), in prompt order. A captured entry is
    keyed by these (`copies_digest`): its KV has read them, and a prompt that does not show them before the chunk
    reads it as a repeat that is not there (a MuSiQue passage cached after two windows of itself went several
    nats from full recompute; research/README.md, "Near copies in a chunk's context")."""
    from ...retrieval.overlap import NEAR_COPY_SHARE, near_copy_ids, token_shingles

    ids = [tuple(c) for c in chunk_ids]
    out: list[tuple[tuple[int, ...], ...]] = []
    seen: set[int] = set()  # the shingles of every chunk before
    fewest = 0  # the fewest shingles a chunk before has
    for j, c in enumerate(ids):
        mine = token_shingles(c)
        found: dict[tuple[int, ...], None] = {}
        # A chunk before shares no more shingles with this one than all of them together do, and needs at least
        # NEAR_COPY_SHARE of the smaller set's: most prompts, which hold no near copies, are settled by one
        # intersection per chunk instead of one per pair of chunks.
        if j and len(mine & seen) >= NEAR_COPY_SHARE * max(min(len(mine), fewest), 1):
            found = dict.fromkeys(b for b in ids[:j] if b != c and near_copy_ids(c, b))
        out.append(tuple(found))
        seen |= mine
        fewest = len(mine) if j == 0 else min(fewest, len(mine))
    return out


COPY_SUBSETS = 3  # near copies shown before a chunk up to which every subset of them is looked for


def copy_sets(copies: Sequence[Sequence[int]]) -> list[tuple[Sequence[int], ...]]:
    """The sets of near copies whose captured entries a chunk may read, best first: all of `copies`, then smaller
    subsets (each alone past `COPY_SUBSETS`); none for no copies."""
    n = len(copies)
    if n == 0:
        return []
    if n > COPY_SUBSETS:
        return [tuple(copies), *((c,) for c in copies)]
    return [tuple(s) for size in range(n, 0, -1) for s in itertools.combinations(copies, size)]


def copies_digest(copies: Sequence[Sequence[int]]) -> str:
    """A digest of a set of chunks (order does not count): the near copies a captured entry was cached after."""
    h = hashlib.sha256()
    for cid in sorted({_chunk_id(c) for c in copies}):
        h.update(cid)
    return h.hexdigest()


class ChunkContexts:
    """Per chunk, the context its KV entry is prefilled after.

    Contexts are made of parts (the neighbours' token ids), each held once however many chunks it precedes, so
    a corpus of N chunks with n neighbours each costs N chunks' tokens and N small tuples, not N x n copies.
    """

    def __init__(self) -> None:
        self._parts: dict[bytes, array] = {}  # part id -> token ids
        self._of: dict[bytes, tuple[str, tuple[bytes, ...]]] = {}  # chunk id -> (digest, part ids)

    def __len__(self) -> int:
        """How many chunks have a recorded context."""
        return len(self._of)

    def assign(self, chunk_ids: Sequence[int], parts: Sequence[Sequence[int]]) -> None:
        """Record that `chunk_ids` is prefilled after `parts` laid end to end (nearest neighbour last).
        No parts (or only empty ones) records the isolated entry."""
        parts = [p for p in parts if len(p)]
        if any(tuple(p) == tuple(chunk_ids) for p in parts):
            raise ConfigError("a chunk cannot be its own context; leave it out of its neighbours")
        key = _chunk_id(chunk_ids)
        if not parts:
            self._of.pop(key, None)
            return
        part_ids = []
        for p in parts:
            pid = _chunk_id(p)
            self._parts.setdefault(pid, array("q", p))
            part_ids.append(pid)
        self._of[key] = (context_digest(self._join(part_ids)), tuple(part_ids))
        self._drop_unused_parts()

    def digest(self, chunk_ids: Sequence[int]) -> str:
        """The digest of the chunk's context ("" when it has none: the isolated entry)."""
        found = self._of.get(_chunk_id(chunk_ids))
        return "" if found is None else found[0]

    def tokens(self, chunk_ids: Sequence[int]) -> tuple[int, ...]:
        """The token ids the chunk is prefilled after (after the prefix); () when it has none."""
        found = self._of.get(_chunk_id(chunk_ids))
        return () if found is None else tuple(self._join(found[1]))

    def holds_later(self, chunk_ids: Sequence[Sequence[int]]) -> list[bool]:
        """Per position of a prompt's chunks, whether the context of the chunk there holds a chunk placed after it
        (each chunk's tokens hashed once)."""
        if not self._of:
            return [False] * len(chunk_ids)
        ids = [_chunk_id(c) for c in chunk_ids]
        out = []
        for j, cid in enumerate(ids):
            found = self._of.get(cid)
            out.append(found is not None and any(later in found[1] for later in ids[j + 1 :]))
        return out

    def clear(self) -> None:
        """Forget every context: every chunk goes back to its isolated entry."""
        self._parts.clear()
        self._of.clear()

    def _join(self, part_ids: Sequence[bytes]) -> array:
        out = array("q")
        for pid in part_ids:
            out.extend(self._parts[pid])
        return out

    def _drop_unused_parts(self) -> None:
        if len(self._parts) <= 2 * max(len(self._of), 1) + 16:
            return
        used = {pid for _, pids in self._of.values() for pid in pids}
        for pid in [p for p in self._parts if p not in used]:
            del self._parts[pid]


KEEP = "keep"  # `context=` value: the contexts recorded already (`set_chunk_context`), isolated where none
NEIGHBOURS_GONE = (
    "context='neighbours' left the product: grouped precompute (the default) caches each chunk after similar chunks; "
    "to cache each chunk after texts of your choosing, pass one list of texts per chunk"
)
ContextArg = str | Sequence[Sequence[str]] | None


def context_parts(chunks: Sequence[str], context: ContextArg) -> list[list[str]] | None:
    """Per chunk, the texts its KV is prefilled after, in order (the one placed last is nearest); None: change
    nothing.

    `context`: "keep" (what is recorded), None (no context: isolated entries), or one list of texts per chunk,
    placed before it in the order given.
    """
    if context is None:
        return [[] for _ in chunks]
    if isinstance(context, str):
        if context == KEEP:
            return None
        if context == "neighbours":
            raise ConfigError(NEIGHBOURS_GONE)
        raise ConfigError(f"context must be {KEEP!r}, None, or one list of texts per chunk; got {context!r}")
    parts = list(context)
    if len(parts) != len(chunks) or any(isinstance(p, str) for p in parts):
        raise ConfigError(
            f"context must give one list of texts per chunk ({len(chunks)} lists), e.g. [[neighbour, ...], ...]; "
            f"got {len(parts)} items"
        )
    for texts in parts:
        for t in texts:
            if not isinstance(t, str) or not t.strip():
                raise ConfigError(f"a context text must be non-empty text, got {t!r}")
    return [list(p) for p in parts]


def corpus_ids(
    tokenizer: Any, template: PromptTemplate, chunks: Sequence[str], question: str | None, prefix: str | None,
    separator: str, max_tokens: int, cache: TokenCache | None = None,
) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:  # fmt: skip
    """A corpus checked and tokenized as requests will see it (through `cache`, when given, so that they find the
    ids): (prefix ids, each chunk's ids). PromptError for a chunk that cannot fit the model after the prefix, before
    anything is computed."""
    check_chunks(chunks)
    check_text("question", question, optional=True)
    check_part("prefix", prefix)
    check_encodable(chunks, question=question, prefix=prefix)
    if prefix is None:
        prefix, _ = template.render_parts(tokenizer, question or "?")
    prefix_ids = tuple(tokenize_prefix(tokenizer, prefix))
    chunk_ids = tokenize_chunks(tokenizer, chunks, separator, cache)
    for i, ids in enumerate(chunk_ids):  # no request could ever use such a chunk
        if len(prefix_ids) + len(ids) >= max_tokens:
            raise PromptError(f"chunk {i} has {len(ids)} tokens: after the {len(prefix_ids)}-token prefix it does "
                              f"not fit the model's limit of {max_tokens}; split it smaller")  # fmt: skip
    return prefix_ids, chunk_ids


def assign_contexts(
    contexts: ChunkContexts, tokenizer: Any, chunk_ids: Sequence[Sequence[int]], parts: list[list[str]] | None,
    separator: str,
) -> None:  # fmt: skip
    """Record each chunk's context texts (tokenized as chunks are); `parts` None ("keep") changes nothing."""
    if parts is None:
        return
    for ids, texts in zip(chunk_ids, parts, strict=True):
        contexts.assign(ids, tokenize_chunks(tokenizer, texts, separator) if texts else ())
