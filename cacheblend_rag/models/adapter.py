"""Layer-wise access to a Hugging Face decoder (Llama, Mistral, Qwen2, Qwen3) for selective recompute.

`transformers` runs a whole layer on a whole sequence. CacheBlend needs finer steps: project K/V for some tokens,
compare them with cached ones, then run attention and the MLP for a *subset* of query tokens against the full
(partly cached) K/V. `LayerwiseModel` exposes those steps over the model's own modules and weights, so the
arithmetic is the model's; only the order of work changes.

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
from .attention import attention_kernels, fused_attention
from .support import check_supported


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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_keys(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to raw keys (or queries).

    x: [..., T, D]; cos, sin: [T, D] for the tokens' target positions. Same formula as transformers'
    `apply_rotary_pos_emb`, so a raw key rotated here equals the key an in-context prefill computes.
    """
    return x * cos + rotate_half(x) * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """The sine table with its first half negated ([..., D]): `rope_rotate`'s form of `rotate_half(x) * sin`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope_rotate(
    x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`rotate_keys` with the sine table made once (`signed_sin`): one `roll` instead of two slices, a negation
    and a `cat`, and the second product added as it is made (`addcmul`). x: [..., T, D]; cos, sin_signed: [T, D];
    `out`: where to write the result (e.g. a slice of a buffer), instead of a new tensor."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed, out=out)


def unrotate_keys(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo `rotate_keys`: keys rotated at the positions of `cos`, `sin` ([T, D]) -> raw keys [H, T, D].

    RoPE turns each pair of channels by an angle; turning it back by minus that angle is exact in real numbers,
    and within a few units of the last place in floating point (pass float32 keys and cos, sin for stored KV).
    """
    return x * cos.unsqueeze(0) - rotate_half(x) * sin.unsqueeze(0)


