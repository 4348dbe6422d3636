"""Which tokens to recompute: KV deviation per token, chunk-start anchors, top-k of a score.

Pure functions on tensors and counts, so the selection rules can be tested without a model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import ConfigError


def token_deviation(
    fresh: torch.Tensor,
    cached: torch.Tensor,
) -> torch.Tensor:
    """Squared L2 distance between the fresh and cached keys (or values) of each token, summed over heads and dims.

    Inputs: [Hkv, T, D] (keys raw, before RoPE: a rotation preserves L2 distances, so raw and rotated keys rank
    tokens identically). Returns [T] in float32.
    """
    return (fresh.float() - cached.float()).pow(2).sum(dim=(0, 2))  # [T]


def select_recompute_tokens(deviation: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` largest deviations, in ascending index order. deviation: [T] -> [count]"""
    if count < 0:
        raise ConfigError(f"count must be >= 0, got {count}")
    count = min(count, deviation.shape[0])
    top = torch.topk(deviation, count, sorted=False).indices
    return torch.sort(top).values


def budget(num_reused: int, ratio: float) -> int:
    """Reused tokens recomputed at ratio r: rounded up, so any r above zero recomputes at least one token."""
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"ratio must be in [0, 1], got {ratio}")
    return min(num_reused, math.ceil(ratio * num_reused - 1e-9))


def keep_counts(num_reused: int, ratios: Sequence[float]) -> tuple[int, ...]:
    """Number of reused tokens kept after each check layer for the given ratio schedule: each ratio's `budget`,
    made non-increasing."""
    counts: list[int] = []
    for r in ratios:
        c = budget(num_reused, r)
        counts.append(c if not counts else min(c, counts[-1]))
    return tuple(counts)


def anchor_counts(chunk_lengths: Sequence[int], ratio: float) -> tuple[int, ...]:
    """How many leading tokens of each chunk the "epic" rule recomputes: each chunk's share of the budget in
    proportion to its length (rounded up while r is above zero), never more than the budget holds in all."""
    total = budget(sum(chunk_lengths), ratio)
    counts, used = [], 0
    for n in chunk_lengths:
        c = min(budget(n, ratio), total - used)
        counts.append(max(c, 0))
        used += counts[-1]
    return tuple(counts)


def top_scored(scores: torch.Tensor, candidates: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` candidates with the highest scores. scores: [N]; candidates: [C] indices -> [count] sorted."""
    if candidates.numel() == 0 or count <= 0:
        return candidates[:0]
    return candidates[select_recompute_tokens(scores[candidates], count)]
