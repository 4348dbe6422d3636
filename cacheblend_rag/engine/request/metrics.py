"""What one request cost: time to first token, how much was recomputed, what the chunk cache gave."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..chunks.elsewhere import note


@dataclass
class RequestMetrics:
    mode: str
    recompute_ratio: float | None = None  # blend only
    prompt_tokens: int = 0
    reused_tokens: int = 0  # chunk tokens whose KV came from the store (chunks stored before this request)
    cold_tokens: int = 0  # chunk tokens of the chunks that were not stored (prefilled in this request, or later)
    recomputed_tokens: int = 0  # tokens recomputed on the last layer (the question included)
    compute_share: float = 0.0  # token-layers recomputed / token-layers of a full prefill
    chunks_hit: int = 0
    chunks_missed: int = 0  # not in the store: prefilled on the spot and stored
    chunks_captured: int = 0  # missed chunks stored from this request's own full prefill (no second prefill)
    # hits read from a captured entry: KV an earlier full prefill (a request's or a group's) computed after others
    chunks_hit_captured: int = 0
    hits_by_tier: dict[str, int] = field(default_factory=dict)  # chunk hits per store tier (memory, disk, redis)
    bytes_loaded: int = 0  # read from store tiers, as their codecs stored it (int8 on disk: about a quarter of fp32)
    load_s: float = 0.0  # store lookups, reading, checking and assembling loaded KV (overlapped when pipelined)
    wait_s: float = 0.0  # time the fusor sat waiting for loaded KV: the part of load_s compute did not hide
    pipelined: bool = False  # layer-wise loading ran on a thread beside the fusor
    precompute_s: float = 0.0  # prefilling chunks that missed, within this request (part of ttft_s)
    # missed chunks left to be prefilled and stored after the answer (`engine.fill_stats` counts them once stored)
    chunks_deferred: int = 0
    # missed chunks stored for another dtype or codec, by label ("float32", "codec int8"): `stored_note` says it
    stored_otherwise: dict[str, int] = field(default_factory=dict)
    fallback: str | None = None  # why the request ran otherwise than asked (e.g. a full prefill for a cold one)
    # the "attention" rule's risk signals of the first blend (guard.first_token_signals), and the ratios a
    # guard escalated through (1.0: every chunk token recomputed, a full prefill's result)
    risk: dict[str, Any] | None = None
    escalations: list[float] = field(default_factory=list)
    guard_reason: str | None = None  # why the guard escalated (None: it did not, or no guard)
    compute_s: float = 0.0  # the prefill itself, waits excluded (and the interleaved decode steps below)
    # decode steps of requests already answering, run between this prefill's layers
    # (`ServingConfig.max_token_gap_s`); their time is part of this request's ttft_s
    interleaved_steps: int = 0
    ttft_s: float = 0.0  # call -> first token, everything included
    decode_s: float = 0.0
    generated_tokens: int = 0
    recomputed_per_layer: list[int] = field(default_factory=list)
    controller: dict[str, Any] | None = None  # the loading controller's decision, when it chose the ratio
    dtype: str = ""  # what the request was computed in, e.g. "bfloat16" (dtype="auto" resolved)
    device: str = ""  # and where, e.g. "cpu", "cuda:0"

    def __getattr__(self, name: str) -> Any:  # only for names the dataclass does not have
        if name == "deferred_fill_s":
            raise AttributeError(
                "RequestMetrics.deferred_fill_s is gone: a request's metrics are final when its call returns; read "
                "engine.fill_stats.prefill_s (after engine.wait_for_fills()) for the chunks stored after the answer"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def stored_note(self) -> str | None:
        """One line on the missed chunks stored for another dtype or codec (`stored_otherwise`); None if none."""
        return note(self.stored_otherwise, self.dtype or "this dtype")

    @property
    def recompute_share(self) -> float:
        """Share of the prompt recomputed on the last layer."""
        return self.recomputed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def _tiers(self) -> str:
        if set(self.hits_by_tier) <= {"memory"}:
            return ""
        return " (" + ", ".join(f"{k} {v}" for k, v in self.hits_by_tier.items()) + ")"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["recompute_share"] = self.recompute_share
        d["warm_ttft_s"] = self.warm_ttft_s
        return d

    @property
    def warm_ttft_s(self) -> float:
        """The time to first token less the prefill of chunks that were not stored: what the same request takes
        once its chunks are stored (a full prefill chosen by the miss policy is not counted off)."""
        return max(0.0, self.ttft_s - self.precompute_s)

    def summary(self) -> str:
        ratio = f" r={self.recompute_ratio:.2f}" if self.recompute_ratio is not None else ""
        if self.controller is not None:
            ratio += f" ({self.controller['source']})"
        cold = ""
        if self.precompute_s > 0:
            cold = f" (of which {self.precompute_s * 1000:.0f}ms prefilling {self.chunks_missed} missed chunks)"
        if self.fallback is not None:
            cold += f" [{self.fallback}]"
        if self.escalations:
            cold += f" [guard: {self.guard_reason}; escalated to r={self.escalations[-1]:g}]"
        return (
            f"mode={self.mode}{ratio} ttft={self.ttft_s * 1000:.0f}ms{cold} prompt={self.prompt_tokens} tok "
            f"recomputed={self.recomputed_tokens} ({self.recompute_share:.0%}, compute {self.compute_share:.0%}) "
            f"chunks hit/miss={self.chunks_hit}/{self.chunks_missed}{self._tiers()} "
            f"{f'captured={self.chunks_hit_captured} ' if self.chunks_hit_captured else ''}"
            f"loaded={self.bytes_loaded / 2**20:.1f}MiB "
            f"load={self.load_s * 1000:.0f}ms{' (pipelined)' if self.pipelined else ''} "
            f"wait={self.wait_s * 1000:.0f}ms compute={self.compute_s * 1000:.0f}ms "
            f"decode={self.generated_tokens} tok in {self.decode_s:.2f}s"
            f"{f' ({self.dtype} on {self.device})' if self.dtype else ''}"
        )
