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
`int8_decode_lm(model)` wraps it for the engine's decode steps with each layer's products fused: queries, keys and
values in one product, the MLP's gate and up projections in another (4 products per layer instead of 7). Weights
are quantized per output channel and every input row on its own, so a fused product gives exactly the outputs of
the products it replaces: fusing changes the step's time, not its numbers.
"""

from __future__ import annotations

import copy
import threading
import warnings

import torch
from torch import nn

from .adapter import LayerwiseModel


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
        rows = x.reshape(-1, shape[-1])
        if rows.dtype != torch.float32:
            rows = rows.float()
        if rows.requires_grad:  # the quantized kernel has no gradient, and an `out=` write takes none
            rows = rows.detach()
        # max |x| of each row (`linalg.vector_norm(inf)` gives the same, at 4.4 against 2.8 us for 896 features and
        # 14.8 against 3.3 us for 4,864 on a 2-core Zen 4)
        size = rows.abs().amax(1, keepdim=True).clamp_min_(1e-12)
        pinned, body = pinned_rows(rows.shape[0], self.in_features)
        torch.div(rows, size, out=body)
        y = torch.ops.quantized.linear_dynamic(pinned, self.packed, True).mul_(size)
        if self.bias is not None:
            y.add_(self.bias)
        if self.out_dtype != torch.float32:
            y = y.to(self.out_dtype)
        return y.view(*shape[:-1], self.out_features)


class _PinnedRows(threading.local):
    """Per thread: the pinned input buffers of decode-sized products, by (rows, in_features)."""

    KEPT_UP_TO = 64  # rows; a larger input (a prompt run through int8 weights) gets a buffer of its own

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, rows: int, features: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A [rows, features + 2] buffer whose last two columns hold +1 and -1, and the view of its first
        `features` columns, where a product's scaled input is written: a decode step makes no new input."""
        found = self.buffers.get((rows, features))
        if found is None:
            with torch.inference_mode(False):  # a plain tensor: written in and out of inference mode alike
                pinned = torch.empty(rows, features + 2)
                pinned[:, features:] = torch.tensor([1.0, -1.0])  # the two pinning inputs, appended to every row
                found = (pinned, pinned[:, :features])
            if rows <= self.KEPT_UP_TO:
                self.buffers[(rows, features)] = found
        return found


_PINNED = _PinnedRows()


def pinned_rows(rows: int, features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's [rows, features + 2] input buffer of an int8 product (its last two columns +1 and -1) and the
    view of its first `features` columns, where the product's scaled rows go."""
    return _PINNED.get(rows, features)


def _stacked(linears: list[nn.Linear]) -> nn.Linear:
    """One linear layer whose outputs are those of `linears`, side by side."""
    with_bias = [lin.bias is not None for lin in linears]
    if any(with_bias) and not all(with_bias):
        raise ValueError("fused projections must all have a bias or none")
    w = torch.cat([lin.weight.detach() for lin in linears])
    fused = nn.Linear(w.shape[1], w.shape[0], bias=all(with_bias), dtype=w.dtype, device=w.device)
    fused.weight.data.copy_(w)
    if fused.bias is not None:
        fused.bias.data.copy_(torch.cat([lin.bias.detach() for lin in linears]))
    return fused


class Int8GatedMLP(nn.Module):
    """A gated MLP (`down(act(gate(x)) * up(x))`, Llama / Mistral / Qwen) with gate and up in one int8 product."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_up = Int8Linear(_stacked([mlp.gate_proj, mlp.up_proj]))
        self.down = Int8Linear(mlp.down_proj)
        self.act_fn = mlp.act_fn
        self.split = mlp.gate_proj.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split([self.split, self.gate_up.out_features - self.split], dim=-1)
        return self.down(self.act_fn(gate) * up)


def _swap_linears(module: nn.Module) -> nn.Module:
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child))
        else:
            _swap_linears(child)
    return module


class _DecodeModel(nn.Module):
    """The attribute layout `LayerwiseModel` reads (`.model.layers`, `.lm_head`, ...) over int8 copies."""

    def __init__(self, model: nn.Module, fuse: bool) -> None:
        super().__init__()
        self.config = model.config
        base = model.model
        self.model = nn.Module()
        self.model.embed_tokens = base.embed_tokens
        self.model.rotary_emb = base.rotary_emb
        self.model.norm = base.norm
        self.model.layers = nn.ModuleList(_int8_layer(layer, fuse) for layer in base.layers)
        self.lm_head = Int8Linear(model.lm_head)
        self.fused_qkv = (
            nn.ModuleList(
                Int8Linear(_stacked([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]))
                for layer in base.layers
            )
            if fuse
            else None
        )


def _int8_layer(layer: nn.Module, fuse: bool) -> nn.Module:
    """An int8 copy of a decoder layer; with `fuse`, its MLP runs gate and up as one product."""
    if not fuse:
        return _swap_linears(copy.deepcopy(layer))
    copied = copy.deepcopy(layer, memo={id(layer.mlp): None})  # no float copy of the MLP: it is replaced
    copied.mlp = Int8GatedMLP(layer.mlp)
    return _swap_linears(copied)


@torch.no_grad()
def int8_decode_model(model: nn.Module, fuse: bool = False) -> nn.Module:
    """A model with `model`'s embeddings, rotary module and final norm, and int8 copies of its layers and LM head.

    With `fuse`, each layer's MLP runs gate and up as one product and the model carries `fused_qkv`, one int8
    product per layer for queries, keys and values (what `int8_decode_lm` hands to `LayerwiseModel`).
    """
    return _DecodeModel(model, fuse).eval()


@torch.no_grad()
def int8_decode_lm(model: nn.Module) -> LayerwiseModel:
    """What the engine's decode steps run on under `decode_weights="int8"`: int8 copies with fused products."""
    decode = int8_decode_model(model, fuse=True)
    return LayerwiseModel(decode, fused_qkv=decode.fused_qkv)
