"""Each chunk's nearest neighbours in a corpus: the context its KV is prefilled after (contextual chunk KV).

Neighbours are searched by cosine similarity of the retriever's own embeddings (the vectors a `ChunkIndex` holds,
or the packaged all-MiniLM-L6-v2 for plain texts) with a FAISS inner-product index. A chunk is never its own
neighbour, nor is any chunk of the same text or a near copy of it (`overlap.near_copies`: a window holding much of
the same text, which the chunk would read as a repeat of itself). The neighbours come back nearest first;
`neighbour_context` lays them out nearest last, so the most similar text sits right before the chunk, as the top
retrieved chunks would.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.retrieval.embeddings import Embedder, embed_texts, load_embedder
from cacheblend_rag.retrieval.faiss_file import import_faiss
from cacheblend_rag.retrieval.overlap import near_copies


def check_neighbour_count(n: object, what: str = "neighbours") -> int:
    """`n` as a count of neighbours (0 turns contextual KV off); ConfigError otherwise."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"{what} must be a whole number >= 0 (0 turns contextual chunk KV off), got {n!r}")
    return n


def nearest_neighbours(
    queries: np.ndarray, pool: np.ndarray, n: int, *, query_texts: Sequence[str], pool_texts: Sequence[str]
) -> list[list[int]]:
    """For each query row, the indexes of its `n` most similar `pool` rows (unit vectors), most similar first,
    leaving out every pool row whose text equals the query's (the chunk itself and its copies) or is a near copy of
    it (`overlap.near_copies`); among the nearest `4 n` rows and copies, so a chunk may get fewer than `n`."""
    check_neighbour_count(n)
    if len(queries) != len(query_texts) or len(pool) != len(pool_texts):
        raise ConfigError("one text per vector is needed for the neighbour search")
    if n == 0 or len(pool) == 0:
        return [[] for _ in range(len(queries))]
    faiss = import_faiss()
    index = faiss.IndexFlatIP(pool.shape[1])
    index.add(np.ascontiguousarray(pool, dtype=np.float32))
    copies: dict[str, int] = {}
    for t in pool_texts:
        copies[t] = copies.get(t, 0) + 1
    out = []
    for start in range(0, len(queries), 1024):
        block = np.ascontiguousarray(queries[start : start + 1024], dtype=np.float32)
        k = min(len(pool), 4 * n + max(copies.get(t, 0) for t in query_texts[start : start + 1024]))
        _, ids = index.search(block, k)
        for row, text in zip(ids, query_texts[start : start + 1024], strict=True):
            out.append(_nearest_apart(row, text, pool_texts, n))
    return out


def _nearest_apart(row: Sequence[int], text: str, texts: Sequence[str], n: int) -> list[int]:
    """The first `n` rows of `row` (nearest first) whose texts are neither near copies of `text` nor repeats of a
    text taken before."""
    seen: set[str] = set()
    out: list[int] = []
    for j in row:
        if len(out) == n:
            break
        if j < 0 or texts[j] in seen or near_copies(texts[j], text):
            continue
        seen.add(texts[j])
        out.append(int(j))
    return out


def neighbour_texts(
    texts: Sequence[str],
    n: int,
    *,
    pool: Sequence[str] | None = None,
    embedder: Embedder | None = None,
    batch_size: int = 32,
) -> list[list[str]]:
    """For each text, the `n` most similar other texts of `pool` (default: `texts` themselves), most similar
    first, by the embeddings of `embedder` (default: the packaged all-MiniLM-L6-v2)."""
    check_neighbour_count(n)
    pool = list(texts if pool is None else pool)
    if n == 0 or not texts or not pool:
        return [[] for _ in texts]
    embedder = embedder or load_embedder()
    unique = list(dict.fromkeys([*pool, *texts]))
    vectors = embed_texts(embedder, unique, batch_size=batch_size, show_progress=False)
    row = {t: i for i, t in enumerate(unique)}
    pool_vectors = vectors[[row[t] for t in pool]]
    query_vectors = vectors[[row[t] for t in texts]]
    found = nearest_neighbours(query_vectors, pool_vectors, n, query_texts=list(texts), pool_texts=pool)
    return [[pool[j] for j in ids] for ids in found]


def neighbour_context(neighbours: Sequence[str]) -> list[str]:
    """The order a chunk's neighbours (most similar first) are prefilled in before it: most similar last."""
    return list(reversed(neighbours))
