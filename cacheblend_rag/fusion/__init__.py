"""The fusion step of CacheBlend: token selection and the blended, layer-by-layer prefill."""

from .fusor import FusionPlan, FusionResult, attention_mask, fuse, logits_of
from .layer_events import LayerEvents, Watcher
from .layer_rows import EagerLayerSteps, GraphedLayerSteps, LayerRows, LayerSteps, bucket_rows
from .prompt_kv import LayerLoader, PromptKV
from .selection import (
    anchor_counts,
    budget,
    keep_counts,
    select_recompute_tokens,
    token_deviation,
    top_scored,
)

__all__ = [
    "EagerLayerSteps",
    "FusionPlan",
    "FusionResult",
    "GraphedLayerSteps",
    "LayerEvents",
    "LayerLoader",
    "LayerRows",
    "LayerSteps",
    "PromptKV",
    "anchor_counts",
    "attention_mask",
    "budget",
    "bucket_rows",
    "fuse",
    "keep_counts",
    "logits_of",
    "select_recompute_tokens",
    "token_deviation",
    "top_scored",
    "Watcher",
]
