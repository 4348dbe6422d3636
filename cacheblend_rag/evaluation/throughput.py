"""The throughput benchmark of the paper's Fig. 14: Poisson arrivals at several request rates against one engine.

Scope: building the "extended" workload, serving it with each method, queueing it at each rate, and the
report (`results.json`, `summary.md`, a figure). Used by `cacheblend-rag bench throughput` and
`benchmarks/throughput.py`.

Workload (the paper's "MuSiQue / 2WikiMQA extended", §7.1). The contexts of the first N cases of a data set,
each split into ~`chunk_tokens`-token chunks by the project's chunker, make one chunk database, indexed with
FAISS and the packaged all-MiniLM-L6-v2 (cosine similarity of unit vectors: the same ranking as the paper's
L2 distance). Every question is asked `repeats` times, each time with its top-k
chunks in a fresh random order. The paper asked GPT-4 for three paraphrases of each question; there is no such
API here, so the question itself is asked again (a paraphrase retrieves about the same chunks; a repeat
retrieves exactly the same). The request sequence is shuffled so the repeats are spread out, and the first
`warmup` requests are served but left out of the statistics: the store starts empty (the paper skips its
first 1K of 6K queries).

Serving. Chunk KV lives in the engine's memory store, emptied before each method. A chunk that misses is
prefilled during the request and its cost is part of that request's TTFT: there is no untimed warm step, since
reuse across requests is what this benchmark measures. Methods: full recompute, prefix caching (the first
chunk's KV reused), full KV reuse, CacheBlend at a ratio.

Queueing. Requests arrive as a Poisson process (seeded exponential gaps; the same unit-rate draws, scaled by
1 / rate, for every rate and every method) at one FIFO server: the engine serves one request at a time.
- `replay` (default): serve the sequence once per method, recording each request's own TTFT (call -> first
  token) and service time (call -> last token). Per rate, the FIFO queue then follows exactly from Lindley's
  recursion: start_i = max(arrival_i, finish_{i-1}), finish_i = start_i + service_i, and the request's TTFT is
  start_i - arrival_i + its own TTFT. This is exact because, with one server and a fixed order, what a request
  costs depends on the requests served before it (the store's contents), never on when it arrived. One pass
  per method then serves every rate, which matters where one full prefill takes tens of seconds.
- `live`: an arrival thread puts requests into a queue at their Poisson times and the engine serves them from
  it; TTFT is wall-clock time from arrival to first token. One pass per (method, rate): the real thing, to
  check the replay against.

Reported per (data set, method, rate): TTFT p50 / p90 / p99 / mean over the measured requests, completed
requests per second (measured requests / (last finish - first arrival)), and the chunk hit rate (prompt chunks
whose KV came from the store / prompt chunks; prefix caching reads only the first chunk, so its rate is at
most 1/k). With a TTFT target: per method, the highest rate whose p90 TTFT meets it.
"""

from __future__ import annotations

import json
import math
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CacheBlendError, ConfigError
from ..retrieval.chunking import MIN_CHUNK_TOKENS
from .datasets import Dataset, DatasetError, TaskSpec
from .methods import PrefillMethod, parse_methods

__all__ = [
    "DEFAULT_RATES",
    "DEFAULT_THROUGHPUT_METHODS",
    "LiveRun",
    "Served",
    "ThroughputSettings",
    "Timing",
    "Workload",
    "WorkloadRequest",
    "build_workload",
    "max_rate_within_slo",
    "parse_rates",
    "parse_throughput_methods",
    "plot_throughput",
    "poisson_arrivals",
    "queue_stats",
    "replay_queue",
    "run_live",
    "run_throughput",
    "serve_request",
    "throughput_markdown",
    "write_throughput_report",
]

DEFAULT_THROUGHPUT_METHODS = "full,prefix,blend@0.15"
# Spans a 0.5B model on a 2-core CPU (a full 6 x 512-token prefill ~25 s) up to small models and GPUs.
DEFAULT_RATES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
MODES = ("replay", "live")
RESULTS_JSON = "results.json"
SUMMARY_MD = "summary.md"
FIGURE = "ttft_vs_rate.png"
REPEAT_NOTE = (
    "each question is asked `repeats` times, its top-k chunks in a new random order each time; the paper used "
    "GPT-4 paraphrases of the question instead, which this offline benchmark cannot make"
)


