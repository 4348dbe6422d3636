"""The throughput benchmark's workload: the paper's "MuSiQue / 2WikiMQA extended" sets (§7.1).

The contexts of the first N cases of a data set, each split into ~`chunk_tokens`-token chunks by the project's
chunker, make one chunk database, indexed with FAISS and the packaged all-MiniLM-L6-v2 (cosine similarity of unit
vectors: the same ranking as the paper's L2 distance). Every question is asked `repeats` times, each time with its
top-k chunks in a fresh random order. The paper asked GPT-4 for three paraphrases of each question; there is no such
API here, so the question itself is asked again (a paraphrase retrieves about the same chunks; a repeat retrieves
exactly the same). The request sequence is shuffled so the repeats are spread out, and the first `warmup` requests
are served but left out of the statistics: the store starts empty (the paper skips its first 1K of 6K queries).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.evaluation.datasets import Dataset, DatasetError, TaskSpec

__all__ = ["Workload", "WorkloadRequest", "build_workload"]


@dataclass(frozen=True)
class WorkloadRequest:
    index: int  # position in the served sequence
    case_id: str
    repeat: int  # 0 for the question's first asking, then 1, 2, ...
    question: str
    chunks: tuple[int, ...]  # indices into Workload.chunks, in prompt order


@dataclass(frozen=True)
class Workload:
    """One "extended" set: the chunk database and the request sequence over it."""

    spec: TaskSpec  # the data set's prompt
    chunks: tuple[str, ...]  # the chunk database
    requests: tuple[WorkloadRequest, ...]  # in serving order
    warmup: int  # the first `warmup` requests fill the store and are left out of the statistics
    cases: int  # questions the requests were made from

    def __post_init__(self) -> None:
        if not 0 <= self.warmup < len(self.requests):
            raise ConfigError(
                f"warmup of {self.warmup} requests leaves none of the {len(self.requests)} to measure; "
                "lower warmup or raise the number of cases or repeats"
            )

    def texts(self, request: WorkloadRequest) -> list[str]:
        return [self.chunks[i] for i in request.chunks]


def _distinct_orders(items: Sequence[int], count: int, rng: random.Random) -> list[tuple[int, ...]]:
    """`count` random orders of `items`, all different while there are enough orders to go round."""
    total = math.factorial(len(items))
    orders: list[tuple[int, ...]] = []
    for _ in range(count):
        order = list(items)
        rng.shuffle(order)
        while tuple(order) in orders and len(set(orders)) < total:
            rng.shuffle(order)
        orders.append(tuple(order))
    return orders


def build_workload(
    dataset: Dataset,
    tokenizer: Any,
    *,
    chunk_tokens: int = 512,
    top_k: int = 6,
    repeats: int = 4,
    warmup: int | None = None,
    seed: int = 0,
    embedder: Any = None,
    show_progress: bool = True,
) -> Workload:
    """The data set's "extended" set: chunk database, FAISS retrieval, repeated questions, shuffled order.

    Each case's passages, joined by blank lines, are one document; the chunker cuts it at paragraph, then
    sentence boundaries into chunks of at most `chunk_tokens` tokens of `tokenizer` (the LLM's). A chunk text
    that occurs in two contexts is one chunk. `embedder` defaults to the packaged all-MiniLM-L6-v2.
    """
    from cacheblend_rag.retrieval import Chunk, ChunkIndex, Document, load_embedder, split_documents

    if not dataset.cases:
        raise DatasetError(f"data set {dataset.spec.name!r} has no cases; check the data file and --limit")
    if repeats < 1 or top_k < 1:
        raise ConfigError(f"repeats and top_k must be >= 1, got repeats={repeats}, top_k={top_k}")
    documents = [Document("\n\n".join(case.chunks), source=case.id) for case in dataset.cases]
    first_seen: dict[str, Chunk] = {}
    for chunk in split_documents(documents, tokenizer, chunk_tokens=chunk_tokens):
        first_seen.setdefault(chunk.text, chunk)
    pieces = list(first_seen.values())
    index = ChunkIndex.build(pieces, embedder if embedder is not None else load_embedder(), show_progress=show_progress)
    position = {c.text: i for i, c in enumerate(pieces)}

    rng = random.Random(seed)
    asked: list[tuple[str, str, tuple[int, ...]]] = []  # (case id, question, chunk order)
    for case in dataset.cases:
        hits = [position[h.chunk.text] for h in index.search(case.question, k=top_k)]
        asked.extend((case.id, case.question, order) for order in _distinct_orders(hits, repeats, rng))
    rng.shuffle(asked)
    seen: dict[str, int] = {}  # askings so far per question: a request's repeat number is its place among them
    requests = []
    for i, (case_id, question, order) in enumerate(asked):
        repeat = seen.get(case_id, 0)
        seen[case_id] = repeat + 1
        requests.append(WorkloadRequest(i, case_id, repeat, question, order))
    n = len(requests)
    return Workload(
        spec=dataset.spec,
        chunks=tuple(c.text for c in pieces),
        requests=tuple(requests),
        warmup=n // 6 if warmup is None else warmup,
        cases=len(dataset.cases),
    )
