"""Which model configurations CacheBlend can blend correctly, decided from the config alone.

Scope: pure checks on a `transformers.PretrainedConfig`; nothing here loads weights. Blending reuses each
chunk's keys at a new position by rotating them (RoPE), and concatenates per-layer caches, so a model must
(1) use RoPE whose frequencies do not depend on the sequence length and (2) attend over the whole prefix in
every layer. Families outside the tested set are refused rather than blended silently wrong.
"""

from __future__ import annotations

from typing import Any, Literal

from cacheblend_rag.errors import UnsupportedModelError

__all__ = [
    "SUPPORTED_FAMILIES",
    "SUPPORTED_ROPE_TYPES",
    "ModelFamily",
    "check_supported",
    "max_blend_length",
    "model_family",
]

ModelFamily = Literal["llama", "mistral", "qwen2", "qwen3"]

SUPPORTED_FAMILIES: frozenset[str] = frozenset({"llama", "mistral", "qwen2", "qwen3"})

# Each of these multiplies the angle by a per-dimension constant, so moving a cached key from position p
# to p' is one more rotation by (p' - p). "dynamic" and "longrope" pick their frequencies from the current
# sequence length, so a key cached under one length cannot be re-positioned for another.
SUPPORTED_ROPE_TYPES: frozenset[str] = frozenset({"default", "linear", "llama3", "yarn"})

_WHAT_WORKS = "Use a Llama, Mistral, Qwen2 or Qwen3 checkpoint with full attention, e.g. a preset."


def model_family(config: Any) -> ModelFamily:
    """Return the model family (`config.model_type`) if CacheBlend supports it, else raise.

    The engine dispatches on this value (Qwen3 normalises q/k per head, the others do not).
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported: CacheBlend re-positions cached keys with RoPE "
            f"and is tested only on {sorted(SUPPORTED_FAMILIES)}; other families use other position "
            f"schemes (learned, ALiBi) or mixed attention layers. {_WHAT_WORKS}"
        )
    return model_type  # type: ignore[return-value]  # narrowed by the membership test above


def _rope_type(config: Any) -> str:
    # transformers 5.x keeps RoPE settings in `rope_parameters`; older configs used `rope_scaling`,
    # where None meant plain RoPE and the key was sometimes "type" instead of "rope_type".
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = getattr(config, "rope_scaling", None)
    if not params:
        return "default"
    return str(params.get("rope_type", params.get("type", "default")))


def check_supported(config: Any) -> None:
    """Raise `UnsupportedModelError` if blending this model's caches would give wrong results."""
    family = model_family(config)

    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({kind for kind in layer_types if kind != "full_attention"})
    if other:
        hint = " (set use_sliding_window=False)" if family in {"qwen2", "qwen3"} else ""
        raise UnsupportedModelError(
            f"{family} model has layer types {other} besides full_attention: sliding-window or hybrid "
            f"layers keep only part of the prefix, so per-chunk caches cannot be concatenated. "
            f"Use a config whose layers are all full_attention{hint}."
        )

    rope_type = _rope_type(config)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{family} model uses RoPE type {rope_type!r}, whose frequencies change with the sequence "
            f"length, so cached keys cannot be moved to new positions. Supported RoPE types: "
            f"{sorted(SUPPORTED_ROPE_TYPES)}; drop the rope scaling or pick a checkpoint without it."
        )


def max_blend_length(config: Any) -> int | None:
    """Longest prompt (in tokens) a blended request may have, or None when attention is unlimited.

    Mistral applies its sliding window to every layer through the attention mask; within the window it
    is plain causal attention, so blending is exact as long as the whole prompt fits inside it.
    """
    family = model_family(config)
    if family == "mistral":
        window = getattr(config, "sliding_window", None)
        return int(window) if window is not None else None
    # Other families mark windowed layers in `layer_types`, which `check_supported` already refuses.
    return None
