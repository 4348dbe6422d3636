"""How a store tier encodes one layer of chunk KV: the compute dtype as is, 16-bit floats, or 8/4-bit integers.

Quantization follows KIVI's axes. Keys (stored before RoPE, where a few channels carry large, stable outliers)
are quantized per channel: one scale and zero point per (head, dim) over the token axis, so an outlier channel
does not widen every other channel's step. Values are quantized per token: one scale and zero point per
(head, token) over the head dim. `int8` takes each axis whole; `int4` cuts it into groups of 32 and packs two
codes per byte. Both are asymmetric (a zero point beside each scale): KV rows are not centred on zero.

A codec turns `k, v` ([Hkv, T, D] each) into two payload tensors whose dtype and shape depend only on the layer's
shape and dtype (`payload_spec`), so layer l of a stored entry is a known byte range; `decode` turns them back
into the compute dtype. Only `native` is exact. Codecs are plain objects: a store takes one in its constructor,
and `CODECS` names the ones this package ships (a config picks one by name).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from ..errors import ConfigError

Shape3 = tuple[int, int, int]  # [Hkv, T, D] of one layer's keys (and values)


class PayloadSpec(NamedTuple):
    """What one layer's encoded keys and values are: one dtype, and a shape for each. A `variable` codec's payloads
    are 1-D and differ in length from layer to layer and entry to entry (the entry header records each); its shapes
    are then a typical length, what sizing estimates go by."""

    dtype: torch.dtype
    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]
    variable: bool = False

    def nbytes(self) -> tuple[int, int]:
        """Bytes of one layer's encoded keys, and of its encoded values."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return math.prod(self.key_shape) * size, math.prod(self.value_shape) * size