def causal_mask(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask from true positions: query i may see key j iff pos(j) <= pos(i).

    q_positions: [A]; k_positions: [N] -> [A, N]. Built from positions, not from row/column order, so any
    subset of queries in any order attends exactly as it would inside a full causal prefill.
    """
    return k_positions.unsqueeze(0) <= q_positions.unsqueeze(1)


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_positions: int


class LayerwiseModel:
    """Step-by-step forward over the modules of a `*ForCausalLM` of a supported family.

    `fused_qkv`, one module per layer, maps a layer's normed input to its queries, keys and values side by side
    (the three projections' outputs concatenated, in that order, e.g. `models.fused.fuse_qkv`): `project_raw_qkv`
    and `rotated_qkv` then run one product instead of three. Left out, the layer's own q/k/v projections run.
    """

    def __init__(self, model: nn.Module, fused_qkv: Sequence[nn.Module] | None = None) -> None:
        check_supported(model.config)
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
            raise UnsupportedModelError(
                f"{type(model).__name__} does not expose .model.layers and .model.rotary_emb; "
                "pass a Llama, Mistral, Qwen2 or Qwen3 *ForCausalLM from transformers"
            )
        attn0 = base.layers[0].self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not hasattr(attn0, name):
                raise UnsupportedModelError(f"attention module {type(attn0).__name__} has no {name}")
        cfg = model.config
        self.model = model
        self.base = base
        self.layers = base.layers
        self.has_qk_norm = hasattr(attn0, "q_norm") and hasattr(attn0, "k_norm")  # Qwen3 normalizes q/k per head
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
        self.fused_qkv = None if fused_qkv is None else list(fused_qkv)

    @property
    def device(self) -> torch.device:
        return self.base.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base.embed_tokens.weight.dtype

    # -- pieces of one forward ------------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> hidden: [T, hidden]"""
        return self.base.embed_tokens(input_ids)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, sin: [T, D] in `dtype` (default: the model's), from the model's own rotary module."""
        dummy = torch.empty(0, dtype=dtype or self.dtype, device=self.device)
        cos, sin = self.base.rotary_emb(dummy, positions.unsqueeze(0))
        return cos[0], sin[0]

    def normed_input(self, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
        """The attention input of a layer. hidden: [T, hidden] -> [T, hidden]"""
        return rms_norm(self.layers[layer_idx].input_layernorm, hidden)

    def project_kv(self, layer_idx: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: normed input [T, hidden] -> raw keys (before RoPE) [Hkv, T, D], values [Hkv, T, D]"""
        attn = self.layers[layer_idx].self_attn
        t, d = x.shape[0], self.shape.head_dim
        k = attn.k_proj(x).view(t, -1, d)  # [T, Hkv, D]
        if self.has_qk_norm:
            k = rms_norm(attn.k_norm, k)
        v = attn.v_proj(x).view(t, -1, d)
        return k.transpose(0, 1), v.transpose(0, 1)

    def queries(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        """x: normed input [A, hidden] -> raw queries (before RoPE) [H, A, D]"""
        attn = self.layers[layer_idx].self_attn
        q = attn.q_proj(x).view(x.shape[0], -1, self.shape.head_dim)  # [A, H, D]
        if self.has_qk_norm:
            q = rms_norm(attn.q_norm, q)
        return q.transpose(0, 1)

    def project_raw_qkv(self, layer_idx: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: normed input [A, hidden] -> raw (before RoPE) queries [H, A, D], raw keys, values [Hkv, A, D]"""
        if self.fused_qkv is None:
            raw_k, v = self.project_kv(layer_idx, x)
            return self.queries(layer_idx, x), raw_k, v
        attn = self.layers[layer_idx].self_attn
        s = self.shape
        t, d = x.shape[0], s.head_dim
        q, k, v = self.fused_qkv[layer_idx](x).split([s.num_heads * d, s.num_kv_heads * d, s.num_kv_heads * d], -1)
        q, k, v = q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)
        if self.has_qk_norm:
            q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def rotated_qkv(
        self, layer_idx: int, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of some rows, each row one token (a prefill's recomputed tokens, or one token per
        request of a decode step): x [T, hidden]; cos, sin_signed [T, 1, D] (`signed_sin`) -> rotated queries
        [T, H, D], rotated keys and values [T, Hkv, D].

        With `fused_qkv` (and no per-head q/k norm), one product gives all three, the queries and keys are turned
        in one pass in place in its output, and the three come back as views of it."""
        s = self.shape
        t, d = x.shape[0], s.head_dim
        if self.fused_qkv is None or self.has_qk_norm:
            q, k, v = (r.transpose(0, 1) for r in self.project_raw_qkv(layer_idx, x))
            return rope_rotate(q, cos, sin_signed), rope_rotate(k, cos, sin_signed), v
        qkv = self.fused_qkv[layer_idx](x).view(t, -1, d)  # [T, H + 2 Hkv, D]
        turned, v = qkv.split([s.num_heads + s.num_kv_heads, s.num_kv_heads], dim=1)
        rope_rotate(turned, cos, sin_signed, out=turned)
        q, k = turned.split([s.num_heads, s.num_kv_heads], dim=1)
        return q, k, v

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
        additive (0 / -inf, in the query's dtype); or None when the
        queries are the last A of the N tokens, in order: causal, aligned at the end. Then the queries are padded
        to the causal square (A == N is that square), which the fused kernels run without any mask, skipping the
        scores above the diagonal; the padded rows' outputs are dropped. Returns [A, hidden].
        """
        attn = self.layers[layer_idx].self_attn
        a, n = query.shape[1], keys.shape[-2]
        padded = mask is None and a < n
        if padded:
            query = torch.cat((query.new_zeros(query.shape[0], n - a, query.shape[2]), query), dim=1)
        if keys.dim() == 3:
            keys, values = keys.unsqueeze(0), values.unsqueeze(0)
        with attention_kernels(query.device):
            out = fused_attention(
                query.unsqueeze(0),
                keys,
                values,
                mask if mask is None or mask.dim() == 4 else mask[None, None],
                attn.scaling,
                is_causal=mask is None,
                enable_gqa=self.shape.num_heads != self.shape.num_kv_heads,
            )  # [1, H, A (or N, padded), D]
        if padded:
            out = out[:, :, -a:]
        return attn.o_proj(out.transpose(1, 2).reshape(a, -1))

    def attend_each(
        self, layer_idx: int, query: torch.Tensor, keys_values: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Attention of one query per request over that request's own keys, then one output projection for all.

        query: [H, B, D] rotated, row b of request b; keys_values[b]: its rotated keys and values [Hkv, N_b, D],
        the query's own position last (a query sees every key it is given). Returns [B, hidden].
        """
        attn = self.layers[layer_idx].self_attn
        if query.device.type == "cpu":  # the per-request reference the slot pool is tested against: plain products
            rows = [self._attend_one(query[:, b], k, v, attn.scaling) for b, (k, v) in enumerate(keys_values)]
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

    @staticmethod
    def _attend_one(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """One query per head [H, D] over keys, values [Hkv, N, D] -> [H, D]; query heads share KV heads in groups."""
        hkv, d = keys.shape[0], keys.shape[2]
        scores = torch.matmul(query.reshape(hkv, -1, d), keys.transpose(1, 2)) * scale  # [Hkv, groups, N]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
        return torch.matmul(probs, values).view(query.shape)

    def attention_weights(
        self, layer_idx: int, query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The attention probabilities behind `attend`, for a few queries (used to rank keys, not to compute).

        query: [H, A, D] rotated; keys: [Hkv, N, D] rotated; mask: [A, N] bool. Returns [H, A, N] float32.
        """
        scale = self.layers[layer_idx].self_attn.scaling
        hkv, a = keys.shape[0], query.shape[1]
        q = query.float().reshape(hkv, -1, query.shape[2])  # [Hkv, groups * A, D]: heads of one KV head together
        scores = torch.matmul(q, keys.float().transpose(1, 2)).view(query.shape[0], a, -1) * scale  # [H, A, N]
        scores.masked_fill_(~mask.unsqueeze(0), float("-inf"))
        return torch.softmax(scores, dim=-1)

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
        """Residual, post-attention norm and MLP. hidden, attn_out: [A, hidden] -> [A, hidden]"""
        layer = self.layers[layer_idx]
        hidden = hidden + attn_out
        return hidden + layer.mlp(rms_norm(layer.post_attention_layernorm, hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head. hidden: [T, hidden] -> logits [T, vocab] (float32)"""
        return self.model.lm_head(rms_norm(self.base.norm, hidden)).float()
