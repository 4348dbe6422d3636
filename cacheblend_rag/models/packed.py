"""bf16 linear layers on a CPU over weights laid out once for oneDNN, torch's CPU matrix library.

`F.linear` on a CPU in bf16 hands oneDNN the weight in its plain [out, in] layout, and oneDNN lays it out in its
blocked form again on every call. `pack_linears` gives each linear layer of the decoder, each fused q/k/v product
and the LM head a copy laid out once (`torch.ops.mkldnn._reorder_linear_weight`), which `_linear_pointwise`
multiplies with the same kernel: the same values, bit for bit (checked on the first layer and the LM head when
packing; where they differ nothing is packed), in less time: the study `research/prefill_cpu_paths.py` in the
research log. vLLM's CPU build packs its weights the same way.

The plain weight stays a parameter of the model: fingerprints, int8 decode weights, a second engine's fused q/k/v and
moving the model read it. The packed copy costs the layers' weight bytes once more. The LM head, which every decode
step reads whole, takes 6.2-7.5 ms packed against 9.2-11.1 ms plain at 1-8 rows (the default model, the Zen 5 EPYC):
decoding 1.10-1.12x as fast (`research/packed_lm_head.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fused import FusedQKV

PACKED_ROWS_HINT = 1024  # the rows oneDNN lays the weight out for: a prefill's; a decode step's few rows run as fast


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `pack_linears` applies: bf16 on a CPU whose oneDNN runs bf16 products natively (AVX-512-BF16, AMX)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class _Packed:
    """A weight's copy packed for oneDNN, and what tells that the weight it was made from is still the same tensor
    with the same values (its memory and version): a weight cast, moved or written since runs the plain product."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_ROWS_HINT)
        self.source = (weight.data_ptr(), weight._version, weight.dtype)

    def product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> [..., out]: `F.linear(x, weight, bias)`, over the packed copy while it is current."""
        if (weight.data_ptr(), weight._version, weight.dtype) != self.source or x.dtype != torch.bfloat16:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.tensor, bias, "none", [], "")


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose product runs on a copy of its weight packed for oneDNN; the plain weight and bias stay
    its parameters (the same tensors as the linear it replaces)."""

    packed: _Packed

    @classmethod
    def of(cls, linear: nn.Linear) -> PackedLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.packed = _Packed(linear.weight)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.product(x, self.weight, self.bias)


class PackedFusedQKV(FusedQKV):
    """`FusedQKV` over a packed copy of its weight."""

    def __init__(self, fused: FusedQKV) -> None:
        super().__init__(fused.weight, fused.bias)
        self.packed = _Packed(fused.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.product(x, self.weight, self.bias)


def _packs_exactly(linear: nn.Linear) -> bool:
    """Whether the packed product of `linear` gives F.linear's values bit for bit, on a few random rows."""
    x = torch.randn(5, linear.in_features, generator=torch.Generator().manual_seed(0)).to(linear.weight.dtype)
    with torch.inference_mode():
        return torch.equal(F.linear(x, linear.weight, linear.bias), PackedLinear.of(linear)(x))


@torch.no_grad()
def pack_linears(model: nn.Module, fused_qkv: list[nn.Module] | None) -> list[nn.Module] | None:
    """Replace each plain `nn.Linear` of the decoder layers of `model` (and its LM head) with a `PackedLinear` over the
    same parameters (a tied LM head stays tied), and pack `fused_qkv`'s products. -> the fused products to use from
    now on (`fused_qkv` itself when nothing was packed). Call only where `packing_available`; layers packed already (a
    second engine over the model) stay."""
    linears = [(parent, name, child) for layer in model.model.layers for parent in layer.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]  # fmt: skip
    if linears and not _packs_exactly(linears[0][2]):
        return fused_qkv
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear.of(child))
    head = model.lm_head  # a supported *ForCausalLM's; read whole by every decode step: packed, ~0.6x the time
    if type(head) is nn.Linear and _packs_exactly(head):
        model.lm_head = PackedLinear.of(head)
    if fused_qkv is None:
        return None
    return [PackedFusedQKV(f) if type(f) is FusedQKV else f for f in fused_qkv]
