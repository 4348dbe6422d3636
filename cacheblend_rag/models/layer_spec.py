"""Where a decoder family's layers differ, read from the model's own modules and config: one `LayerSpec` per layer.

The families `support.py` accepts differ from Llama's layer in a few lines of their `modeling_*.py`, each read here
once, when the adapter is built, from the modules and config the model carries:
- norms: where they sit (Llama: before attention and before the MLP; Gemma 2/3: also after each; OLMo 2/3 and
  Exaone 4: only after each), run as the model's own modules (Gemma's `1 + weight` is its module's business);
- q/k norms: per head (Qwen3, Gemma 3, Exaone 4) or over the whole projection (OLMo 2/3), before RoPE;
- projections: separate q/k/v, or Phi-3's one `qkv_proj`;
- positions: each layer's block of the RoPE tables (Gemma 3's local and global bases), or none (SmolLM3's
  `no_rope_layers`, Exaone 4's global layers);
- masks: a sliding window per layer (`layer_types`, or one window over every layer: Mistral, Ministral 3, Phi-3);
- softmax: logit soft-capping (Gemma 2) and attention sinks (GPT-OSS);
- scalings: Granite's embedding, residual and logits multipliers; Gemma 2's final logit soft-capping.
The MLP, dense or a mixture of experts, is the layer's own module, run as it is.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer does beyond Llama's, as the adapter runs it."""

    window: int | None  # a key at position j is seen from position i iff i - window < j <= i; None: every j <= i
    rope_block: int  # which block of the model's RoPE tables rotates this layer's queries and keys
    qk_norm: Literal["none", "head", "whole"]  # q/k norm per head, over the whole projection, or none
    input_norm: nn.Module | None  # before attention
    attn_out_norm: nn.Module | None  # on the attention's output, before the residual
    mlp_norm: nn.Module | None  # before the MLP
    mlp_out_norm: nn.Module | None  # on the MLP's output, before the residual
    residual_scale: float  # the branches' outputs are scaled by this before the residual (Granite)
    softcap: float | None  # attention scores become softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None  # [H]: one extra logit per head in the softmax, whose weight goes nowhere


@dataclass(frozen=True)
class ModelSpec:
    family: str
    layers: tuple[LayerSpec, ...]
    rope_kinds: tuple[str | None, ...]  # per block of the RoPE tables: the layer type the rotary module is asked
    # for (None: its only kind), or "none": no rotation
    fused_qkv: bool  # the attention's own projection gives queries, keys and values side by side (`qkv_proj`)
    dense_mlp: bool  # every MLP is Llama's (gate, up and down projections); else run on a batch of one (experts)
    embed_scale: float  # Granite's embedding multiplier (Gemma's scale is inside its embedding module)
    logits_divisor: float  # logits are divided by this (Granite's logits_scaling)
    logits_softcap: float | None  # Gemma 2's final soft-capping

    @property
    def llama_like(self) -> bool:
        """Whether every layer is a Llama layer: what the fast paths (fused QKV, int8 decode weights, CUDA graphs,
        the slot pool's fused kernel) are written for."""
        return (not self.fused_qkv and self.dense_mlp and self.embed_scale == 1.0 and self.logits_divisor == 1.0
                and self.logits_softcap is None and all(_plain(layer) for layer in self.layers))  # fmt: skip


def _plain(layer: LayerSpec) -> bool:
    return (layer.window is None and layer.rope_block == 0 and layer.attn_out_norm is None and layer.mlp_out_norm is
            None and layer.residual_scale == 1.0 and layer.softcap is None and layer.sinks is None)  # fmt: skip


def _dense(mlp: nn.Module) -> bool:
    return all(isinstance(getattr(mlp, name, None), nn.Linear) for name in ("gate_proj", "up_proj", "down_proj"))


