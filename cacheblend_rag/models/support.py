"""Which model configurations CacheBlend can blend correctly, decided from the config alone.

Scope: pure checks on a `transformers.PretrainedConfig`; nothing here loads weights. Blending reuses each
chunk's keys at a new position by rotating them (RoPE), and lays per-layer caches end to end, so every layer must
be attention over a KV cache (no recurrent state), with RoPE whose frequencies do not depend on the sequence length
(or no RoPE at all on that layer). The families below are tested one by one (`tests/test_families.py`): a full
prefill equals the model's own forward, a blend recomputing every token equals it, one recomputing none equals full
KV reuse. Families outside that set are refused before anything is loaded, with the reason.
"""

from __future__ import annotations

from typing import Any

from cacheblend_rag.errors import UnsupportedModelError

__all__ = [
    "SUPPORTED_FAMILIES",
    "SUPPORTED_LAYER_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "check_supported",
    "max_blend_length",
    "model_family",
]

SUPPORTED_FAMILIES: frozenset[str] = frozenset({
    "llama", "mistral", "ministral3", "qwen2", "qwen3", "phi3", "granite", "olmo2", "olmo3", "smollm3", "gemma",
    "gemma2", "gemma3_text", "exaone4", "mixtral", "qwen3_moe", "gpt_oss",
})  # fmt: skip

# A windowed layer attends within its window, in the recompute and in decoding alike (`layer_spec.LayerSpec.window`).
SUPPORTED_LAYER_TYPES: frozenset[str] = frozenset({"full_attention", "sliding_attention"})

# Each of these multiplies the angle by a per-dimension constant, so moving a cached key from position p
# to p' is one more rotation by (p' - p). "dynamic" and "longrope" pick their frequencies from the current
# sequence length, so a key cached under one length cannot be re-positioned for another.
SUPPORTED_ROPE_TYPES: frozenset[str] = frozenset({"default", "linear", "llama3", "yarn"})

# Layers that are not attention keep a running state that depends on every token before them: a chunk's state
# computed alone cannot be placed after other chunks, and no part of it can be recomputed on its own.
_NOT_ATTENTION: dict[str, str] = {
    "qwen3_next": "linear attention (Gated DeltaNet)",
    "qwen3_5": "linear attention (Gated DeltaNet)",
    "qwen3_5_text": "linear attention (Gated DeltaNet)",
    "qwen3_5_moe": "linear attention (Gated DeltaNet)",
    "qwen3_5_moe_text": "linear attention (Gated DeltaNet)",
    "granitemoehybrid": "Mamba-2 state-space layers",
    "falcon_h1": "Mamba-2 state-space layers",
    "bamba": "Mamba-2 state-space layers",
    "jamba": "Mamba state-space layers",
    "nemotron_h": "Mamba-2 state-space layers",
    "zamba": "Mamba state-space layers",
    "zamba2": "Mamba-2 state-space layers",
    "mamba": "state-space layers",
    "mamba2": "state-space layers",
    "lfm2": "short convolution layers",
    "lfm2_moe": "short convolution layers",
    "recurrent_gemma": "recurrent (RG-LRU) layers",
    "rwkv": "recurrent (RWKV) layers",
}
_NOT_ATTENTION_LAYER_TYPES = frozenset({"linear_attention", "mamba", "conv", "recurrent"})

# Families that are attention over a KV cache, but whose cache or positions differ from what the adapter reads.
_NOT_YET: dict[str, str] = {
    "deepseek_v2": "multi-head latent attention (MLA) caches a compressed latent and a separate rotary key, not "
    "per-head keys and values",
    "deepseek_v3": "multi-head latent attention (MLA) caches a compressed latent and a separate rotary key, not "
    "per-head keys and values",
    "kimi_k2": "multi-head latent attention (MLA) caches a compressed latent and a separate rotary key, not "
    "per-head keys and values",
    "gemma4_text": "its layers share KV caches across layers, add per-layer token embeddings and norm the values, "
    "and its global layers use proportional partial RoPE",
    "cohere2": "it rotates interleaved channel pairs and runs attention and the MLP in parallel from one LayerNorm",
    "llama4_text": "its chunked-attention layers, complex-valued RoPE and position-dependent query temperature on "
    "its NoPE layers are not read by the adapter yet",
}

