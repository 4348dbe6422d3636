"""Layer-wise access to a Hugging Face decoder of a supported family (`support.py`) for selective recompute.

`transformers` runs a whole layer on a whole sequence. CacheBlend needs finer steps: project K/V for some tokens,
compare them with cached ones, then run attention and the MLP for a *subset* of query tokens against the full
(partly cached) K/V. `LayerwiseModel` exposes those steps over the model's own modules and weights, so the
arithmetic is the model's; only the order of work changes. Where a family's layer differs from Llama's (norms,
q/k norms, windows, RoPE per layer, soft-capping, sinks, multipliers) is read once into `self.spec`
(`layer_spec.py`).

Tensors here carry no batch dimension: one request at a time. Keys are handed around *before* RoPE ("raw"),
which makes them position-free: `rotate_keys` places them at any position, exactly as an in-context prefill would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedModelError
from .attention import (
    BLOCKED_ATTENTION,
    attend_queries,
    attention_kernels,
    attention_probs,
    causal_mask,
    written_out_attention,
)
from .layer_spec import LayerSpec, read_spec
from .rope import no_rotation, rope_rotate, rotate_keys, signed_sin, unrotate_keys
from .support import check_supported

__all__ = ["LayerwiseModel", "ModelShape", "causal_mask", "rms_norm", "rope_rotate", "rotate_keys", "signed_sin",
           "unrotate_keys"]  # fmt: skip


def _rms_norm_classes() -> tuple[type[nn.Module], ...]:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    return LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm


_RMS_NORMS = _rms_norm_classes()


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` for the supported families' RMSNorm as torch's fused `rms_norm`: one operation in float32 (two in
    another dtype) where the module's forward runs eight, the same formula: float32 statistics, the normalized input
    rounded to its own dtype, then the weight applied. (`rms_norm` given the weight would apply it before rounding:
    close, not the same.) Any other norm module runs its own forward."""
    if not isinstance(norm, _RMS_NORMS):
        return norm(x)
    weight, eps = norm.weight, norm.variance_epsilon
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x, weight.shape, None, eps)  # computed in float32, returned in x's dtype


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_positions: int


