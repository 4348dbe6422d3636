"""The loading controller (paper §5.1) and the offline profile it reads; the fidelity profile that fits the
quality floor and the guard to a user's own questions.

The names below load their module on first use: measuring (`calibration`, `profile_engine`) imports the engine and
torch, which reading a profile or building the command line's parser does not need.
"""

from typing import TYPE_CHECKING

from ..lazy_exports import lazy_getattr

if TYPE_CHECKING:
    from .calibration import SampleQuestion, check_grid, measure_fidelity
    from .controller import DEFAULT_TIER_COSTS, LoadingController, RatioDecision
    from .fidelity_choice import Estimate, FidelityChoice, HeldBackCheck, Setting, Targets
    from .fidelity_profile import FidelityProfile
    from .profile import ComputePoint, LoadingProfile, TierSpeed, profile_engine

__all__ = [
    "DEFAULT_TIER_COSTS",
    "ComputePoint",
    "Estimate",
    "FidelityChoice",
    "FidelityProfile",
    "HeldBackCheck",
    "LoadingController",
    "LoadingProfile",
    "RatioDecision",
    "SampleQuestion",
    "Setting",
    "Targets",
    "TierSpeed",
    "check_grid",
    "measure_fidelity",
    "profile_engine",
]
__getattr__ = lazy_getattr(
    __name__,
    globals(),
    {
        ".calibration": ("SampleQuestion", "check_grid", "measure_fidelity"),
        ".controller": ("DEFAULT_TIER_COSTS", "LoadingController", "RatioDecision"),
        ".fidelity_choice": ("Estimate", "FidelityChoice", "HeldBackCheck", "Setting", "Targets"),
        ".fidelity_profile": ("FidelityProfile",),
        ".profile": ("ComputePoint", "LoadingProfile", "TierSpeed", "profile_engine"),
    },
)
