"""The throughput benchmark of the paper's Fig. 14: Poisson arrivals at several request rates against one engine.

Scope: serving the extended workload (`workload`) with each method and queueing it at each rate (`queueing`),
for `benchmarks/throughput.py`; the typed results and their report
(`results.json`, `summary.md`, a figure) are `throughput_report`'s, the settings `throughput_settings`'.

Serving. Chunk KV lives in the engine's memory store, emptied before each method. A chunk that misses is
prefilled during the request and its cost is part of that request's TTFT: there is no untimed warm step, since
reuse across requests is what this benchmark measures. Methods: full recompute, prefix caching (the first
chunk's KV reused), full KV reuse, CacheBlend at a ratio. In `replay` mode (default) each method serves the
sequence once and the queue at every rate is computed from the measured costs; in `live` mode each (method,
rate) is one pass with real arrivals.

Reported per (data set, method, rate): TTFT p50 / p90 / p99 / mean over the measured requests, completed
requests per second (measured requests / (last finish - first arrival)), and the chunk hit rate (prompt chunks
whose KV came from the store / prompt chunks; prefix caching reads only the first chunk, so its rate is at
most 1/k). With a TTFT target: per method, the highest rate whose p90 TTFT meets it.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchlib.methods import PrefillMethod
from benchlib.queueing import (
    Served,
    Timing,
    max_rate_within_slo,
    percentile,
    poisson_arrivals,
    queue_stats,
    replay_queue,
    run_live,
)
from benchlib.throughput_report import (
    MethodRow,
    RateRow,
    RequestRecord,
    ServedPass,
    ThroughputResult,
    WorkloadSummary,
    save_result,
    write_throughput_report,
)
from benchlib.throughput_settings import ThroughputSettings, parse_throughput_methods
from benchlib.workload import Workload, WorkloadRequest, build_workload
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.evaluation.datasets import Dataset, DatasetError

__all__ = ["run_throughput", "serve_request"]


def serve_request(
    engine: Any, workload: Workload, request: WorkloadRequest, method: PrefillMethod, max_new_tokens: int
) -> Served:
    """Answer one request on the engine in the method's mode; chunks missing from the store are prefilled now."""
    t0 = time.perf_counter()
    result = engine.generate(
        workload.texts(request),
        request.question,
        **method.request_options(),
        max_new_tokens=max_new_tokens,
        template=workload.spec.template,
    )
    service = time.perf_counter() - t0
    m = result.metrics
    return Served(
        ttft_s=m.ttft_s,
        service_s=service,
        chunks=len(request.chunks),
        chunks_hit=m.chunks_hit,
        chunks_missed=m.chunks_missed,
        prompt_tokens=m.prompt_tokens,
        recomputed_tokens=m.recomputed_tokens,
        generated_tokens=m.generated_tokens,
    )


def _check_prompts_fit(engine: Any, workload: Workload, max_new_tokens: int) -> None:
    """PromptError before any timing if a question's request would not fit the model (one check per question)."""
    first_asking = {r.case_id: r for r in reversed(workload.requests)}
    for r in first_asking.values():
        prompt = engine.build_prompt(workload.texts(r), r.question, template=workload.spec.template)
        engine.check_length(prompt, max_new_tokens)


