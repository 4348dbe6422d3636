"""Models: packaged presets, loading (GGUF -> cached safetensors), support checks and the layer-wise adapter."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..cpu import cpu_has_bf16  # torch-free, beside the package's settings
from ..lazy_exports import lazy_getattr
from .presets import DEFAULT_PRESET, PRESETS, ModelPreset, default_model
from .support import check_supported, max_blend_length, model_family

if TYPE_CHECKING:
    from .adapter import LayerwiseModel, causal_mask, rotate_keys, unrotate_keys

# The adapter imports torch: it loads on first use, so the presets (`cacheblend-rag models`) are read without it.
__getattr__ = lazy_getattr(
    __name__, globals(), {".adapter": ("LayerwiseModel", "causal_mask", "rotate_keys", "unrotate_keys")}
)


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
    "cpu_has_bf16",
    "default_model",
    "check_supported",
    "load_model",
    "max_blend_length",
    "model_family",
    "rotate_keys",
    "unrotate_keys",
]
