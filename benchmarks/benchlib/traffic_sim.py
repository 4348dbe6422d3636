"""The traffic benchmark's simulated runs: every stream, seed, budget and eviction policy through the store
simulator (`cacheblend_rag.sizing`), as JSON rows of hit rate and speed-up over the first N requests."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from cacheblend_rag.sizing import (
    CostModel,
    KVShape,
    PromptLengths,
    StoreSimulator,
    run_stream,
    stream_order,
    summarize,
)

WINDOWS = (25, 50, 100, 200, 500, 1000, 2000, 5000, None)  # the warm-up curve's request counts; None: all


def stream_requests(
    stream: str, seed: int, topics: Sequence[int], retrieved: Sequence[Sequence[int]], lengths: PromptLengths,
    length: int | None = None,
) -> tuple[list[int], list[list[int]], PromptLengths]:  # fmt: skip
    """(question indexes in arrival order, their retrieved chunks, the prompt lengths in that order)."""
    order = stream_order(topics, stream, seed=seed, length=length)
    ordered = PromptLengths(lengths.prefix, lengths.chunks, tuple(lengths.suffixes[i] for i in order))
    return order, [list(retrieved[i]) for i in order], ordered


def corpus_bytes(lengths: PromptLengths, shape: KVShape) -> int:
    """The corpus's KV, one entry per chunk."""
    return sum(round(shape.bytes_per_token * t) for t in lengths.chunks)


def budget_bytes(share: float | None, corpus: int) -> int:
    return 2**62 if share is None else int(share * corpus)


def simulate_grid(
    streams: Iterable[str], seeds: Sequence[int], shares: Sequence[float | None], policies: Sequence[str],
    topics: Sequence[int], retrieved: Sequence[Sequence[int]], lengths: PromptLengths, shape: KVShape,
    costs: CostModel, length: int | None = None, windows: Sequence[int | None] = WINDOWS,
) -> list[dict[str, Any]]:  # fmt: skip
    """One row per (stream, seed, budget share, policy, window)."""
    corpus = corpus_bytes(lengths, shape)
    rows = []
    for stream in streams:
        for seed in seeds if stream != "clustered" else seeds[:1]:  # the file's order has no seed
            _, requests, ordered = stream_requests(stream, seed, topics, retrieved, lengths, length)
            for share in shares:
                for policy in policies:
                    budget = budget_bytes(share, corpus)
                    sim = StoreSimulator(ordered.chunks, prefix_tokens=ordered.prefix,
                                         bytes_per_token=shape.bytes_per_token, budget_bytes=budget,
                                         num_layers=shape.num_layers, costs=costs, eviction=policy)  # fmt: skip
                    results = run_stream(sim, requests, ordered.suffixes)
                    for window in windows:
                        if window is not None and window > len(results):
                            continue
                        s = summarize(results, window)
                        rows.append(dict(stream=stream, seed=seed, share=share, policy=policy, window=window,
                                         requests=s.requests, hit_rate=s.hit_rate, mean_ttft_s=s.mean_ttft_s,
                                         mean_full_s=s.mean_full_s, speedup=s.speedup))  # fmt: skip
    return rows
