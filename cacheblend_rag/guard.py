"""The fidelity guard, in one place: its policy (`Guard`), the risk signals of a blend, and the escalation loop.

The "attention" rule's first pass reuses every chunk's KV and computes only the question, so it ends with the
first-token distribution of full KV reuse, for free. Comparing the blend's first token with it says how much the
recomputed tokens changed the answer: where they changed it a lot, the tokens left stale may change it too. The
signals (`first_token_signals`):
- `kl_reuse`: KL(blend || reuse) of the first token, in nats;
- `agree_reuse`: whether blend and reuse pick the same first token;
- `margin`: the blend's top-1 minus top-2 probability of the first token;
- `reuse_margin`: the same margin of full KV reuse's first token (known before any token is recomputed);
- `stale_attention`: the share of the question's attention on chunk tokens that were not recomputed.

With a `Guard`, a request whose blend looks risky is blended again at the next ratio of the ladder, over the same
first pass (its KV and the question's attention are reused), until two successive blends agree or the ladder ends
(`escalate`); a ratio of 1.0 recomputes every chunk token, which equals a full prefill. Which signal and threshold
keep a chosen fidelity at the least cost is a measurement (`benchmarks/guard_signals.py`), not a guess built in
here.

This module is on the ground floor: `config` re-exports `Guard`, so it imports nothing of the package but its
errors, and never imports torch (the signals use the methods of the tensors they are given).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["Guard", "agrees", "escalate", "first_token_signals", "kl", "top2_margin"]


@dataclass(frozen=True)
class Guard:
    """When a blend escalates, and to what. A request is risky when the blend's first token is a near tie (its
    top-1 minus top-2 probability is below `min_margin`) or when recomputing moved the first token far from full
    KV reuse (KL(blend || reuse) above `max_kl`); it is then blended again at each ratio of `ratios` in turn, until
    the new blend agrees with the previous one (same first token, KL at most `max_kl`). A ratio of 1.0 (the
    default ladder's end) is exact: a full prefill's KV and logits. Which trigger and threshold keep a fidelity
    target at the least compute is measured in docs/benchmarks.md, "The fidelity guard"."""

    # first-token top-1 minus top-2 probability below which a request escalates (0: off); 0.1 is the least of the
    # margins measured that kept 0.95 of full recompute's first tokens over the benchmark cases
    min_margin: float = 0.1
    max_kl: float = math.inf  # nats: first-token KL(blend || reuse) above which a request escalates (inf: off)
    ratios: tuple[float, ...] = (1.0,)  # the escalation ladder, increasing

    def __post_init__(self) -> None:
        if isinstance(self.max_kl, bool) or not isinstance(self.max_kl, (int, float)) or not self.max_kl >= 0:
            raise ConfigError(f"guard max_kl must be a number >= 0 (nats; inf: off), got {self.max_kl!r}")
        margin = self.min_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin <= 1:
            raise ConfigError(f"guard min_margin must be a probability in [0, 1] (0: off), got {margin!r}")
        ratios = tuple(self.ratios)
        if not ratios or any(isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1 for r in ratios):
            raise ConfigError(f"guard ratios must be one or more numbers in (0, 1], got {self.ratios!r}")
        if list(ratios) != sorted(set(ratios)):
            raise ConfigError(f"guard ratios must increase, got {ratios}")
        object.__setattr__(self, "ratios", tuple(float(r) for r in ratios))

    def reason(self, signals: dict[str, Any]) -> str | None:
        """Why a blend with these risk signals escalates (`first_token_signals`), or None."""
        if signals["margin"] < self.min_margin:
            return f"first-token margin {signals['margin']:.3f} < {self.min_margin:g}"
        if signals["kl_reuse"] > self.max_kl:
            return f"first-token KL to reuse {signals['kl_reuse']:.3f} > {self.max_kl:g}"
        return None

    def is_risky(self, signals: dict[str, Any]) -> bool:
        """Whether a blend with these signals escalates."""
        return self.reason(signals) is not None

    def ladder(self, ratio: float) -> tuple[float, ...]:
        """The ratios above `ratio` this guard escalates through."""
        return tuple(r for r in self.ratios if r > ratio)

    def describe(self) -> str:
        """e.g. 'margin < 0.1 -> r=1'."""
        triggers = [f"margin < {self.min_margin:g}"] if self.min_margin > 0 else []
        triggers += [f"KL to reuse > {self.max_kl:g}"] if math.isfinite(self.max_kl) else []
        ladder = ", ".join(f"{r:g}" for r in self.ratios)
        return f"{' or '.join(triggers) or 'never'} -> r={ladder}"


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) in nats between the softmax distributions of two [vocab] logit vectors."""
    logp = p_logits.float().log_softmax(dim=-1)
    logq = q_logits.float().log_softmax(dim=-1)
    return float((logp.exp() * (logp - logq)).sum().clamp_min(0.0))


def top2_margin(logits: torch.Tensor) -> float:
    """The top-1 minus top-2 probability of the softmax of a [vocab] logit vector."""
    top2 = logits.float().softmax(dim=-1).topk(2).values
    return float(top2[0] - top2[1])


def first_token_signals(
    blend_logits: torch.Tensor,
    reuse_logits: torch.Tensor,
    attention: torch.Tensor,
    chunk_tokens: torch.Tensor,
    recomputed: torch.Tensor,
) -> dict[str, Any]:
    """The risk signals of one blend. logits: [vocab]; attention: [N], the question's mean attention on each token
    in the first pass; chunk_tokens: [N] bool, the chunk tokens; recomputed: the chunk tokens the blend recomputed,
    as an [N] bool mask or an index tensor. Worked out where the tensors are and read back in one transfer."""
    import torch  # loaded already: the tensors are given (the module itself stays free of it)

    device = attention.device
    chunk_tokens = chunk_tokens.to(device)
    if recomputed.dtype != torch.bool:
        recomputed = torch.zeros_like(chunk_tokens).index_fill_(0, recomputed.to(device), True)
    p, q = blend_logits.float().log_softmax(dim=-1), reuse_logits.float().log_softmax(dim=-1)
    on_chunks = (attention * chunk_tokens).sum()
    stale = (attention * (chunk_tokens & ~recomputed.to(device))).sum()
    top_p, top_q = p.exp().topk(2).values, q.exp().topk(2).values
    signals = torch.stack((
        (p.exp() * (p - q)).sum().clamp_min(0.0),
        (p.argmax() == q.argmax()).float(),
        top_p[0] - top_p[1],
        top_q[0] - top_q[1],
        torch.where(on_chunks > 0, stale / on_chunks, torch.zeros_like(on_chunks)),
    )).tolist()  # fmt: skip
    return {
        "kl_reuse": signals[0],
        "agree_reuse": bool(signals[1]),
        "margin": signals[2],
        "reuse_margin": signals[3],
        "stale_attention": signals[4],
    }


def agrees(new_logits: torch.Tensor, old_logits: torch.Tensor, max_kl: float) -> bool:
    """Whether two successive blends agree: the same first token, and KL(new || old) at most `max_kl`."""
    return int(new_logits.argmax()) == int(old_logits.argmax()) and kl(new_logits, old_logits) <= max_kl


class Blended(Protocol):
    """What a blend returns, as far as the guard reads it: the first token's logits ([vocab])."""

    @property
    def logits(self) -> torch.Tensor | None: ...


B = TypeVar("B", bound=Blended)


def escalate(guard: Guard, result: B, ratio: float, blend_at: Callable[[float], B]) -> tuple[B, list[float]]:
    """Blend a risky request again (`blend_at(r)`) at each ratio of the guard's ladder above `ratio`, the ratio
    `result` was blended at, until two successive blends agree (`agrees`) or the ladder ends.
    -> (the last blend, the ratios blended at, in order)"""
    steps: list[float] = []
    for r in guard.ladder(ratio):
        previous = result
        result = blend_at(r)
        steps.append(r)
        assert result.logits is not None and previous.logits is not None, "a blend returns its first token's logits"
        if agrees(result.logits, previous.logits, guard.max_kl):
            break
    return result, steps
