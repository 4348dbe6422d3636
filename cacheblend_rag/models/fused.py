"""One product for a layer's queries, keys and values, over the model's own weights.

A prefill's recomputed tokens and a decode step's rows need a layer's queries, keys and values together; three
products are three kernel launches on a GPU, and the weights of all three can sit side by side in one tensor.
`fuse_qkv` lays each layer's q/k/v weights (and biases) into one tensor and makes the model's own projections views
of it, so the model's forward and the fused product read the same memory: nothing is held twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedQKV(nn.Module):
    """x [..., hidden] -> queries, keys and values side by side [..., (H + 2 Hkv) * D]: one product."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _side_by_side(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor the parts already are consecutive rows of (a model fused before, by another engine), or None."""
    first = parts[0]
    offset, rows = first.storage_offset(), sum(p.shape[0] for p in parts)
    row = first[0].numel()
    for p in parts:
        if not p.is_contiguous() or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        if p.storage_offset() != offset:
            return None
        offset += p.numel()
    shape, strides = (rows, *first.shape[1:]), (row, *first.stride()[1:])
    return torch.as_strided(first.detach(), shape, strides, first.storage_offset())


def _fused(module: nn.Module, names: tuple[str, ...], attr: str) -> torch.Tensor:
    """One tensor of the `attr` tensors of the linears `names`, side by side; the linears' own become views of it."""
    linears = [getattr(module, name) for name in names]
    parts = [getattr(linear, attr).detach() for linear in linears]
    whole = _side_by_side(parts)
    if whole is not None:
        return whole
    whole = torch.cat(parts)
    start = 0
    for linear, part in zip(linears, parts, strict=True):
        old = getattr(linear, attr)
        setattr(linear, attr, nn.Parameter(whole[start : start + part.shape[0]], requires_grad=old.requires_grad))
        start += part.shape[0]
    return whole


@torch.no_grad()
def fuse_qkv(model: nn.Module) -> list[FusedQKV] | None:
    """Per layer of a supported `*ForCausalLM`, one product for its queries, keys and values (`FusedQKV`), whose
    weight the layer's `q_proj`, `k_proj` and `v_proj` then view (the same values in the same memory; moving or
    casting the model later gives each projection its own tensor again, and the fused products keep the old ones).

    None, and the model is left as it is, unless every layer has the three projections, each a plain `nn.Linear`
    (or one an engine packed for oneDNN before, `packed.PackedLinear`) with its weights on one device in one dtype
    (not quantized, wrapped or offloaded), and all or none of them have a bias.
    """
    from .packed import PackedLinear  # packed layers (`packed.py`) are plain linears over the same parameters

    names = ("q_proj", "k_proj", "v_proj")
    layers = model.model.layers
    attns = [layer.self_attn for layer in layers]
    if not all(hasattr(attn, name) for attn in attns for name in names):  # e.g. Phi-3's own `qkv_proj`
        return None
    weight0 = attns[0].q_proj.weight
    for attn in attns:
        linears = [getattr(attn, name) for name in names]
        if any(type(lin) not in (nn.Linear, PackedLinear) for lin in linears):
            return None
        tensors = [t for lin in linears for t in (lin.weight, lin.bias) if t is not None]
        if any(t.device != weight0.device or t.dtype != weight0.dtype or t.is_meta for t in tensors):
            return None
        if len({lin.bias is None for lin in linears}) != 1:
            return None
    fused = []
    for attn in attns:
        weight = _fused(attn, names, "weight")
        bias = _fused(attn, names, "bias") if attn.q_proj.bias is not None else None
        fused.append(FusedQKV(weight, bias))
    return fused
