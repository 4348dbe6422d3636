"""Orders in which questions arrive, and what a stream of simulated requests adds up to.

Three streams over questions labelled with their topic (an article, a product, a customer):
- "clustered": the questions in the order given (questions about one topic together, as traffic comes);
- "uniform": a seeded shuffle (no locality at all);
- "zipf": each request draws a topic with probability proportional to 1 / rank**s (ranks shuffled by the seed),
  then one of that topic's questions at random (popular topics come back, in no order).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from .simulate import SimRequest

STREAMS = ("clustered", "uniform", "zipf")


def stream_order(topics: Sequence[int | str], stream: str, *, seed: int = 0, length: int | None = None,
                 zipf_s: float = 1.0) -> list[int]:  # fmt: skip
    """Indexes into the questions (labelled `topics[i]`), in the order `stream` sends them; `length` requests
    (default: as many as there are questions; "clustered" and "uniform" never repeat a question)."""
    n = len(topics)
    length = n if length is None else length
    if stream not in STREAMS:
        raise ConfigError(f"stream must be one of {', '.join(STREAMS)}, got {stream!r}")
    if length < 0 or (stream != "zipf" and length > n):
        raise ConfigError(f"length must be in [0, {n}] for the {stream} stream, got {length}")
    rng = random.Random(seed)
    if stream == "clustered":
        return list(range(length))
    if stream == "uniform":
        order = list(range(n))
        rng.shuffle(order)
        return order[:length]
    by_topic: dict[int | str, list[int]] = {}
    for i, t in enumerate(topics):
        by_topic.setdefault(t, []).append(i)
    groups = list(by_topic.values())
    rng.shuffle(groups)  # which topic is the most popular is the seed's choice
    weights = [1.0 / (rank + 1) ** zipf_s for rank in range(len(groups))]
    cumulative = list(itertools.accumulate(weights))
    # one topic, then one of its questions, per request: a shorter stream is the start of a longer one
    return [rng.choice(groups[rng.choices(range(len(groups)), cum_weights=cumulative)[0]]) for _ in range(length)]


@dataclass(frozen=True)
class StreamSummary:
    """A stream's first `requests` requests: chunk hit rate, and mean time to first token against full prefill."""

    requests: int
    hit_rate: float  # chunks hit / chunks retrieved
    mean_ttft_s: float
    mean_full_s: float  # the same prompts' full prefill

    @property
    def speedup(self) -> float:
        """Mean full-prefill TTFT over mean TTFT (> 1: faster than full prefill)."""
        return self.mean_full_s / self.mean_ttft_s if self.mean_ttft_s > 0 else float("inf")


def summarize(results: Sequence[SimRequest], first: int | None = None) -> StreamSummary:
    """The summary of the first `first` results (all by default)."""
    part = results[: len(results) if first is None else first]
    if not part:
        raise ConfigError("no requests to summarize")
    chunks = sum(r.hits + r.misses for r in part)
    return StreamSummary(
        requests=len(part),
        hit_rate=sum(r.hits for r in part) / chunks if chunks else 0.0,
        mean_ttft_s=sum(r.ttft_s for r in part) / len(part),
        mean_full_s=sum(r.full_s for r in part) / len(part),
    )
