"""Contextual chunk KV in the fidelity benchmark: every method measured again on chunk KV prefilled after each
chunk's nearest neighbours, searched in the data set's whole passage pool.

`fidelity.py --chunk-context neighbours` adds, beside each method on isolated chunk KV (`attention@0.15`), the
same method on contextual KV (`attention@0.15+ctx`), against the same full-recompute reference. The neighbours
of a case's chunk are its `n` most similar passages among every case's passages of the set (all-MiniLM-L6-v2
cosine, the chunk's own text left out), as a user's index over the whole corpus would give them, never the
case's own passages alone. The paired table is `fidelity_codecs.codec_differences` with "ctx" as the variant.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from cacheblend_rag.engine import CacheBlendEngine, TokenizedPrompt
from cacheblend_rag.evaluation.datasets import Case, Dataset, TaskSpec
from cacheblend_rag.retrieval.embeddings import embed_texts, load_embedder
from cacheblend_rag.retrieval.neighbours import nearest_neighbours, neighbour_context

CONTEXT = "ctx"  # the variant name: `attention@0.15+ctx`


class PoolNeighbours:
    """Each passage's nearest neighbours in a data set's pool (every case's passages, duplicates once)."""

    def __init__(self, dataset: Dataset, n: int) -> None:
        self.n = n
        self.pool = list(dict.fromkeys(c for case in dataset.cases for c in case.chunks))
        self.vectors = embed_texts(load_embedder(), self.pool, batch_size=32, show_progress=False)
        self.row = {t: i for i, t in enumerate(self.pool)}

    def context(self, chunks: list[str]) -> list[list[str]]:
        """Per chunk, its neighbours in the order they are prefilled before it (nearest last)."""
        queries = self.vectors[[self.row[c] for c in chunks]]
        found = nearest_neighbours(queries, self.vectors, self.n, query_texts=chunks, pool_texts=self.pool)
        return [neighbour_context([self.pool[j] for j in ids]) for ids in found]


def context_engine(engine: CacheBlendEngine, n: int) -> CacheBlendEngine:
    """An engine on `engine`'s model (shared) with its own store, for contextual entries of `n` neighbours."""
    config = replace(engine.config, context_neighbours=n)
    return CacheBlendEngine(engine.model, engine.tokenizer, config=config, template=engine.template)


class ContextPreparer:
    """Fills a context engine's store with a case's contextual chunk KV (timed), one data set's pool each."""

    def __init__(self, full_datasets: dict[str, Dataset], n: int) -> None:
        self.full = full_datasets  # by set name: every case, whose passages make the pool
        self.n = n
        self._pools: dict[str, PoolNeighbours] = {}

    def __call__(self, engine: CacheBlendEngine, spec: TaskSpec, case: Case, prompt: TokenizedPrompt) -> dict[str, Any]:
        pool = self._pools.get(spec.name)
        if pool is None:
            pool = self._pools[spec.name] = PoolNeighbours(self.full[spec.name], self.n)
        engine.clear_store()
        engine.chunks.contexts.clear()
        chunks = list(case.chunks)
        parts = pool.context(chunks)
        t = time.perf_counter()
        engine.precompute(chunks, case.question, template=spec.template, context=parts)
        precompute_s = time.perf_counter() - t
        context_tokens = [len(engine.chunks.contexts.tokens(ids)) for ids in prompt.chunk_ids]
        return {
            "context_neighbours": self.n,
            "precompute_s": precompute_s,
            "context_tokens": sum(context_tokens) / max(len(context_tokens), 1),  # per chunk, mean
            "chunk_tokens": sum(len(ids) for ids in prompt.chunk_ids) / max(len(prompt.chunk_ids), 1),
        }
