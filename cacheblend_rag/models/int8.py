"""Int8 weights for decode steps on a CPU: a quarter of the bytes each step reads, at the same batch invariance.

A decode step reads every weight matrix for a handful of tokens, so its time is the weights' bytes over the
memory bandwidth. `Int8Linear` keeps a linear layer's weight as int8 with one scale per output channel and runs it
through PyTorch's quantized CPU kernel (fbgemm, AVX2 / AVX-512), which quantizes the input to 8 bits on the fly.

That kernel picks one input scale for the whole batch, from the batch's minimum and maximum, so a request's result
would depend on the requests beside it. `Int8Linear` removes that: each row is divided by its own largest
magnitude, and two constant inputs, +1 and -1 (with zero weights), pin every row's range to exactly [-1, 1]. Every
row is then quantized as it would be alone, the integer matrix product is exact, and the row's magnitude is
multiplied back afterwards: a batched row equals the same row decoded alone, bit for bit.

`int8_decode_model(model)` builds a copy of a causal LM's decoder layers and LM head with every linear layer in
int8, sharing the embeddings, the rotary module and the final norm (the prefill keeps the exact weights).
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn


class Int8Linear(nn.Module):
    """An `nn.Linear` with per-output-channel int8 weights, batch invariant (see the module's docstring)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.weight.device.type != "cpu":
            raise ValueError("int8 decode weights run on the CPU kernel (fbgemm); use decode_weights='native' on a GPU")
        w = linear.weight.detach().float()
        pinned = torch.cat([w, w.new_zeros(w.shape[0], 2)], dim=1)  # the +1 / -1 inputs weigh nothing
        scales = (pinned.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        zero_points = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch marks quantized tensors for removal in a later release (pinned here)
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(pinned, scales.double(), zero_points, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        size = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
        ends = rows.new_tensor([1.0, -1.0]).expand(rows.shape[0], 2)
        y = torch.ops.quantized.linear_dynamic(torch.cat([rows / size, ends], dim=1), self.packed, True) * size
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.out_dtype).reshape(*shape[:-1], self.out_features)


def _swap_linears(module: nn.Module) -> nn.Module:
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child))
        else:
            _swap_linears(child)
    return module


class _DecodeModel(nn.Module):
    """The attribute layout `LayerwiseModel` reads (`.model.layers`, `.lm_head`, ...) over int8 copies."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.config = model.config
        base = model.model
        self.model = nn.Module()
        self.model.embed_tokens = base.embed_tokens
        self.model.rotary_emb = base.rotary_emb
        self.model.norm = base.norm
        self.model.layers = nn.ModuleList(_swap_linears(copy.deepcopy(layer)) for layer in base.layers)
        self.lm_head = Int8Linear(model.lm_head)


@torch.no_grad()
def int8_decode_model(model: nn.Module) -> nn.Module:
    """A model with `model`'s embeddings, rotary module and final norm, and int8 copies of its layers and LM head."""
    return _DecodeModel(model).eval()