_WHAT_WORKS = (
    "Use a checkpoint of a supported family (" + ", ".join(sorted(SUPPORTED_FAMILIES)) + "), e.g. a preset; "
    "docs/configuration.md lists what each family needs."
)


def _layer_types(config: Any) -> list[str]:
    return list(getattr(config, "layer_types", None) or [])


def model_family(config: Any) -> str:
    """Return the model family (`config.model_type`) if CacheBlend supports it, else raise `UnsupportedModelError`
    that says why."""
    model_type = getattr(config, "model_type", None)
    not_attention = _NOT_ATTENTION.get(str(model_type))
    if not_attention is None and _NOT_ATTENTION_LAYER_TYPES & set(_layer_types(config)):
        not_attention = "layers of types " + str(sorted(_NOT_ATTENTION_LAYER_TYPES & set(_layer_types(config))))
    if not_attention is not None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} cannot be blended: it has {not_attention} besides attention, whose running "
            f"state depends on every earlier token, so a chunk's state computed alone cannot be reused after other "
            f"chunks, nor a few of its tokens recomputed. {_WHAT_WORKS}"
        )
    if model_type in _NOT_YET:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported yet: {_NOT_YET[model_type]}. "
                                    f"{_WHAT_WORKS}")  # fmt: skip
    if model_type not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported: CacheBlend re-positions cached keys with RoPE and reads "
            f"each family's layer structure, tested family by family; other families use other position schemes "
            f"(learned, ALiBi) or layers the adapter does not read. {_WHAT_WORKS}"
        )
    return str(model_type)


def _rope_parameters(config: Any) -> list[dict[str, Any]]:
    """The RoPE settings of every layer type: transformers 5.x keeps them in `rope_parameters` (one dict, or one per
    layer type); older configs used `rope_scaling`, where None meant plain RoPE and the key was sometimes "type"."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = getattr(config, "rope_scaling", None)
    if not params:
        return [{}]
    if all(isinstance(v, dict) for v in params.values()):
        return list(params.values())
    return [params]


def check_supported(config: Any) -> None:
    """Raise `UnsupportedModelError` if blending this model's caches would give wrong results."""
    family = model_family(config)

    other = sorted(set(_layer_types(config)) - SUPPORTED_LAYER_TYPES)
    if other:
        raise UnsupportedModelError(
            f"{family} model has layer types {other}, which the adapter does not read: use a config whose "
            f"layers are all of {sorted(SUPPORTED_LAYER_TYPES)} (Qwen2/Qwen3: use_sliding_window=False)."
        )
    for params in _rope_parameters(config):
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"{family} model uses RoPE type {rope_type!r}, whose frequencies change with the sequence "
                f"length, so cached keys cannot be moved to new positions. Supported RoPE types: "
                f"{sorted(SUPPORTED_ROPE_TYPES)}; drop the rope scaling or pick a checkpoint without it."
            )
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if partial is not None and float(partial) != 1.0:
            raise UnsupportedModelError(
                f"{family} model rotates only part of each head (partial_rotary_factor={partial}), which the "
                f"adapter's key rotation does not cover yet; use a checkpoint that rotates whole heads."
            )


def max_blend_length(config: Any) -> int | None:
    """Longest prompt (in tokens) a blended request may have, or None when only the model's positions bound it.

    Ministral 3 scales its queries by 1 + beta * log(1 + floor(position / original context)): exactly 1 within the
    original context, which is where the adapter (whose queries are not scaled) equals the model."""
    model_family(config)
    params = _rope_parameters(config)[0]
    if params.get("llama_4_scaling_beta"):
        return int(params["original_max_position_embeddings"])
    return None
