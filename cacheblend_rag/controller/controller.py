"""The loading controller (paper §5.1): pick the recompute ratio from how long loading will take.

With pipelined loading, a request takes about max(recompute time, load time). Recomputing more than the
quality floor costs nothing while loading is the slower of the two, and buys quality; recomputing less than
the floor saves time but loses quality. So per request:

    r = max(r_min, the r at which recompute time equals load time)

And the converse question, for capacity planning: at a fixed r, which tier is the cheapest one to keep chunk
KV in without loading becoming the bottleneck? Tiers are ranked by cost per byte (cheapest first, default:
disk, redis, memory); the answer is the first whose load time fits under the recompute time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConfigError
from .profile import LoadingProfile

# Cost per byte held, cheapest first: local disk, then a shared Redis (RAM, but one copy for every worker),
# then each worker's own memory.
DEFAULT_TIER_COSTS = ("disk", "redis", "memory")


@dataclass(frozen=True)
class RatioDecision:
    ratio: float
    source: str  # "pinned", "controller (quality floor)" or "controller (load time)"
    load_s: float  # estimated time to read the request's chunk KV
    recompute_s: float  # estimated compute at the chosen ratio

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LoadingController:
    """Chooses the recompute ratio per request from a `LoadingProfile`.

    min_ratio:    the quality floor r_min (the paper found ~15% keeps quality within noise of a full prefill).
    pinned_ratio: always use this ratio instead (the controller then only reports estimates).
    tier_costs:   tier names from cheapest to most expensive per byte, for `cheapest_tier`.
    """

    def __init__(
        self,
        profile: LoadingProfile,
        *,
        min_ratio: float = 0.15,
        pinned_ratio: float | None = None,
        tier_costs: Sequence[str] = DEFAULT_TIER_COSTS,
    ) -> None:
        for name, value in (("min_ratio", min_ratio), ("pinned_ratio", pinned_ratio)):
            if value is not None and not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {value}")
        self.profile = profile
        self.min_ratio = min_ratio
        self.pinned_ratio = pinned_ratio
        self.tier_costs = tuple(tier_costs)

    def load_time(self, bytes_by_tier: Mapping[str, int], chunks_by_tier: Mapping[str, int] | None = None) -> float:
        """Estimated time to read the given bytes from each tier (read one after another, as the loader does)."""
        chunks_by_tier = chunks_by_tier or {}
        return sum(
            self.profile.load_time(tier, nbytes, chunks_by_tier.get(tier, 1))
            for tier, nbytes in bytes_by_tier.items()
            if nbytes
        )

    def check_model(self, fingerprint: str, dtype: str) -> None:
        """ConfigError unless the profile was measured for this model (fingerprint) in this dtype."""
        if self.profile.model != fingerprint or self.profile.dtype != dtype:
            raise ConfigError(
                f"the loading profile was measured for model {self.profile.model[:12]} in {self.profile.dtype}, "
                f"this engine runs {fingerprint[:12]} in {dtype}; run `cacheblend-rag profile` for this model "
                f"and dtype"
            )

    def choose_ratio(
        self,
        num_tokens: int,
        bytes_by_tier: Mapping[str, int],
        chunks_by_tier: Mapping[str, int] | None = None,
    ) -> RatioDecision:
        """The ratio for a request of `num_tokens` tokens whose chunk KV sits in the given tiers."""
        load_s = self.load_time(bytes_by_tier, chunks_by_tier)
        if self.pinned_ratio is not None:
            r = self.pinned_ratio
            return RatioDecision(r, "pinned", load_s, self.profile.recompute_time(num_tokens, r))
        hidden = self.profile.ratio_for(num_tokens, load_s)  # recompute this much while loading anyway
        if hidden > self.min_ratio:
            r, source = hidden, "controller (load time)"
        else:
            r, source = self.min_ratio, "controller (quality floor)"
        return RatioDecision(r, source, load_s, self.profile.recompute_time(num_tokens, r))

    def cheapest_tier(
        self, num_tokens: int, nbytes: int, num_chunks: int = 1, ratio: float | None = None
    ) -> str | None:
        """The cheapest profiled tier whose load time for `nbytes` stays within the recompute time at `ratio`
        (default: the quality floor), so serving from it adds no delay. None if no profiled tier is fast enough."""
        r = self.min_ratio if ratio is None else ratio
        budget = self.profile.recompute_time(num_tokens, r)
        ranked = [t for t in self.tier_costs if t in self.profile.tiers]
        ranked += [t for t in self.profile.tiers if t not in ranked]  # unranked tiers last
        for tier in ranked:
            if self.profile.load_time(tier, nbytes, num_chunks) <= budget:
                return tier
        return None
