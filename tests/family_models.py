"""Tiny random models of each decoder family, built from the family's own `transformers` config class.

Four layers, hidden size 64, 4 query heads over 2 KV heads, sliding windows of `WINDOW` tokens (with full layers
between them where the family interleaves them), so that a prompt of a few hundred tokens is past every window.
Weights are drawn from a seed and scaled up (as `cacheblend_rag.testing.make_tiny_model` does), so that a wrong
mask, norm or rotation shows in the logits.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from cacheblend_rag.testing import EOS_ID, VOCAB_SIZE

WINDOW = 64  # tokens: the sliding window (and Llama 4's attention chunk) of every windowed family
_MIXED = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]  # windowed and full
_MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}

# family -> (config class name, settings beyond the common ones)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", {"head_dim": 16, "use_sliding_window": False}),
    "phi3": ("Phi3Config", {"sliding_window": None}),
    "granite": (
        "GraniteConfig",
        {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2, "logits_scaling": 4.0},
    ),  # fmt: skip
    "olmo2": ("Olmo2Config", {}),
    "olmo3": ("Olmo3Config", {"sliding_window": WINDOW, "layer_types": _MIXED}),
    "smollm3": ("SmolLM3Config", {"no_rope_layers": [1, 1, 1, 0], "use_sliding_window": False}),
    "gemma": ("GemmaConfig", {"head_dim": 16}),
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "layer_types": _MIXED,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
        },
    ),  # fmt: skip
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": WINDOW, "layer_types": _MIXED}),
    "gemma4_text": ("Gemma4TextConfig", {"head_dim": 16, "sliding_window": WINDOW, "layer_types": _MIXED}),
    "cohere2": ("Cohere2Config", {"sliding_window": WINDOW, "layer_types": _MIXED}),
    "ministral3": ("Ministral3Config", {"sliding_window": WINDOW}),
    "exaone4": ("Exaone4Config", {"sliding_window": WINDOW, "layer_types": _MIXED}),
    "mixtral": ("MixtralConfig", {**_MOE, "sliding_window": None}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),  # fmt: skip
    "gpt_oss": (
        "GptOssConfig",
        {
            **_MOE,
            "head_dim": 16,
            "sliding_window": WINDOW,
            "layer_types": _MIXED,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),  # fmt: skip
    "llama4_text": (
        "Llama4TextConfig",
        {"head_dim": 16, "attention_chunk_size": WINDOW, "num_local_experts": 4, "intermediate_size_mlp": 128},
    ),  # fmt: skip
}

# Families whose layers are not all attention, and multi-head latent attention: refused, never blended.
REFUSED: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_next": ("Qwen3NextConfig", {}),
    "qwen3_5_text": ("Qwen3_5TextConfig", {}),
    "granitemoehybrid": ("GraniteMoeHybridConfig", {}),
    "lfm2": ("Lfm2Config", {}),
    "deepseek_v3": ("DeepseekV3Config", {}),
}

# transformers runs these families' attention only in its eager implementation (soft-capping, attention sinks)
_EAGER = {"gemma2", "gpt_oss"}


def family_config(family: str) -> Any:
    """The tiny config of `family` (from FAMILIES or REFUSED), with every layer's window at `WINDOW` tokens."""
    class_name, extra = {**FAMILIES, **REFUSED}[family]
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0,
                  bos_token_id=1, eos_token_id=EOS_ID, tie_word_embeddings=False)  # fmt: skip
    config = getattr(transformers, class_name)(**{**common, **extra})
    config._attn_implementation = "eager" if family in _EAGER else "sdpa"
    return config


def family_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random `*ForCausalLM` of `family` in float32, eval mode; the same seed gives the same weights."""
    config = family_config(family)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed" in name:
                p.normal_(0, 1.0)
            elif p.dim() == 2 and "router" not in name and "gate.weight" not in name:
                p.mul_(6.0)
    return model.eval()
