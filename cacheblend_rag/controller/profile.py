"""The offline profile the loading controller reads: how long recompute takes, how fast each tier reads.

Two measurements, both on the machine and model that will serve (paper §5.1):
- recompute time of a blended prefill as a function of prompt length N and recompute ratio r. For each
  profiled N the time is fitted as `intercept + slope * r` (the check layers cost a fixed share, every other
  layer grows with r); lengths in between are interpolated, longer ones scaled up.
- each tier's read throughput (bytes/s) and per-chunk latency, read the way the engine reads (layer by
  layer from disk and Redis, whole entries from memory).

`profile_engine` measures both; `LoadingProfile.save`/`load` keep them as JSON next to the deployment
(`cacheblend-rag profile` writes one).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .profile_io import load_profile_json, write_profile_json
from .profile_io import read_small_text_file as read_small_text_file  # re-exported: the CLI reads through it

if TYPE_CHECKING:
    from ..engine import CacheBlendEngine
    from ..store.base import ChunkStore

logger = logging.getLogger(__name__)

PROFILE_FORMAT = "cacheblend-rag/loading-profile/1"


@dataclass(frozen=True)
class ComputePoint:
    """Blended prefill time at one prompt length: `intercept_s + slope_s * r`."""

    num_tokens: int
    intercept_s: float  # compute at r = 0: check layers, the suffix, assembling the cache
    slope_s: float  # extra compute per unit of r (r = 1 recomputes every chunk token on every layer)

    def at(self, ratio: float) -> float:
        return self.intercept_s + self.slope_s * ratio


@dataclass(frozen=True)
class TierSpeed:
    bytes_per_s: float  # sustained read throughput of chunk KV
    latency_s: float = 0.0  # fixed cost per chunk (lookup, header, round trips)

    def read_time(self, nbytes: int, num_chunks: int = 1) -> float:
        return nbytes / self.bytes_per_s + self.latency_s * num_chunks


@dataclass(frozen=True)
class LoadingProfile:
    """What the controller needs to know about this model on this machine."""

    model: str  # model fingerprint: a profile of another model or precision is refused
    dtype: str
    device: str
    compute: tuple[ComputePoint, ...]  # sorted by num_tokens
    tiers: dict[str, TierSpeed] = field(default_factory=dict)
    created: str = ""

    def __post_init__(self) -> None:
        if not self.compute:
            raise ConfigError("a loading profile needs at least one compute point; run `cacheblend-rag profile`")
        object.__setattr__(self, "compute", tuple(sorted(self.compute, key=lambda p: p.num_tokens)))
        for p in self.compute:  # NaN compares false with everything: finiteness is checked first
            tokens_ok = isinstance(p.num_tokens, int) and not isinstance(p.num_tokens, bool)
            if not (tokens_ok and 0 < p.num_tokens <= MAX_PROFILE_TOKENS and finite(p.slope_s, p.intercept_s)
                    and p.slope_s >= 0 and p.intercept_s >= 0):  # fmt: skip
                raise ConfigError(f"invalid compute point in the profile (tokens a whole number in "
                                  f"1..{MAX_PROFILE_TOKENS}, seconds finite and >= 0): {p}")  # fmt: skip
        for name, t in self.tiers.items():
            if not (finite(t.bytes_per_s, t.latency_s) and t.bytes_per_s > 0 and t.latency_s >= 0):
                raise ConfigError(f"invalid read speed for tier {name!r} in the profile (finite, bytes_per_s > 0, "
                                  f"latency_s >= 0): {t}")  # fmt: skip

    def _point(self, num_tokens: int) -> tuple[float, float]:
        """(intercept, slope) at `num_tokens`: linear between profiled lengths, proportional outside them."""
        pts = self.compute
        if num_tokens <= pts[0].num_tokens:
            s = num_tokens / pts[0].num_tokens
            return pts[0].intercept_s * s, pts[0].slope_s * s
        if num_tokens >= pts[-1].num_tokens:
            s = num_tokens / pts[-1].num_tokens
            return pts[-1].intercept_s * s, pts[-1].slope_s * s
        for lo, hi in zip(pts, pts[1:], strict=False):
            if lo.num_tokens <= num_tokens <= hi.num_tokens:
                w = (num_tokens - lo.num_tokens) / (hi.num_tokens - lo.num_tokens)
                return (
                    lo.intercept_s + w * (hi.intercept_s - lo.intercept_s),
                    lo.slope_s + w * (hi.slope_s - lo.slope_s),
                )
        raise AssertionError("unreachable: the points are sorted")

    def recompute_time(self, num_tokens: int, ratio: float) -> float:
        """Estimated compute of a blended prefill of `num_tokens` tokens at recompute ratio `ratio`."""
        a, b = self._point(num_tokens)
        return a + b * ratio

    def ratio_for(self, num_tokens: int, seconds: float) -> float:
        """The ratio whose recompute takes `seconds` (0 if even r = 0 takes longer, 1 if r = 1 is faster)."""
        a, b = self._point(num_tokens)
        if b <= 0:
            return 1.0 if seconds >= a else 0.0
        return min(1.0, max(0.0, (seconds - a) / b))

    def load_time(self, tier: str, nbytes: int, num_chunks: int = 1) -> float:
        if tier not in self.tiers:
            raise ConfigError(
                f"the loading profile has no read speed for tier {tier!r} (it has {sorted(self.tiers)}); "
                f"run `cacheblend-rag profile` with that tier configured"
            )
        return self.tiers[tier].read_time(nbytes, num_chunks)

    # -- persistence ---------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "model": self.model,
            "dtype": self.dtype,
            "device": self.device,
            "created": self.created,
            "compute": [asdict(p) for p in self.compute],
            "tiers": {name: asdict(t) for name, t in self.tiers.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LoadingProfile:
        return cls(
            model=str(data["model"]),
            dtype=str(data["dtype"]),
            device=str(data["device"]),
            created=str(data.get("created", "")),
            compute=tuple(ComputePoint(**p) for p in data["compute"]),
            tiers={name: TierSpeed(**t) for name, t in data.get("tiers", {}).items()},
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        write_profile_json(path, self.to_json(), indent=2)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LoadingProfile:
        """Read a profile written by `save`. ConfigError, naming the path, for anything that is not one: a
        missing path, a folder, a FIFO or device (never read: it could block or never end), a file above
        MAX_PROFILE_BYTES, binary or malformed content."""
        redo = f"write it with `cacheblend-rag profile --out {path}`"
        return load_profile_json(path, "a loading profile", PROFILE_FORMAT, MAX_PROFILE_BYTES, redo, cls.from_json)


def finite(*values: object) -> bool:
    """Whether every value is a real number (not a bool) that is neither NaN nor infinite."""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)


MAX_PROFILE_TOKENS = 10_000_000  # a prompt length no model here reaches; larger is a damaged profile

# A profile holds a few compute points and tier speeds: a few KB. Anything far larger is not one.
MAX_PROFILE_BYTES = 1 << 20


# -- measuring ---------------------------------------------------------------------------------------------


def _fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope), both clipped at zero (time never falls with more recompute)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    slope = max(0.0, slope)
    return max(0.0, my - slope * mx), slope


def _filler_chunks(engine: CacheBlendEngine, num_chunks: int, chunk_tokens: int, seed: int) -> list[str]:
    """Chunks of about `chunk_tokens` tokens of plain text. Timing does not depend on what the text says."""
    import random

    rng = random.Random(seed)
    vocab = (
        "the a river city north old council built bridge year trade wool copper mountain king road market "
        "winter lake village church school station harbour festival museum valley farm mill tower wall gate"
    ).split()
    out = []
    for _ in range(num_chunks):
        words: list[str] = []
        while len(engine.tokenizer.encode(" ".join(words), add_special_tokens=False)) < chunk_tokens:
            words.extend(rng.choice(vocab) for _ in range(32))
        ids = engine.tokenizer.encode(" ".join(words), add_special_tokens=False)[:chunk_tokens]
        out.append(engine.tokenizer.decode(ids))
    return out


def profile_engine(
    engine: CacheBlendEngine,
    *,
    token_counts: Sequence[int] = (1024, 2048, 4096),
    ratios: Sequence[float] = (0.0, 0.15, 0.5),
    chunk_tokens: int = 512,
    tiers: dict[str, ChunkStore] | None = None,
    repeats: int = 2,
    show_progress: bool = True,
) -> LoadingProfile:
    """Measure `engine`'s blended prefill time over `token_counts` x `ratios`, and the read speed of `tiers`.

    `tiers` maps names to stores to time (default: a memory store and a disk store in a temporary
    directory); each is filled with the profiled chunks first. Takes about a minute for the defaults on the
    0.5B model on 2 CPU cores.
    """
    from tqdm.auto import tqdm

    from ..store import DiskStore, MemoryStore

    if not token_counts or any(n < chunk_tokens for n in token_counts):
        raise ConfigError(f"token_counts must each be >= chunk_tokens ({chunk_tokens}), got {list(token_counts)}")
    if len(set(ratios)) < 2 or any(not 0 <= r <= 1 for r in ratios):
        raise ConfigError(f"ratios needs at least two distinct values in [0, 1], got {list(ratios)}")
    too_long = [n for n in token_counts if n > engine.max_tokens - 64]
    if too_long:
        raise ConfigError(f"token_counts {too_long} exceed the engine's limit of {engine.max_tokens} tokens")
    question = "Which city is mentioned first?"
    points = []
    steps = tqdm(total=len(token_counts) * len(ratios), desc="profiling recompute", disable=not show_progress)
    all_chunks: list[str] = []
    for n in token_counts:
        chunks = _filler_chunks(engine, max(1, n // chunk_tokens), chunk_tokens, seed=n)
        all_chunks.extend(chunks)
        prompt = engine.build_prompt(chunks, question)
        engine.precompute(chunks, question, context=None)  # warm; which entry is read does not change a time
        engine.prefill(prompt, "blend", recompute_ratio=ratios[0])  # warm-up
        xs, ys = [], []
        for r in ratios:
            times = [engine.prefill(prompt, "blend", recompute_ratio=r).metrics.compute_s for _ in range(repeats)]
            xs.append(r)
            ys.append(statistics.median(times))
            steps.update()
        intercept, slope = _fit_line(xs, ys)
        points.append(ComputePoint(prompt.num_tokens, intercept, slope))
    steps.close()

    # Read speeds, from the KV of the chunks just profiled (the largest prompt's chunks suffice).
    prompt = engine.build_prompt(all_chunks[-max(1, token_counts[-1] // chunk_tokens) :], question)
    keys = engine.prompt_keys(prompt, with_prefix=False)  # the chunks' entries
    entries = [engine.store.get(k) for k in keys]
    entries = [e for e in entries if e is not None]
    if not entries:
        raise ConfigError("the engine's store kept none of the profiled chunks; raise memory_budget_bytes")
    own_dir = None
    if tiers is None:
        own_dir = tempfile.mkdtemp(prefix="cacheblend-profile-")
        tiers = {"memory": MemoryStore(), "disk": DiskStore(own_dir)}
    speeds: dict[str, TierSpeed] = {}
    try:
        for name, store in tiers.items():
            for e in entries:
                store.put(e)
            store.flush()
            opens, reads = [], []  # seconds per chunk to find and open it; seconds per byte to read its layers
            for _ in range(repeats + 1):
                t_open = t_read = 0.0
                nbytes = 0
                for e in entries:
                    t = time.perf_counter()
                    hit = store.open(e.key)
                    if hit is None:
                        raise ConfigError(f"tier {name!r} lost a chunk while being profiled; give it more budget")
                    t_open += time.perf_counter() - t
                    t = time.perf_counter()
                    for layer_idx in range(hit.kv.num_layers):
                        k, v = hit.kv.layer(layer_idx)  # read (and checked) now from a lazy tier
                        k.clone(), v.clone()  # copied out, as the loader does when it lays chunks end to end
                    t_read += time.perf_counter() - t
                    nbytes += hit.kv.nbytes
                opens.append(t_open / len(entries))
                reads.append(t_read / nbytes)
            speeds[name] = TierSpeed(bytes_per_s=1.0 / statistics.median(reads), latency_s=statistics.median(opens))
    finally:
        if own_dir is not None:
            for store in tiers.values():
                store.close()
            import shutil

            shutil.rmtree(own_dir, ignore_errors=True)
    return LoadingProfile(
        model=engine.fingerprint,
        dtype=engine.config.dtype,
        device=str(engine.device),
        compute=tuple(points),
        tiers=speeds,
        created=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
