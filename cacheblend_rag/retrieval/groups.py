"""A corpus laid out in groups of similar chunks: one full prefill per group gives every chunk KV computed after text
like what precedes it in real prompts, at the cost of the chunks' own tokens (grouped precompute).

The chunks are chained so that each follows the most similar chunk not placed yet (cosine similarity of the
packaged all-MiniLM-L6-v2, or the caller's vectors; FAISS inner product over each chunk's nearest `search` chunks,
and the next chunk in corpus order when those are all placed), and the chain is cut into groups of at most
`group_tokens` tokens. A chunk never follows a near copy of itself in its group (`overlap.near_copies`: overlapping
windows of one text), which it would read as a repeat of its own words. A chunk's KV from its group's prefill has
read the chunks before it there: on the fidelity benchmark, KV captured among passages of earlier requests was as
close to full recompute as KV prefilled after each chunk's nearest neighbours, which costs that context's tokens
again for every chunk (research/README.md, "Contextual chunk KV after neighbours").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.retrieval.embeddings import Embedder, embed_texts, load_embedder
from cacheblend_rag.retrieval.neighbours import nearest_neighbours
from cacheblend_rag.retrieval.overlap import near_copies


def similarity_chain(vectors: np.ndarray, texts: Sequence[str], *, search: int = 32) -> list[int]:
    """An order of the corpus's rows in which each row follows the most similar row not placed before it (among
    its `search` nearest), starting from row 0; a row whose `search` nearest are all placed is followed by the
    first row not placed yet in corpus order. Copies and near copies of a text are never each other's neighbours."""
    n = len(texts)
    if len(vectors) != n:
        raise ConfigError(f"one vector per chunk is needed: {len(vectors)} vectors for {n} chunks")
    if n == 0:
        return []
    found = nearest_neighbours(vectors, vectors, min(search, max(n - 1, 0)), query_texts=texts, pool_texts=texts)
    placed = np.zeros(n, dtype=bool)
    order = [0]
    placed[0] = True
    scan = 0  # every row before it is placed
    for _ in range(n - 1):
        nxt = next((j for j in found[order[-1]] if not placed[j]), None)
        if nxt is None:
            while placed[scan]:
                scan += 1
            nxt = scan
        placed[nxt] = True
        order.append(nxt)
    return order


def cut_groups(
    order: Sequence[int], lengths: Sequence[int], group_tokens: int, *, texts: Sequence[str] | None = None
) -> list[list[int]]:
    """`order` cut into consecutive groups of at most `group_tokens` tokens (`lengths` per row); a row longer than
    that is a group of its own. With `texts` (per row), a row that is a near copy of a row in the group so far
    starts a new group."""
    if isinstance(group_tokens, bool) or not isinstance(group_tokens, int) or group_tokens < 1:
        raise ConfigError(f"group_tokens must be a whole number of tokens >= 1, got {group_tokens!r}")
    groups: list[list[int]] = []
    size = 0
    for i in order:
        if (
            groups
            and size + lengths[i] <= group_tokens
            and not (texts is not None and any(near_copies(texts[i], texts[j]) for j in groups[-1]))
        ):
            groups[-1].append(i)
            size += lengths[i]
        else:
            groups.append([i])
            size = lengths[i]
    return groups


def similarity_groups(
    vectors: np.ndarray, texts: Sequence[str], lengths: Sequence[int], group_tokens: int
) -> list[list[int]]:
    """The corpus's rows in groups of similar chunks, each of at most `group_tokens` tokens (a longer chunk is
    alone), every row in exactly one group, each group in chain order (`similarity_chain`), no row after a near
    copy of itself."""
    if len(lengths) != len(texts):
        raise ConfigError(f"one length per chunk is needed: {len(lengths)} lengths for {len(texts)} chunks")
    return cut_groups(similarity_chain(vectors, texts), lengths, group_tokens, texts=texts)


def text_groups(
    texts: Sequence[str], lengths: Sequence[int], group_tokens: int, *, embedder: Embedder | None = None
) -> list[list[int]]:
    """`similarity_groups` of plain texts, by the embeddings of `embedder` (default: the packaged
    all-MiniLM-L6-v2)."""
    if not texts:
        return []
    vectors = embed_texts(embedder or load_embedder(), list(texts), batch_size=32, show_progress=False)
    return similarity_groups(vectors, texts, lengths, group_tokens)
