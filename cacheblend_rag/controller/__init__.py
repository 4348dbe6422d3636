"""The loading controller (paper §5.1) and the offline profile it reads."""

from .controller import DEFAULT_TIER_COSTS, LoadingController, RatioDecision
from .profile import ComputePoint, LoadingProfile, TierSpeed, profile_engine

__all__ = [
    "DEFAULT_TIER_COSTS",
    "ComputePoint",
    "LoadingController",
    "LoadingProfile",
    "RatioDecision",
    "TierSpeed",
    "profile_engine",
]