def _windows(config: Any, num_layers: int) -> list[int | None]:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # one window over every layer, or none (Mistral, Ministral 3, Phi-3, Mixtral)
        return [None if window is None else int(window)] * num_layers
    return [int(window) if kind == "sliding_attention" and window is not None else None for kind in layer_types]


def _uses_rope(config: Any, attn: nn.Module, layer_idx: int) -> bool:
    if hasattr(attn, "use_rope"):  # SmolLM3: `no_rope_layers`
        return bool(attn.use_rope)
    if config.model_type == "exaone4" and getattr(config, "sliding_window", None) is not None:
        return config.layer_types[layer_idx] == "sliding_attention"  # its global layers have no RoPE
    return True


def _norms(layer: nn.Module) -> tuple[nn.Module | None, nn.Module | None, nn.Module | None, nn.Module | None]:
    """(input, attention output, MLP input, MLP output) norms of a layer, from the norm modules it has."""
    names = {name for name, _ in layer.named_children()}
    around = {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"}
    if around <= names:
        return (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                layer.post_feedforward_layernorm)  # fmt: skip  # Gemma 2/3: around each branch
    if "input_layernorm" not in names and {"post_attention_layernorm", "post_feedforward_layernorm"} <= names:
        return None, layer.post_attention_layernorm, None, layer.post_feedforward_layernorm  # OLMo 2/3, Exaone 4
    if {"input_layernorm", "post_attention_layernorm"} <= names and not names & {
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    }:
        return layer.input_layernorm, None, layer.post_attention_layernorm, None  # Llama: before each branch
    raise UnsupportedModelError(f"{type(layer).__name__} has norms {sorted(n for n in names if 'norm' in n)}, in an "
                                "order the adapter does not read")  # fmt: skip


def _qk_norm(attn: nn.Module, head_dim: int) -> Literal["none", "head", "whole"]:
    q_norm = getattr(attn, "q_norm", None)
    if q_norm is None:
        return "none"
    width = q_norm.weight.shape[-1]
    return "head" if width == head_dim else "whole"


def read_spec(model: nn.Module) -> ModelSpec:
    """The `ModelSpec` of a `*ForCausalLM` of a family `support.check_supported` accepts."""
    config, base = model.config, model.model
    layer_types = getattr(config, "layer_types", None)
    per_type_rope = "layer_type" in inspect.signature(base.rotary_emb.forward).parameters
    kinds: list[str | None] = []
    layers = []
    for idx, (layer, window) in enumerate(zip(base.layers, _windows(config, len(base.layers)), strict=True)):
        attn = layer.self_attn
        kind = "none" if not _uses_rope(config, attn, idx) else layer_types[idx] if per_type_rope else None
        if kind not in kinds:
            kinds.append(kind)
        input_norm, attn_out_norm, mlp_norm, mlp_out_norm = _norms(layer)
        softcap = getattr(attn, "attn_logit_softcapping", None)
        layers.append(LayerSpec(
            window=window, rope_block=kinds.index(kind), qk_norm=_qk_norm(attn, attn.head_dim),
            input_norm=input_norm, attn_out_norm=attn_out_norm, mlp_norm=mlp_norm, mlp_out_norm=mlp_out_norm,
            residual_scale=float(getattr(layer, "residual_multiplier", 1.0)),
            softcap=None if softcap is None else float(softcap), sinks=getattr(attn, "sinks", None),
        ))  # fmt: skip
    logits_scaling = getattr(config, "logits_scaling", None)
    softcap = getattr(config, "final_logit_softcapping", None)
    return ModelSpec(
        family=config.model_type,
        layers=tuple(layers),
        rope_kinds=tuple(kinds),
        fused_qkv=hasattr(base.layers[0].self_attn, "qkv_proj"),
        dense_mlp=all(_dense(layer.mlp) for layer in base.layers),
        embed_scale=float(getattr(config, "embedding_multiplier", 1.0)),
        logits_divisor=1.0 if logits_scaling is None else float(logits_scaling),
        logits_softcap=None if softcap is None else float(softcap),
    )