# -- settings --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThroughputSettings:
    rates: tuple[float, ...] = DEFAULT_RATES  # request rates to queue at, requests per second
    chunk_tokens: int = 512  # chunk size of the chunk database, in the LLM's tokens (the paper's 512)
    top_k: int = 6  # chunks retrieved per request (the paper's 6)
    repeats: int = 4  # times each question is asked (1 original + the paper's 3 paraphrases)
    warmup: int | None = None  # first requests served but not measured; None: a sixth (the paper's 1K of 6K)
    max_new_tokens: int = 16  # answer budget: the service time runs until generation ends
    seed: int = 0  # chunk orders, request order and arrival gaps
    mode: str = "replay"  # "replay": one pass per method, queues computed; "live": one pass per (method, rate)
    ttft_slo_s: float | None = None  # TTFT target: report the highest rate whose p90 TTFT meets it
    store_bytes: int | None = None  # memory store budget per method; None: the engine's memory_budget_bytes

    def __post_init__(self) -> None:
        rates = tuple(self.rates)
        object.__setattr__(self, "rates", rates)
        if not rates:
            raise ConfigError("rates is empty; give one or more request rates in requests/s, e.g. 0.1,0.2,0.5")
        bad = [r for r in rates if not (isinstance(r, (int, float)) and math.isfinite(r) and r > 0)]
        if bad:
            raise ConfigError(f"every rate must be a finite number > 0 (requests/s), got {bad[0]!r}")
        for name, low in (("chunk_tokens", MIN_CHUNK_TOKENS), ("top_k", 1), ("repeats", 1), ("max_new_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.warmup is not None and (not isinstance(self.warmup, int) or self.warmup < 0):
            raise ConfigError(f"warmup must be an integer >= 0 (or None for a sixth), got {self.warmup!r}")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.ttft_slo_s is not None and not self.ttft_slo_s > 0:
            raise ConfigError(f"ttft_slo_s must be > 0 seconds, got {self.ttft_slo_s}")
        if self.store_bytes is not None and self.store_bytes <= 0:
            raise ConfigError(f"store_bytes must be > 0, got {self.store_bytes}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rates"] = list(self.rates)
        return d


def parse_rates(text: str | Sequence[float]) -> tuple[float, ...]:
    """ "0.05,0.1,0.2" (or a list) -> request rates in requests/s, each checked to be > 0."""
    items = text.split(",") if isinstance(text, str) else list(text)
    rates = []
    for item in items:
        if isinstance(item, str):
            if not item.strip():
                continue
            try:
                item = float(item)
            except ValueError:
                raise ConfigError(f"a rate must be a number of requests per second, got {item.strip()!r}") from None
        if not (math.isfinite(item) and item > 0):
            raise ConfigError(f"every rate must be > 0 requests/s, got {item}")
        rates.append(float(item))
    if not rates:
        raise ConfigError("no request rate given; e.g. 0.05,0.1,0.2")
    return tuple(sorted(set(rates)))


def parse_throughput_methods(names: str | Sequence[str]) -> list[PrefillMethod]:
    """Method names as for the quality benchmark, limited to the one-request methods (full, prefix, reuse, blend)."""
    methods = parse_methods(names)
    for m in methods:
        if not isinstance(m, PrefillMethod):
            raise ConfigError(
                f"method {m.name!r} makes several requests per question; the throughput benchmark compares "
                "one-request methods: full, prefix, reuse, blend@R"
            )
    return methods  # type: ignore[return-value]  # all PrefillMethod, checked above


# -- workload --------------------------------------------------------------------------------------------------


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
    from ..retrieval import Chunk, ChunkIndex, Document, load_embedder, split_documents

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


# -- serving and queueing --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Served:
    """What serving one request cost, measured with no queue in front of it."""

    ttft_s: float  # call -> first token
    service_s: float  # call -> end of generation: how long the request holds the server
    chunks: int  # chunks in the prompt
    chunks_hit: int  # of them, KV read from the store (prefix caching looks up the first chunk only)
    chunks_missed: int = 0  # looked up, not found: prefilled during the request and stored
    prompt_tokens: int = 0
    recomputed_tokens: int = 0
    generated_tokens: int = 0


@dataclass(frozen=True)
class Timing:
    """One request in a queue; times in seconds from the first arrival."""

    index: int  # the request's position in the sequence
    arrival_s: float
    start_s: float  # the server takes it
    finish_s: float  # its last token
    ttft_s: float  # arrival -> first token: the wait plus the request's own TTFT


def serve_request(
    engine: Any, workload: Workload, request: WorkloadRequest, method: PrefillMethod, max_new_tokens: int
) -> Served:
    """Answer one request on the engine in the method's mode; chunks missing from the store are prefilled now."""
    t0 = time.perf_counter()
    result = engine.generate(
        workload.texts(request),
        request.question,
        mode=method.mode,
        recompute_ratio=method.recompute_ratio,
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


def _unit_arrivals(n: int, seed: int) -> list[float]:
    """Arrival times of a rate-1 Poisson process, the first at 0; divide by a rate to get that rate."""
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(1.0)
    return times


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (s) of `n` requests at `rate` req/s: the first at 0, then exponential gaps of mean 1/rate.

    The same seed gives the same draws at every rate, scaled by 1/rate, so curves over rates (and methods) see
    one arrival pattern: less noise between points, and waits that grow monotonically with the rate.
    """
    if not (math.isfinite(rate) and rate > 0):
        raise ConfigError(f"rate must be > 0 requests/s, got {rate}")
    if n < 0:
        raise ConfigError(f"n must be >= 0, got {n}")
    return [t / rate for t in _unit_arrivals(n, seed)]


def replay_queue(arrivals: Sequence[float], served: Sequence[Served]) -> list[Timing]:
    """The single-server FIFO queue of requests with these arrival times and measured costs (Lindley)."""
    if len(arrivals) != len(served):
        raise ValueError(f"{len(arrivals)} arrival times for {len(served)} served requests")
    timings, free_at = [], -math.inf
    for i, (arrival, s) in enumerate(zip(arrivals, served, strict=True)):
        start = max(arrival, free_at)
        free_at = start + s.service_s
        timings.append(Timing(i, arrival, start, free_at, start - arrival + s.ttft_s))
    return timings


@dataclass
class LiveRun:
    timings: list[Timing]  # in the order served (FIFO: the sequence's order)
    served: list[Served]  # by request index


def run_live(
    serve: Callable[[int], Served],
    arrivals: Sequence[float],
    *,
    show_progress: bool = False,
    desc: str = "live",
) -> LiveRun:
    """Serve requests 0..n-1 as they arrive at `arrivals` (s from now), one at a time, first come first served.

    A thread puts each request into a queue at its arrival time; the calling thread is the server: it takes
    requests from the queue and calls `serve(index)`. A request's TTFT is wall-clock time from its arrival to
    its first token, the latter placed by `serve`'s own TTFT after the call starts.
    """
    from tqdm.auto import tqdm

    n = len(arrivals)
    inbox: queue.Queue[tuple[int, float]] = queue.Queue()
    stop = threading.Event()
    t0 = time.perf_counter()

    def arrive() -> None:
        for i, at in enumerate(arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0 and stop.wait(delay):
                return  # the server gave up
            inbox.put((i, time.perf_counter() - t0))

    arrivals_thread = threading.Thread(target=arrive, name="poisson-arrivals", daemon=True)
    arrivals_thread.start()
    timings: list[Timing] = []
    served: list[Served | None] = [None] * n
    try:
        for _ in tqdm(range(n), desc=desc, unit="req", disable=not show_progress):
            i, arrived = inbox.get()
            start = time.perf_counter() - t0
            s = serve(i)
            finish = time.perf_counter() - t0
            served[i] = s
            timings.append(Timing(i, arrived, start, finish, start - arrived + s.ttft_s))
    finally:
        stop.set()
        arrivals_thread.join()
    return LiveRun(timings, [s for s in served if s is not None])


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def queue_stats(timings: Sequence[Timing], served: Sequence[Served], warmup: int) -> dict[str, float]:
    """TTFT percentiles, completed requests per second and hit rate over the requests with index >= warmup."""
    measured = [t for t in timings if t.index >= warmup]
    if not measured:
        raise ConfigError(f"warmup of {warmup} requests leaves none of the {len(timings)} to measure")
    ttfts = [t.ttft_s for t in measured]
    elapsed = max(t.finish_s for t in measured) - min(t.arrival_s for t in measured)
    chunks = sum(served[t.index].chunks for t in measured)
    hits = sum(served[t.index].chunks_hit for t in measured)
    return {
        "n": len(measured),
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p90_s": _percentile(ttfts, 90),
        "ttft_p99_s": _percentile(ttfts, 99),
        "ttft_mean_s": float(np.mean(ttfts)),
        "throughput_rps": len(measured) / elapsed if elapsed > 0 else math.nan,
        "hit_rate": hits / chunks if chunks else 0.0,
    }


def max_rate_within_slo(
    served: Sequence[Served], slo_s: float, *, warmup: int = 0, seed: int = 0, quantile: float = 90.0
) -> float | None:
    """The highest Poisson rate (req/s) at which the replayed queue's p`quantile` TTFT stays <= `slo_s`.

    None when even an idle server misses the target (the requests' own TTFT is too high); inf when even all
    requests arriving at once meet it. Found by bisection: with the arrival draws fixed and scaled by 1/rate,
    every request's wait can only grow with the rate, so the percentile is monotonic in it.
    """
    n = len(served)
    unit = _unit_arrivals(n, seed)

    def meets(rate: float) -> bool:
        arrivals = [t / rate for t in unit] if math.isfinite(rate) else [0.0] * n
        timings = replay_queue(arrivals, served)[warmup:]
        return _percentile([t.ttft_s for t in timings], quantile) <= slo_s

    if _percentile([s.ttft_s for s in served[warmup:]], quantile) > slo_s:
        return None
    if meets(math.inf):
        return math.inf
    mean_service = float(np.mean([s.service_s for s in served])) or 1e-9
    lo = hi = 1.0 / mean_service  # the server's capacity: a good first guess
    while meets(hi):
        lo, hi = hi, hi * 2
    while not meets(lo) and lo > 1e-12:
        lo /= 2
    for _ in range(60):  # geometric bisection to well under 0.1 %
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
        if hi / lo < 1 + 1e-4:
            break
    return lo


# -- the benchmark ---------------------------------------------------------------------------------------------


def _check_prompts_fit(engine: Any, workload: Workload, max_new_tokens: int) -> None:
    """Refuse before any timing if a request would not fit the model (one check per question)."""
    limit = getattr(engine, "max_tokens", None)
    if limit is None:
        return
    done: set[str] = set()
    for r in workload.requests:
        if r.case_id in done:
            continue
        done.add(r.case_id)
        prompt = engine.build_prompt(workload.texts(r), r.question, template=workload.spec.template)
        if prompt.num_tokens + max_new_tokens > limit:
            raise ConfigError(
                f"request for {r.case_id} has {prompt.num_tokens} prompt tokens + {max_new_tokens} new tokens, "
                f"beyond the model's limit of {limit}; lower --top-k or --chunk-tokens"
            )


def _request_record(r: WorkloadRequest, s: Served, t: Timing | None = None) -> dict[str, Any]:
    record: dict[str, Any] = {"index": r.index, "case_id": r.case_id, "repeat": r.repeat, "chunks": list(r.chunks)}
    record.update(asdict(s))
    if t is not None:
        record.update(arrival_s=t.arrival_s, start_s=t.start_s, finish_s=t.finish_s, queued_ttft_s=t.ttft_s)
    return record


def _jsonable(x: Any) -> Any:
    """nan and inf become null: JSON has neither (so an SLO met at any rate, "any" in the table, is null here)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Mapping):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def _save(path: Path, result: Mapping[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_jsonable(result), indent=1) + "\n")
    os.replace(tmp, path)


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
) -> dict[str, Any]:
    """Build each data set's workload, serve it with every method, queue it at every rate; write the report.

    Returns the result that `results.json` holds: settings (with `info`, e.g. the model's name), the workloads,
    every pass's per-request records, one summary row per (data set, method, rate) and one per (data set,
    method). `results.json` is rewritten after each pass, so an interrupted run keeps the passes it finished.
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
    budget = settings.store_bytes or engine.config.memory_budget_bytes
    result: dict[str, Any] = {
        "settings": {**settings.to_dict(), "store_bytes": budget, **(info or {})},
        "note": REPEAT_NOTE,
        "workloads": [],
        "passes": [],
        "rows": [],
        "methods": [],
    }
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
            result["workloads"].append(
                {
                    "dataset": name,
                    "cases": workload.cases,
                    "chunks": len(workload.chunks),
                    "requests": len(workload.requests),
                    "warmup": workload.warmup,
                    "sequence": [
                        {"case_id": r.case_id, "repeat": r.repeat, "chunks": list(r.chunks)} for r in workload.requests
                    ],
                }
            )
            for method in prefill_methods:
                queued = _serve_method(engine, workload, method, settings, budget, name, show_progress)
                live = settings.mode == "live"
                for q in queued if live else queued[:1]:  # a replay pass is the same for every rate: stored once
                    records = [
                        _request_record(r, s, q.timings[r.index] if live else None)
                        for r, s in zip(workload.requests, q.served, strict=True)
                    ]
                    result["passes"].append(
                        {"dataset": name, "method": method.name, "rate": q.rate if live else None, "records": records}
                    )
                rows = [
                    {"dataset": name, "method": method.name, "rate": q.rate}
                    | queue_stats(q.timings, q.served, workload.warmup)
                    for q in queued
                ]
                result["rows"].extend(rows)
                result["methods"].append(_method_row(name, method.name, rows, queued, workload.warmup, settings))
                _save(out / RESULTS_JSON, result)
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

    from ..store import MemoryStore

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
    rows: Sequence[Mapping[str, Any]],
    queued: Sequence[_Queued],
    warmup: int,
    settings: ThroughputSettings,
) -> dict[str, Any]:
    """Per (data set, method): the requests' own cost, and the rates that meet the TTFT target."""
    served = queued[0].served[warmup:]  # in replay mode the same for every rate; in live mode the first rate's pass
    mean_service = float(np.mean([s.service_s for s in served]))
    row: dict[str, Any] = {
        "dataset": dataset,
        "method": method,
        "own_ttft_p50_s": _percentile([s.ttft_s for s in served], 50),
        "service_mean_s": mean_service,
        "capacity_rps": 1.0 / mean_service if mean_service > 0 else math.nan,
        "hit_rate": rows[0]["hit_rate"],
        "slo_s": settings.ttft_slo_s,
        "max_tested_rate_within_slo": None,
        "max_rate_within_slo": None,
    }
    if settings.ttft_slo_s is not None:
        ok = [r["rate"] for r in rows if r["ttft_p90_s"] <= settings.ttft_slo_s]
        row["max_tested_rate_within_slo"] = max(ok) if ok else None
        if settings.mode == "replay":
            row["max_rate_within_slo"] = max_rate_within_slo(
                queued[0].served, settings.ttft_slo_s, warmup=warmup, seed=settings.seed
            )
    return row


# -- report ----------------------------------------------------------------------------------------------------


def _fmt(x: Any, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "any"
    return format(x, spec)


def throughput_markdown(result: Mapping[str, Any]) -> str:
    """Per data set: a row per (method, rate), then a row per method with its own cost and the TTFT target."""
    settings = result["settings"]
    slo = settings.get("ttft_slo_s")
    lines = [
        f"Mode {settings['mode']}; top {settings['top_k']} chunks of <= {settings['chunk_tokens']} tokens per "
        f"request; {settings['max_new_tokens']} new tokens; store {settings['store_bytes'] / 2**20:.0f} MiB per "
        f"method. Questions are repeated, not paraphrased: {result.get('note', REPEAT_NOTE)}. TTFT counts the "
        "wait in the queue; hit rate = prompt chunks read from the store / prompt chunks.",
        "",
    ]
    for w in result["workloads"]:
        name = w["dataset"]
        rows = [r for r in result["rows"] if r["dataset"] == name]
        lines += [
            f"### {name} extended ({w['cases']} questions, {w['chunks']} chunks, {w['requests']} requests, "
            f"first {w['warmup']} not measured)",
            "",
            "| method | rate (req/s) | TTFT p50 (s) | p90 | p99 | mean | completed req/s | hit rate | n |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['method']} | {_fmt(r['rate'], 'g')} | {_fmt(r['ttft_p50_s'], '.3f')} | "
                f"{_fmt(r['ttft_p90_s'], '.3f')} | {_fmt(r['ttft_p99_s'], '.3f')} | {_fmt(r['ttft_mean_s'], '.3f')} | "
                f"{_fmt(r['throughput_rps'], '.4f')} | {_fmt(r['hit_rate'], '.2f')} | {r['n']} |"
            )
        lines.append("")
        header = "| method | own TTFT p50 (s) | mean service (s) | capacity (req/s) | hit rate |"
        rule = "|---|---:|---:|---:|---:|"
        if slo is not None:
            header += f" max tested rate, p90 <= {slo:g} s | max rate (replay) |"
            rule += "---:|---:|"
        lines += [header, rule]
        for m in (m for m in result["methods"] if m["dataset"] == name):
            line = (
                f"| {m['method']} | {_fmt(m['own_ttft_p50_s'], '.3f')} | {_fmt(m['service_mean_s'], '.3f')} | "
                f"{_fmt(m['capacity_rps'], '.4f')} | {_fmt(m['hit_rate'], '.2f')} |"
            )
            if slo is not None:
                line += f" {_fmt(m['max_tested_rate_within_slo'], 'g')} | {_fmt(m['max_rate_within_slo'], '.4g')} |"
            lines.append(line)
        lines.append("")
    return "\n".join(lines)


def plot_throughput(result: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Fig. 14 style, one row of panels per data set: TTFT p50 and p90 against the request rate, and p90 against
    the completed requests per second; one line per method, the TTFT target dashed."""
    from .quality import _pyplot

    plt = _pyplot()
    names = [w["dataset"] for w in result["workloads"]]
    if not names:
        raise CacheBlendError("nothing to plot: no data set was run")
    slo = result["settings"].get("ttft_slo_s")
    panels = (
        ("rate", "ttft_p50_s", "request rate (req/s)", "TTFT p50 (s)"),
        ("rate", "ttft_p90_s", "request rate (req/s)", "TTFT p90 (s)"),
        ("throughput_rps", "ttft_p90_s", "completed requests/s", "TTFT p90 (s)"),
    )
    fig, axes = plt.subplots(len(names), len(panels), figsize=(13, 3.8 * len(names)), squeeze=False)
    for row_axes, name in zip(axes, names, strict=True):
        rows = [r for r in result["rows"] if r["dataset"] == name]
        for ax, (x, y, xlabel, ylabel) in zip(row_axes, panels, strict=True):
            for method in dict.fromkeys(r["method"] for r in rows):
                pts = sorted(
                    (r[x], r[y]) for r in rows if r["method"] == method and r[x] is not None and r[y] is not None
                )
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
            xs = [r[x] for r in rows if r[x] is not None and r[x] > 0]
            if xs and max(xs) / min(xs) > 20:
                ax.set_xscale("log")
            if slo is not None:
                ax.axhline(slo, linestyle="--", linewidth=1, color="grey", label=f"target {slo:g} s")
            ax.set_title(f"{name} extended")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("TTFT under Poisson arrivals (one server, FIFO)")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def write_throughput_report(
    out_dir: str | os.PathLike[str], result: Mapping[str, Any] | None = None
) -> dict[str, Path]:
    """results.json, summary.md and the figure from a `run_throughput` result (read from `out_dir` if not given)."""
    out = Path(out_dir)
    path = out / RESULTS_JSON
    if result is None:
        if not path.exists():
            raise CacheBlendError(f"no results at {path}; run `cacheblend-rag bench throughput` first")
        result = json.loads(path.read_text())
    else:
        _save(path, result)
    files = {"results": path, "summary_md": out / SUMMARY_MD}
    files["summary_md"].write_text("# Throughput benchmark (Fig. 14)\n\n" + throughput_markdown(result))
    if result["rows"]:
        files["figure"] = plot_throughput(result, out / FIGURE)
    return files
