"""The queueing model of the throughput benchmark: Poisson arrivals at one FIFO server (the paper's Fig. 14).

Requests arrive as a Poisson process (seeded exponential gaps; the same unit-rate draws, scaled by 1 / rate, for
every rate and every method) at one server: the engine serves one request at a time.
- `replay_queue`: given each request's own cost, measured with no queue in front of it (`Served`: TTFT, call ->
  first token, and service time, call -> last token), the FIFO queue at a rate follows exactly from Lindley's
  recursion: start_i = max(arrival_i, finish_{i-1}), finish_i = start_i + service_i, and the request's TTFT is
  start_i - arrival_i + its own TTFT. This is exact because, with one server and a fixed order, what a request
  costs depends on the requests served before it (the store's contents), never on when it arrived, so one pass
  per method serves every rate, which matters where one full prefill takes tens of seconds.
- `run_live`: an arrival thread puts requests into a queue at their Poisson times and the caller serves them from
  it; TTFT is wall-clock time from arrival to first token. The real thing, to check the replay against.

`queue_stats` reduces a queue to TTFT p50 / p90 / p99 / mean, completed requests per second and the chunk hit
rate; `max_rate_within_slo` finds the highest rate whose p90 TTFT meets a target. Nothing here knows the engine.
"""

from __future__ import annotations

import math
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cacheblend_rag.errors import ConfigError

__all__ = [
    "LiveRun",
    "QueueStats",
    "Served",
    "Timing",
    "max_rate_within_slo",
    "percentile",
    "poisson_arrivals",
    "queue_stats",
    "replay_queue",
    "run_live",
]


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


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`; nan when there are none."""
    return float(np.percentile(values, q)) if len(values) else math.nan


@dataclass(frozen=True)
class QueueStats:
    """One queue's figures over its measured requests (index >= warmup)."""

    n: int  # measured requests
    ttft_p50_s: float  # TTFT counts the wait in the queue
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    throughput_rps: float  # completed requests / (last finish - first arrival); nan if no time passed
    hit_rate: float  # prompt chunks whose KV came from the store / prompt chunks


def queue_stats(timings: Sequence[Timing], served: Sequence[Served], warmup: int) -> QueueStats:
    """TTFT percentiles, completed requests per second and hit rate over the requests with index >= warmup."""
    measured = [t for t in timings if t.index >= warmup]
    if not measured:
        raise ConfigError(f"warmup of {warmup} requests leaves none of the {len(timings)} to measure")
    ttfts = [t.ttft_s for t in measured]
    elapsed = max(t.finish_s for t in measured) - min(t.arrival_s for t in measured)
    chunks = sum(served[t.index].chunks for t in measured)
    hits = sum(served[t.index].chunks_hit for t in measured)
    return QueueStats(
        n=len(measured),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        ttft_mean_s=float(np.mean(ttfts)),
        throughput_rps=len(measured) / elapsed if elapsed > 0 else math.nan,
        hit_rate=hits / chunks if chunks else 0.0,
    )


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
        return percentile([t.ttft_s for t in timings], quantile) <= slo_s

    if percentile([s.ttft_s for s in served[warmup:]], quantile) > slo_s:
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
