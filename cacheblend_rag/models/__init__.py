"""Models: packaged presets, loading (GGUF -> cached safetensors), support checks and the layer-wise adapter."""

from __future__ import annotations

from typing import Any

from .adapter import LayerwiseModel, causal_mask, rotate_keys, unrotate_keys
from .presets import DEFAULT_PRESET, PRESETS, ModelPreset, default_model
from .support import check_supported, max_blend_length, model_family


def load_model(*args: Any, **kwargs: Any):
    """Load a preset or a local checkpoint; see `cacheblend_rag.models.loader.load_model`."""
    from .loader import load_model as _load

    return _load(*args, **kwargs)


__all__ = [
    "DEFAULT_PRESET",
    "PRESETS",
    "LayerwiseModel",
    "ModelPreset",
    "causal_mask",
    "default_model",
    "check_supported",
    "load_model",
    "max_blend_length",
    "model_family",
    "rotate_keys",
    "unrotate_keys",
]
