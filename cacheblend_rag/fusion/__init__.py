"""The fusion step of CacheBlend: token selection and the blended, layer-by-layer prefill."""

from .fusor import FusionPlan, FusionResult, LayerLoader, attention_mask, fuse
from .selection import (
    anchor_counts,
    budget,
    keep_counts,
    select_recompute_tokens,
    token_deviation,
    top_scored,
)

__all__ = [
    "FusionPlan",
    "FusionResult",
    "LayerLoader",
    "anchor_counts",
    "attention_mask",
    "budget",
    "fuse",
    "keep_counts",
    "select_recompute_tokens",
    "token_deviation",
    "top_scored",
]
