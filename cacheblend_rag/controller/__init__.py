"""The loading controller (paper §5.1) and the offline profile it reads; the fidelity profile that fits the
quality floor and the guard to a user's own questions."""

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