def run_throughput(
    engine: Any,
    datasets: Sequence[Dataset],
    methods: str | Sequence[str],
    out_dir: str | os.PathLike[str],
    settings: ThroughputSettings | None = None,
    *,
    embedder: Any = None,
    info: Mapping[str, Any] | None = None,
    show_progress: bool = True,
) -> ThroughputResult:
    """Build each data set's workload, serve it with every method, queue it at every rate; write the report.

    Returns what `results.json` holds (its `to_dict()`): settings (with `info`, e.g. the model's name), the
    workloads, every pass's per-request records, one `RateRow` per (data set, method, rate) and one `MethodRow`
    per (data set, method). `results.json` is rewritten after each pass, so an interrupted run keeps the passes
    it finished.
    The engine's store is replaced by an empty `MemoryStore` before each pass and restored at the end.
    """
    settings = settings or ThroughputSettings()
    prefill_methods = parse_throughput_methods(methods)
    if not datasets:
        raise DatasetError("no data set given; e.g. musique,wikimqa")
    for ds in datasets:
        if ds.spec.task != "qa":
            raise ConfigError(
                f"data set {ds.spec.name!r} is a {ds.spec.task} task; the extended sets are built from the QA data "
                "sets (musique, wikimqa), whose questions retrieve their chunks"
            )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    budget = settings.store_bytes or engine.config.store.memory_budget_bytes
    result = ThroughputResult(settings, budget, dict(info or {}))
    original_store = engine.store
    try:
        for ds in datasets:
            name = ds.spec.name
            workload = build_workload(
                ds, engine.tokenizer, chunk_tokens=settings.chunk_tokens, top_k=settings.top_k,
                repeats=settings.repeats, warmup=settings.warmup, seed=settings.seed, embedder=embedder,
                show_progress=show_progress,
            )  # fmt: skip
            _check_prompts_fit(engine, workload, settings.max_new_tokens)
            sequence = tuple((r.case_id, r.repeat, r.chunks) for r in workload.requests)
            result.workloads.append(
                WorkloadSummary(name, workload.cases, len(workload.chunks), len(workload.requests), workload.warmup,
                                sequence)
            )  # fmt: skip
            live = settings.mode == "live"
            for method in prefill_methods:
                queued = _serve_method(engine, workload, method, settings, budget, name, show_progress)
                for q in queued if live else queued[:1]:  # a replay pass is the same for every rate: stored once
                    records = tuple(
                        RequestRecord(r.index, r.case_id, r.repeat, s, q.timings[r.index] if live else None)
                        for r, s in zip(workload.requests, q.served, strict=True)
                    )
                    result.passes.append(ServedPass(name, method.name, q.rate if live else None, records))
                rows = [
                    RateRow(name, method.name, q.rate, queue_stats(q.timings, q.served, workload.warmup))
                    for q in queued
                ]
                result.rows.extend(rows)
                result.methods.append(_method_row(name, method.name, rows, queued, workload.warmup, settings))
                save_result(out, result)
    finally:
        engine.store = original_store
    write_throughput_report(out, result)
    return result


@dataclass
class _Queued:
    rate: float  # req/s
    timings: list[Timing]  # by request index
    served: list[Served]  # by request index


def _serve_method(
    engine: Any,
    workload: Workload,
    method: PrefillMethod,
    settings: ThroughputSettings,
    store_bytes: int,
    name: str,
    show_progress: bool,
) -> list[_Queued]:
    """One method's queue at every rate: one replayed pass, or one live pass per rate; each from an empty store."""
    from tqdm.auto import tqdm

    from cacheblend_rag.store import MemoryStore

    n = len(workload.requests)

    def serve(i: int) -> Served:
        return serve_request(engine, workload, workload.requests[i], method, settings.max_new_tokens)

    queued = []
    if settings.mode == "replay":
        engine.store = MemoryStore(store_bytes)
        served = [serve(i) for i in tqdm(range(n), desc=f"{name} {method.name}", unit="req", disable=not show_progress)]
        for rate in settings.rates:
            queued.append(_Queued(rate, replay_queue(poisson_arrivals(n, rate, settings.seed), served), served))
        return queued
    for rate in settings.rates:
        engine.store = MemoryStore(store_bytes)
        desc = f"{name} {method.name} @{rate:g}/s"
        run = run_live(serve, poisson_arrivals(n, rate, settings.seed), show_progress=show_progress, desc=desc)
        timings = sorted(run.timings, key=lambda t: t.index)  # FIFO: already in order
        queued.append(_Queued(rate, timings, run.served))
    return queued


def _method_row(
    dataset: str,
    method: str,
    rows: Sequence[RateRow],
    queued: Sequence[_Queued],
    warmup: int,
    settings: ThroughputSettings,
) -> MethodRow:
    """Per (data set, method): the requests' own cost, and the rates that meet the TTFT target."""
    served = queued[0].served[warmup:]  # in replay mode the same for every rate; in live mode the first rate's pass
    mean_service = float(np.mean([s.service_s for s in served]))
    slo = settings.ttft_slo_s
    tested = max_rate = None
    if slo is not None:
        ok = [r.rate for r in rows if r.stats.ttft_p90_s <= slo]
        tested = max(ok) if ok else None
        if settings.mode == "replay":
            max_rate = max_rate_within_slo(queued[0].served, slo, warmup=warmup, seed=settings.seed)
    return MethodRow(
        dataset=dataset,
        method=method,
        own_ttft_p50_s=percentile([s.ttft_s for s in served], 50),
        service_mean_s=mean_service,
        capacity_rps=1.0 / mean_service if mean_service > 0 else math.nan,
        hit_rate=rows[0].stats.hit_rate,
        slo_s=slo,
        max_tested_rate_within_slo=tested,
        max_rate_within_slo=max_rate,
    )
