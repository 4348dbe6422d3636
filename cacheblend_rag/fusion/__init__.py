"""The fusion step of CacheBlend: token selection and the blended, layer-by-layer prefill."""

from .fusor import FusionPlan, FusionResult, LayerLoader, fuse
from .selection import keep_counts, select_recompute_tokens, token_deviation

__all__ = [
    "FusionPlan",
    "FusionResult",
    "LayerLoader",
    "fuse",
    "keep_counts",
    "select_recompute_tokens",
    "token_deviation",
]