class LayerwiseModel:
    """Step-by-step forward over the modules of a `*ForCausalLM` of a supported family; where the family's layers
    differ from Llama's is read once from its modules and config (`layer_spec.read_spec`, `self.spec`).

    `fused_qkv`, one module per layer, maps a layer's normed input to its queries, keys and values side by side
    (the three projections' outputs concatenated, in that order, e.g. `models.fused.fuse_qkv`): `project_raw_qkv`
    and `rotated_qkv` then run one product instead of three. Left out, the layer's own projections run (Phi-3's own
    `qkv_proj` is such a product already).
    """

    def __init__(self, model: nn.Module, fused_qkv: Sequence[nn.Module] | None = None) -> None:
        check_supported(model.config)
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
            raise UnsupportedModelError(
                f"{type(model).__name__} does not expose .model.layers and .model.rotary_emb; "
                "pass a *ForCausalLM from transformers of a supported family"
            )
        attn0 = base.layers[0].self_attn
        cfg = model.config
        self.model = model
        self.base = base
        self.layers = base.layers
        self.spec = read_spec(model)
        self.shape = ModelShape(
            num_layers=len(base.layers),
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=attn0.head_dim,
            hidden_size=cfg.hidden_size,
            max_positions=cfg.max_position_embeddings,
        )
        if fused_qkv is not None and len(fused_qkv) != len(base.layers):
            raise ValueError(f"fused_qkv has {len(fused_qkv)} modules for {len(base.layers)} layers")
        if self.spec.fused_qkv:
            fused_qkv = [layer.self_attn.qkv_proj for layer in base.layers]
        self.fused_qkv = None if fused_qkv is None else list(fused_qkv)
        self.has_qk_norm = any(layer.qk_norm != "none" for layer in self.spec.layers)

    @property
    def device(self) -> torch.device:
        return self.base.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base.embed_tokens.weight.dtype

    @property
    def blocked(self) -> bool:
        """Whether attention runs as `blocked_attention`: the model's own forward was told to (`use_blocked_attention`,
        bf16 on a CPU), so that the blend's recomputed rows attend as a full prefill does."""
        return self.model.config._attn_implementation == BLOCKED_ATTENTION

    # -- pieces of one forward ------------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> hidden: [T, hidden]"""
        hidden = self.base.embed_tokens(input_ids)
        return hidden if self.spec.embed_scale == 1.0 else hidden * self.spec.embed_scale

    def rope(self, positions: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, sin: [T, K * D] in `dtype` (default: the model's), from the model's own rotary module:
        one block of D channels per kind of rotation the layers use (`spec.rope_kinds`; K = 1 for most families),
        which `layer_rope` picks for a layer."""
        dummy = torch.empty(0, dtype=dtype or self.dtype, device=self.device)
        blocks: list[tuple[torch.Tensor, torch.Tensor]] = []
        for kind in self.spec.rope_kinds:
            if kind == "none":
                continue
            args = () if kind is None else (kind,)
            cos, sin = self.base.rotary_emb(dummy, positions.unsqueeze(0), *args)
            if cos.shape[-1] * 2 == self.shape.head_dim:  # GPT-OSS: one angle per channel pair, halves not repeated
                cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
            blocks.append((cos[0], sin[0]))
        kinds = iter(blocks)
        like = blocks[0][0] if blocks else torch.empty(positions.shape[0], self.shape.head_dim, dtype=dummy.dtype,
                                                         device=self.device)  # fmt: skip
        tables = [no_rotation(like) if kind == "none" else next(kinds) for kind in self.spec.rope_kinds]
        if len(tables) == 1:
            return tables[0]
        return torch.cat([c for c, _ in tables], dim=-1), torch.cat([s for _, s in tables], dim=-1)

    def layer_rope(self, layer_idx: int, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's block of tables made by `rope` (cos, sin or signed sin: [..., K * D] -> [..., D])."""
        if len(self.spec.rope_kinds) == 1:
            return cos, sin
        d = self.shape.head_dim
        start = self.spec.layers[layer_idx].rope_block * d
        return cos[..., start : start + d], sin[..., start : start + d]

    @property
    def rope_blocks(self) -> tuple[int, ...] | None:
        """Each layer's block of the `rope` tables, or None when there is one block (K = 1) for every layer."""
        if len(self.spec.rope_kinds) == 1:
            return None
        return tuple(layer.rope_block for layer in self.spec.layers)

    def window(self, layer_idx: int) -> int | None:
        """The layer's sliding window in tokens (see `LayerSpec.window`), or None: it attends to every earlier key."""
        return self.spec.layers[layer_idx].window

    def normed_input(self, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
        """The attention input of a layer. hidden: [T, hidden] -> [T, hidden]"""
        norm = self.spec.layers[layer_idx].input_norm
        return hidden if norm is None else rms_norm(norm, hidden)

    def _heads(self, layer_idx: int, projected: torch.Tensor, norm_name: str) -> torch.Tensor:
        """A query or key projection [T, n * D] -> [T, n, D], through the layer's q or k norm (`norm_name`)."""
        kind = self.spec.layers[layer_idx].qk_norm
        norm = getattr(self.layers[layer_idx].self_attn, norm_name) if kind != "none" else None
        if kind == "whole":  # OLMo 2/3: one norm over the whole projection
            projected = rms_norm(norm, projected)
        heads = projected.view(projected.shape[0], -1, self.shape.head_dim)
        return rms_norm(norm, heads) if kind == "head" else heads  # Qwen3, Gemma 3, Exaone 4: per head

    def _split_qkv(self, layer_idx: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> raw queries [T, H, D], raw keys and values [T, Hkv, D], from the fused product."""
        assert self.fused_qkv is not None
        s = self.shape
        d = s.head_dim
        q, k, v = self.fused_qkv[layer_idx](x).split([s.num_heads * d, s.num_kv_heads * d, s.num_kv_heads * d], -1)
        return self._heads(layer_idx, q, "q_norm"), self._heads(layer_idx, k, "k_norm"), v.view(x.shape[0], -1, d)

    def project_kv(self, layer_idx: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: normed input [T, hidden] -> raw keys (before RoPE) [Hkv, T, D], values [Hkv, T, D]"""
        if self.fused_qkv is not None:
            _, k, v = self._split_qkv(layer_idx, x)
            return k.transpose(0, 1), v.transpose(0, 1)
        attn = self.layers[layer_idx].self_attn
        k = self._heads(layer_idx, attn.k_proj(x), "k_norm")
        v = attn.v_proj(x).view(x.shape[0], -1, self.shape.head_dim)
        return k.transpose(0, 1), v.transpose(0, 1)

    def queries(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        """x: normed input [A, hidden] -> raw queries (before RoPE) [H, A, D]"""
        if self.fused_qkv is not None:
            return self._split_qkv(layer_idx, x)[0].transpose(0, 1)
        q = self._heads(layer_idx, self.layers[layer_idx].self_attn.q_proj(x), "q_norm")
        return q.transpose(0, 1)

    def project_raw_qkv(self, layer_idx: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: normed input [A, hidden] -> raw (before RoPE) queries [H, A, D], raw keys, values [Hkv, A, D]"""
        if self.fused_qkv is None:
            raw_k, v = self.project_kv(layer_idx, x)
            return self.queries(layer_idx, x), raw_k, v
        q, k, v = self._split_qkv(layer_idx, x)
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def rotated_qkv(
        self, layer_idx: int, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of some rows, each row one token (a prefill's recomputed tokens, or one token per
        request of a decode step): x [T, hidden]; cos, sin_signed [T, 1, K * D] (`rope`, `signed_sin`) -> rotated
        queries [T, H, D], rotated keys and values [T, Hkv, D].

        With `fused_qkv` (and no q/k norm), one product gives all three, the queries and keys are turned in one pass
        in place in its output, and the three come back as views of it."""
        s = self.shape
        t, d = x.shape[0], s.head_dim
        cos, sin_signed = self.layer_rope(layer_idx, cos, sin_signed)
        if self.fused_qkv is None or self.has_qk_norm:
            q, k, v = (r.transpose(0, 1) for r in self.project_raw_qkv(layer_idx, x))
            return rope_rotate(q, cos, sin_signed), rope_rotate(k, cos, sin_signed), v
        qkv = self.fused_qkv[layer_idx](x).view(t, -1, d)  # [T, H + 2 Hkv, D]
        turned, v = qkv.split([s.num_heads + s.num_kv_heads, s.num_kv_heads], dim=1)
        rope_rotate(turned, cos, sin_signed, out=turned)
        q, k = turned.split([s.num_heads, s.num_kv_heads], dim=1)
        return q, k, v

    def _written_out(self, layer: LayerSpec) -> bool:
        """Whether the layer's softmax is one torch's fused kernel does not take (soft-capping, sinks)."""
        return layer.softcap is not None or layer.sinks is not None

    def attend(
        self,
        layer_idx: int,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of some queries over all keys, then the output projection.

        query: [H, A, D] rotated; keys: [Hkv, N, D] rotated; values: [Hkv, N, D] (or both [1, Hkv, N, D], views made
        once for many calls); mask: [A, N] (or [1, 1, A, N], made once for many calls), bool (True = may attend) or
        additive (0 / -inf, in the query's dtype), which in a windowed layer must hold its window (`causal_mask`); or
        None when the queries are the last A of the N tokens, in order: causal (within the layer's window), aligned
        at the end (`attention.attend_queries` says how each case runs). Returns [A, hidden].
        """
        attn, layer = self.layers[layer_idx].self_attn, self.spec.layers[layer_idx]
        a, n = query.shape[1], keys.shape[-2]
        if mask is None and layer.window is not None:  # the tail's positions, for the window's mask
            positions = torch.arange(n, device=query.device)
            mask = causal_mask(positions[n - a :], positions, layer.window)
        if self._written_out(layer):
            out = written_out_attention(query, keys, values, mask, attn.scaling, softcap=layer.softcap,
                                        sinks=layer.sinks)  # fmt: skip
            return attn.o_proj(out.reshape(-1, a, out.shape[-1]).transpose(0, 1).reshape(a, -1))
        return attn.o_proj(attend_queries(query, keys, values, mask, attn.scaling, blocked=self.blocked))

    def attend_each(
        self, layer_idx: int, query: torch.Tensor, keys_values: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Attention of one query per request over that request's own keys, then one output projection for all.

        query: [H, B, D] rotated, row b of request b; keys_values[b]: its rotated keys and values [Hkv, N_b, D],
        the query's own position last (a query sees every key it is given, within the layer's window). Returns
        [B, hidden].
        """
        attn, layer = self.layers[layer_idx].self_attn, self.spec.layers[layer_idx]
        if layer.window is not None:
            keys_values = [(k[:, -layer.window :], v[:, -layer.window :]) for k, v in keys_values]
        if query.device.type == "cpu" or self._written_out(layer):  # the reference the slot pool is tested against
            rows = [written_out_attention(query[:, b, None], k, v, None, attn.scaling, softcap=layer.softcap,
                                          sinks=layer.sinks)[:, 0] for b, (k, v) in enumerate(keys_values)]  # fmt: skip
        else:
            gqa = self.shape.num_heads != self.shape.num_kv_heads
            with attention_kernels(query.device):
                rows = [
                    F.scaled_dot_product_attention(
                        query[:, b : b + 1].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale=attn.scaling,
                        enable_gqa=gqa,
                    )[0, :, 0]  # [H, D]
                    for b, (k, v) in enumerate(keys_values)
                ]  # fmt: skip
        return attn.o_proj(torch.stack(rows).reshape(len(rows), -1))

    def attention_weights(
        self, layer_idx: int, query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The attention probabilities behind `attend`, for a few queries (used to rank keys, not to compute).

        query: [H, A, D] rotated; keys: [Hkv, N, D] rotated; mask: [A, N] bool (holding the layer's window). Returns
        [H, A, N] float32.
        """
        attn, layer = self.layers[layer_idx].self_attn, self.spec.layers[layer_idx]
        return attention_probs(query.float() * attn.scaling, keys.float(), mask, 1.0, softcap=layer.softcap,
                               sinks=layer.sinks)  # fmt: skip

    def attend_from_weights(self, layer_idx: int, probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """`attend`'s result for queries whose probabilities `attention_weights` already gave: their weighted sum
        of the values, then the output projection (one pass over the keys instead of two).

        probs: [H, A, N] float32; values: [Hkv, N, D]. Returns [A, hidden].
        """
        h, a, n = probs.shape
        hkv = values.shape[0]
        out = torch.matmul(probs.to(values.dtype).reshape(hkv, (h // hkv) * a, n), values)  # [Hkv, groups * A, D]
        attn = self.layers[layer_idx].self_attn
        return attn.o_proj(out.view(h, a, -1).transpose(0, 1).reshape(a, -1))

    def finish_layer(self, layer_idx: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual, norms and MLP, in the family's order (`LayerSpec`). hidden, attn_out: [A, hidden] -> [A, hidden]"""
        layer, spec = self.layers[layer_idx], self.spec.layers[layer_idx]
        if spec.attn_out_norm is not None:
            attn_out = rms_norm(spec.attn_out_norm, attn_out)
        hidden = hidden + (attn_out if spec.residual_scale == 1.0 else attn_out * spec.residual_scale)
        x = hidden if spec.mlp_norm is None else rms_norm(spec.mlp_norm, hidden)
        out = layer.mlp(x) if self.spec.dense_mlp else layer.mlp(x.unsqueeze(0))
        if isinstance(out, tuple):  # GPT-OSS's experts also return their router's scores
            out = out[0]
        out = out.view_as(x)
        if spec.mlp_out_norm is not None:
            out = rms_norm(spec.mlp_out_norm, out)
        return hidden + (out if spec.residual_scale == 1.0 else out * spec.residual_scale)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head (and the family's logit scaling). hidden: [T, hidden] -> logits [T, vocab] float32"""
        logits = self.model.lm_head(rms_norm(self.base.norm, hidden))
        if self.spec.logits_divisor != 1.0:
            logits = logits / self.spec.logits_divisor
        if self.spec.logits_softcap is not None:
            logits = torch.tanh(logits / self.spec.logits_softcap) * self.spec.logits_softcap
        return logits.float()
