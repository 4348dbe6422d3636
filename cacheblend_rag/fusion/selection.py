"""Which tokens to recompute: KV deviation per token, question attention per token, chunk-start anchors, top-k.

Pure functions on tensors and counts, so the selection rules can be tested without a model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import ConfigError


def token_deviation(
    fresh_keys: torch.Tensor,
    cached_keys: torch.Tensor,
    fresh_values: torch.Tensor,
    cached_values: torch.Tensor,
    kind: str = "key",
) -> torch.Tensor:
    """Squared L2 distance between fresh and cached KV of each token, summed over heads and head dims.

    All inputs: [Hkv, T, D] (keys raw, before RoPE: a rotation preserves L2 distances, so raw and rotated keys
    rank tokens identically). Returns [T] in float32.
    kind: "key", "value", or "both" (each normalized by its mean over tokens, then added, so neither
    dominates only because its scale is larger).
    """
    if kind not in ("key", "value", "both"):
        raise ConfigError(f"deviation kind must be 'key', 'value' or 'both', got {kind!r}")

    def sq_dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a.float() - b.float()).pow(2).sum(dim=(0, 2))  # [T]

    if kind == "key":
        return sq_dist(fresh_keys, cached_keys)
    if kind == "value":
        return sq_dist(fresh_values, cached_values)
    dk = sq_dist(fresh_keys, cached_keys)
    dv = sq_dist(fresh_values, cached_values)
    eps = torch.finfo(torch.float32).tiny
    return dk / (dk.mean() + eps) + dv / (dv.mean() + eps)


def select_recompute_tokens(deviation: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` largest deviations, in ascending index order. deviation: [T] -> [count]"""
    if count < 0:
        raise ConfigError(f"count must be >= 0, got {count}")
    count = min(count, deviation.shape[0])
    top = torch.topk(deviation, count, sorted=False).indices
    return torch.sort(top).values


def keep_counts(num_reused: int, ratios: Sequence[float]) -> tuple[int, ...]:
    """Number of reused tokens kept after each check layer for the given ratio schedule.

    Rounded up, so that any ratio above zero recomputes at least one token, and made non-increasing.
    """
    counts: list[int] = []
    for r in ratios:
        if not 0.0 <= r <= 1.0:
            raise ConfigError(f"ratios must be in [0, 1], got {r}")
        c = min(num_reused, math.ceil(r * num_reused - 1e-9))
        counts.append(c if not counts else min(c, counts[-1]))
    return tuple(counts)


def budget(num_reused: int, ratio: float) -> int:
    """Reused tokens recomputed at ratio r: rounded up, so any r above zero recomputes at least one token."""
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"ratio must be in [0, 1], got {ratio}")
    return min(num_reused, math.ceil(ratio * num_reused - 1e-9))


def anchor_counts(chunk_lengths: Sequence[int], ratio: float, share: float) -> tuple[int, ...]:
    """How many leading tokens of each chunk are recomputed as anchors.

    `share` of the ratio's budget goes to chunk starts, each chunk in proportion to its length (rounded up while
    `share * ratio` is above zero), never more than the chunk or the whole budget holds.
    """
    if not 0.0 <= share <= 1.0:
        raise ConfigError(f"anchor share must be in [0, 1], got {share}")
    total = budget(sum(chunk_lengths), ratio)
    counts, used = [], 0
    for n in chunk_lengths:
        c = min(n, math.ceil(share * ratio * n - 1e-9), total - used)
        counts.append(max(c, 0))
        used += counts[-1]
    return tuple(counts)


def top_scored(scores: torch.Tensor, candidates: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` candidates with the highest scores. scores: [N]; candidates: [C] indices -> [count] sorted."""
    if candidates.numel() == 0 or count <= 0:
        return candidates[:0]
    return candidates[select_recompute_tokens(scores[candidates], count)]


def chunk_quotas(sizes: Sequence[int], count: int) -> tuple[int, ...]:
    """Split `count` picks over groups of `sizes` candidates in proportion to their sizes (largest remainders
    get the leftover picks, earlier groups first on ties); no group gets more than it holds."""
    total = sum(sizes)
    if count < 0 or any(n < 0 for n in sizes):
        raise ConfigError(f"count and sizes must be >= 0, got {count} and {list(sizes)}")
    count = min(count, total)
    if count == 0:
        return tuple(0 for _ in sizes)
    exact = [count * n / total for n in sizes]
    quotas = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (quotas[i] - exact[i], i))
    for i in by_remainder[: count - sum(quotas)]:
        quotas[i] += 1
    return tuple(quotas)


def top_scored_per_group(
    scores: torch.Tensor, candidates: torch.Tensor, groups: torch.Tensor, count: int
) -> torch.Tensor:
    """`count` candidates, each group (e.g. chunk) taking its length-proportional quota of its own best.

    scores: [N]; candidates: [C] indices, ascending; groups: [C] group id of each candidate -> [count] sorted.
    Query attention favours the last chunk (recency): ranking inside each chunk keeps it from taking most of
    the budget when the question needs every chunk (a summary) or attention mass is not relevance.
    """
    _, sizes = torch.unique_consecutive(groups, return_counts=True)
    picks, start = [], 0
    for quota, size in zip(chunk_quotas(sizes.tolist(), count), sizes.tolist(), strict=True):
        picks.append(top_scored(scores, candidates[start : start + size], quota))
        start += size
    return torch.sort(torch.cat(picks)).values if picks else candidates[:0]