@runtime_checkable
class KVCodec(Protocol):
    """Encodes one layer's K/V for a store tier, and decodes it back. Pure: no state beyond its parameters."""

    name: str  # recorded in each stored entry; an entry written with another codec is a miss

    def payload_spec(self, shape: Shape3, dtype: torch.dtype) -> PayloadSpec: ...

    def encode(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s k, v [Hkv, T, D] -> key payload, value payload, as `payload_spec(k.shape, k.dtype)` says."""
        ...

    def decode(
        self, key_payload: torch.Tensor, value_payload: torch.Tensor, shape: Shape3, dtype: torch.dtype, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The payloads of layer `layer`, of `shape`, encoded from `dtype` -> k, v [Hkv, T, D] in `dtype`."""
        ...


@runtime_checkable
class CodesCodec(KVCodec, Protocol):
    """A codec whose payloads hold integer codes, so that an entry can be stored as the difference of its codes
    from another entry's of the same shape (a chunk's captured entry against its isolated one: `store/layout.py`).
    Decoding base + difference gives the same codes, bit for bit, as the entry coded alone."""

    def codes_of(
        self, key_payload: torch.Tensor, value_payload: torch.Tensor, shape: Shape3, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The payloads of layer `layer`, of `shape` -> its key codes and value codes (float32, on the CPU)."""
        ...

    def encode_against(
        self, k: torch.Tensor, v: torch.Tensor, layer: int, base: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like `encode`, of the codes' difference from `base` (another entry's `codes_of` for this layer)."""
        ...

    def decode_against(
        self,
        key_payload: torch.Tensor,
        value_payload: torch.Tensor,
        shape: Shape3,
        dtype: torch.dtype,
        layer: int,
        base: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like `decode`, of payloads `encode_against` wrote against `base`."""
        ...


# ------------------------------------------------------------------------------------------- pure tensor functions


def quantize(x: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization over the last dim: x [..., G] -> codes uint8 [..., G], scale [..., 1], low [..., 1].

    x ~= codes * scale + low. The scale and low are rounded to `scale_dtype` first (low down, scale up), and the
    codes are taken against the rounded values, so narrow scales cost no clamping.
    """
    qmax = (1 << bits) - 1
    x = x.float()
    lo = x.amin(-1, keepdim=True)
    hi = x.amax(-1, keepdim=True)
    low = _round_toward(lo, scale_dtype, -math.inf)
    scale = _round_toward((hi - low.float()) / qmax, scale_dtype, math.inf)
    s = scale.float()
    codes = ((x - low.float()) / torch.where(s > 0, s, 1.0)).round_().clamp_(0, qmax).to(torch.uint8)
    return codes, scale, low


def dequantize(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., G], scale and low [..., 1] -> codes * scale + low, in `dtype`. Worked in place on one float32
    copy of the codes (a loaded layer is decoded on the loading thread, beside the fusor: each pass saved counts)."""
    out = codes.to(torch.float32)
    return out.mul_(scale).add_(low).to(dtype)


def _round_toward(x: torch.Tensor, dtype: torch.dtype, direction: float) -> torch.Tensor:
    """x (float32) in `dtype`, rounded toward `direction` (-inf or +inf) where rounding to nearest overshoots."""
    y = x.to(dtype)
    off = (y.float() > x) if direction < 0 else (y.float() < x)
    return torch.where(off, torch.nextafter(y, torch.full_like(y, direction)), y)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes uint8 [..., 2n] -> uint8 [..., n]: code 2i in the low nibble of byte i, code 2i+1 in the high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> 4-bit codes uint8 [..., 2n]; undoes `pack_nibbles`."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def _pad_to(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """x grown along `dim` to `size` by repeating its last slice (which leaves every group's min and max alone)."""
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    last = x.narrow(dim, x.shape[dim] - 1, 1)
    return torch.cat([x, last.expand(*[extra if d == dim % x.dim() else -1 for d in range(x.dim())])], dim=dim)


# ---------------------------------------------------------------------------------------------------------- codecs


class NativeCodec:
    """The compute dtype, bit for bit (what stores kept before codecs existed)."""

    name = "native"

    def payload_spec(self, shape: Shape3, dtype: torch.dtype) -> PayloadSpec:
        return PayloadSpec(dtype, tuple(shape), tuple(shape))

    def encode(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v

    def decode(
        self, key_payload: torch.Tensor, value_payload: torch.Tensor, shape: Shape3, dtype: torch.dtype, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return key_payload.view(shape), value_payload.view(shape)


class CastCodec:
    """Another float dtype (fp16 or bf16): halves an fp32 model's entries; a no-op for a model already in it."""

    def __init__(self, name: str, storage_dtype: torch.dtype) -> None:
        self.name = name
        self.storage_dtype = storage_dtype

    def payload_spec(self, shape: Shape3, dtype: torch.dtype) -> PayloadSpec:
        return PayloadSpec(self.storage_dtype, tuple(shape), tuple(shape))

    def encode(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return k.to(self.storage_dtype), v.to(self.storage_dtype)

    def decode(
        self, key_payload: torch.Tensor, value_payload: torch.Tensor, shape: Shape3, dtype: torch.dtype, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return key_payload.view(shape).to(dtype), value_payload.view(shape).to(dtype)


class GroupQuantCodec:
    """Keys per channel (along tokens), values per token (along dims), `bits` per code, scales beside the codes.

    `group` cuts the quantized axis into groups of that many (None: the whole axis is one group); an axis that
    does not divide is padded by repeating its last element. Each payload is flat uint8: the scales, the lows,
    then the codes (two per byte at 4 bits).
    """

    def __init__(self, name: str, bits: int, group: int | None, scale_dtype: torch.dtype) -> None:
        if bits not in (4, 8) or (group is not None and (group < 2 or group % 2)):
            raise ConfigError(f"GroupQuantCodec takes 4 or 8 bits and an even group >= 2, got {bits} and {group}")
        self.name, self.bits, self.group, self.scale_dtype = name, bits, group, scale_dtype

    def _groups(self, n: int) -> tuple[int, int]:
        """-> (number of groups, group size) along an axis of n elements."""
        size = max(n, 1) if self.group is None else self.group
        if self.bits == 4 and size % 2:  # a whole odd axis: pad it by one so codes pair up
            size += 1
        return -(-n // size), size

    def _bytes(self, num_groups: int, size: int) -> int:
        scale_size = torch.empty((), dtype=self.scale_dtype).element_size()
        return 2 * num_groups * scale_size + num_groups * size * self.bits // 8

    def payload_spec(self, shape: Shape3, dtype: torch.dtype) -> PayloadSpec:
        h, t, d = shape
        nk, gk = self._groups(t)
        nv, gv = self._groups(d)
        return PayloadSpec(torch.uint8, (self._bytes(h * nk * d, gk),), (self._bytes(h * t * nv, gv),))

    def encode(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        h, t, d = k.shape
        nk, gk = self._groups(t)
        keys = _pad_to(k, 1, nk * gk).reshape(h, nk, gk, d).transpose(2, 3)  # [Hkv, nG, D, G]: per channel
        nv, gv = self._groups(d)
        values = _pad_to(v, 2, nv * gv).reshape(h, t, nv, gv)  # [Hkv, T, nG, G]: per token
        return self._encode_groups(keys), self._encode_groups(values)

    def _encode_groups(self, x: torch.Tensor) -> torch.Tensor:
        codes, scale, low = quantize(x, self.bits, self.scale_dtype)  # [..., G], [..., 1], [..., 1]
        flat = codes.reshape(-1)
        if self.bits == 4:
            flat = pack_nibbles(flat)
        return torch.cat([scale.reshape(-1).view(torch.uint8), low.reshape(-1).view(torch.uint8), flat])

    def decode(
        self, key_payload: torch.Tensor, value_payload: torch.Tensor, shape: Shape3, dtype: torch.dtype, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, t, d = shape
        nk, gk = self._groups(t)
        nv, gv = self._groups(d)
        codes, scale, low = self._groups_of(key_payload, (h, nk, d, gk))  # [Hkv, nG, D, G]: per channel
        if nk == 1:
            # One group along all tokens (int8): put back in token order as the codes widen to float32 (a strided
            # read of bytes), not once decoded (a strided copy of bf16 values, slower on a CPU: 230 against 280 us a
            # 512-token layer); the arithmetic is the same, element by element. Short groups (int4) lose by it.
            keys = torch.empty((h, nk, gk, d), dtype=torch.float32, device=codes.device).copy_(codes.transpose(2, 3))
            keys = keys.mul_(scale.transpose(2, 3)).add_(low.transpose(2, 3)).to(dtype)  # [Hkv, 1, G, D]
        else:
            keys = dequantize(codes, scale, low, dtype).transpose(2, 3)  # [Hkv, nG, G, D], strided
        values = dequantize(*self._groups_of(value_payload, (h, t, nv, gv)), dtype)  # [Hkv, T, nG, G]
        k = keys.reshape(h, nk * gk, d)[:, :t]
        v = values.reshape(h, t, nv * gv)[:, :, :d]
        return k.contiguous(), v.contiguous()

    def _groups_of(
        self, payload: torch.Tensor, shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A payload of groups of `shape` [..., G] -> its codes [..., G], scales and lows [..., 1]."""
        n_scales = math.prod(shape[:-1])
        scale_bytes = n_scales * torch.empty((), dtype=self.scale_dtype).element_size()
        scale = payload[:scale_bytes].view(self.scale_dtype).reshape(*shape[:-1], 1)
        low = payload[scale_bytes : 2 * scale_bytes].view(self.scale_dtype).reshape(*shape[:-1], 1)
        codes = payload[2 * scale_bytes :]
        if self.bits == 4:
            codes = unpack_nibbles(codes)
        return codes.reshape(shape), scale, low


NATIVE = NativeCodec()

# The codecs a config can name. int8 keeps fp32 scales (one per channel or token: little overhead); int4 keeps
# fp16 scales, one per group of 32 (fp32 would add half again to the codes' bytes).
CODECS: Mapping[str, KVCodec] = MappingProxyType(
    {
        "native": NATIVE,
        "fp16": CastCodec("fp16", torch.float16),
        "bf16": CastCodec("bf16", torch.bfloat16),
        "int8": GroupQuantCodec("int8", bits=8, group=None, scale_dtype=torch.float32),
        "int4": GroupQuantCodec("int4", bits=4, group=32, scale_dtype=torch.float16),
    }
)

# The disk and Redis tiers' default: the smallest codec whose teacher-forced fidelity stays within noise of the
# uncompressed store on every data set (docs/configuration.md, "Stored KV: codecs and bytes per token").
TIER_CODEC = "int8"


# Codecs fitted to a model (`transform_codec.TransformCodec`): a config may name them, and the engine builds them
# from its model (`engine.chunks.calibrate`); on their own, a name is not enough.
CALIBRATED_CODECS = ("pca",)


def get_codec(codec: str | KVCodec, field: str = "codec") -> KVCodec:
    """A codec by name (one of `CODECS`), or the codec object itself; ConfigError naming `field` otherwise."""
    if isinstance(codec, str):
        if codec in CALIBRATED_CODECS:
            raise ConfigError(f"{field}={codec!r} is fitted to a model: name it in an engine's StoreConfig (the engine "
                              f"calibrates it), or pass a TransformCodec(KVCalibration...) to the store")  # fmt: skip
        if codec not in CODECS:
            raise ConfigError(f"{field} must be one of {sorted(CODECS)}, got {codec!r}")
        return CODECS[codec]
    if not isinstance(codec, KVCodec):
        raise ConfigError(f"{field} must be a codec name {sorted(CODECS)} or a KVCodec, got {type(codec).__name__}")
    return codec


def stored_bytes_per_token(
    codec: KVCodec, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, tokens: int = 512
) -> float:
    """Bytes a chunk of `tokens` tokens takes per token with `codec` (payloads only, without the entry header)."""
    key_bytes, value_bytes = codec.payload_spec((num_kv_heads, tokens, head_dim), dtype).nbytes()
    return num_layers * (key_bytes + value_bytes) / tokens
