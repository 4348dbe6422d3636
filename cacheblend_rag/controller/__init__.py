"""The loading controller (paper §5.1) and the offline profile it reads; the fidelity profile that fits the
quality floor and the guard to a user's own questions.

The names below load their module on first use: measuring (`calibration`, `profile_engine`) imports the engine and
torch, which reading a profile or building the command line's parser does not need.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .calibration import SampleQuestion, check_grid, measure_fidelity
    from .controller import DEFAULT_TIER_COSTS, LoadingController, RatioDecision
    from .fidelity_choice import Estimate, FidelityChoice, HeldBackCheck, Setting, Targets
    from .fidelity_profile import FidelityProfile
    from .profile import ComputePoint, LoadingProfile, TierSpeed, profile_engine

_MODULES = {
    ".calibration": ("SampleQuestion", "check_grid", "measure_fidelity"),
    ".controller": ("DEFAULT_TIER_COSTS", "LoadingController", "RatioDecision"),
    ".fidelity_choice": ("Estimate", "FidelityChoice", "HeldBackCheck", "Setting", "Targets"),
    ".fidelity_profile": ("FidelityProfile",),
    ".profile": ("ComputePoint", "LoadingProfile", "TierSpeed", "profile_engine"),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}

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
assert sorted(__all__) == sorted(_LAZY)


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
