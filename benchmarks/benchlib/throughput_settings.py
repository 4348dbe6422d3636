"""What a throughput benchmark run is asked to do: rates, workload sizes, queue mode and TTFT target.

Checked when built, before any model loads (the CLI builds these from its flags first).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from benchlib.methods import PrefillMethod, parse_methods
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.retrieval.chunking import MIN_CHUNK_TOKENS

__all__ = [
    "DEFAULT_RATES",
    "DEFAULT_THROUGHPUT_METHODS",
    "MODES",
    "ThroughputSettings",
    "parse_rates",
    "parse_throughput_methods",
]

DEFAULT_THROUGHPUT_METHODS = "full,prefix,blend@0.15"
# Spans a 0.5B model on a 2-core CPU (a full 6 x 512-token prefill ~25 s) up to small models and GPUs.
DEFAULT_RATES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
MODES = ("replay", "live")


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

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ThroughputSettings:
        """The settings among `data`'s keys (other keys, e.g. the model's name, are left out)."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


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
