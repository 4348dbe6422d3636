"""The `pca` codec: chunk KV turned into each head's principal components, quantized with one step per layer, and
entropy-coded with zstd: about 5 bits per stored value on the default model (int8: 8.3), with about a sixth of int4's
rounding error.

Keys (before RoPE) and values of one head at one layer are points in D dimensions that fill few of them: a few
directions carry most of the variance. A calibration (`KVCalibration`, fitted once per model on KV of a fixed text)
keeps, per layer, kind (keys or values) and KV head, the mean and the eigenvectors of those points. Encoding
subtracts the mean, projects on the eigenvectors and rounds every coordinate to a multiple of one step, the same for
all of them, so each coordinate gets the same rounding error (what minimises the total error for the bits spent:
reverse water-filling). Low-variance coordinates then round to mostly zero and cost almost nothing once coded.
The step is set from the calibration's variance so that the mean squared error is a fixed share of it
(`REL_MSE`: 0.07% for keys, 0.14% for values; int4 in groups of 32 leaves ~0.4% and ~0.8%, which costs the blend
fidelity; the study is `research/kv_transform_codec.py`).

A layer's payload (keys or values) is a few bytes: a `<I` (how many codes fell outside int8), one `<I` per group of
component ranks (the length of its zstd frame), the outside codes' flat positions (int32) and values (int32), then
the int8 codes in component-major order ([H, D, T]: each component's tokens side by side, so similar values are
adjacent), one zstd frame per group of ranks (0-3, 4-7, 8-15, 16-31, ... up to D). The first components spread over
many codes and the last over a few: a frame each gives each group a Huffman table fitted to its spread (0.16 bit a
value fewer than one frame per layer on the default model). Payloads differ in length from entry to entry; the entry
header records each layer's (`serialize.py`, format 4). A chunk's captured entry can be stored as the difference of
its codes from its isolated entry's (`encode_against`, format 5): about 3.2 bits a value instead of 5.

An entry records the codec's name, which names the payload's layout and the calibration's digest: an entry written
under another calibration or layout is a miss, never decoded in the wrong basis.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import zstandard
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..errors import CorruptEntryError
from .codec import PayloadSpec, Shape3

CALIBRATION_FORMAT = "cacheblend-rag/kv-calibration"
CALIBRATION_VERSION = "1"
REL_MSE = (0.0007, 0.0014)  # the rounding error of keys and of values, as a share of their variance
PAYLOAD_LAYOUT = 2  # 2: a zstd frame per group of component ranks (1: one frame per layer; read as misses)
_ZSTD_LEVEL = 3
_TENSORS = ("mean", "encode", "decode", "step", "bits")  # a calibration's, in the constructor's order


@dataclass(frozen=True, eq=False)
class KVCalibration:
    """Per layer, kind (0 keys, 1 values) and KV head: the mean [L, 2, H, D], the matrix into the coded coordinates
    and the one back [L, 2, H, D, D] (the principal axes as columns, and their transpose), the rounding step
    [L, 2, H], and the bits a value took on the calibration text once coded [L, 2]
    (what sizing estimates go by). float32 throughout."""

    mean: torch.Tensor
    encode: torch.Tensor
    decode: torch.Tensor
    step: torch.Tensor
    bits: torch.Tensor
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        L, two, H, D = self.mean.shape
        shapes = [tuple(t.shape) for t in (self.mean, self.encode, self.decode, self.step, self.bits)]
        if two != 2 or shapes[1:] != [(L, 2, H, D, D), (L, 2, H, D, D), (L, 2, H), (L, 2)]:
            raise ValueError(f"calibration tensors disagree: mean, encode, decode, step, bits of shapes {shapes}")
        h = hashlib.sha256(CALIBRATION_VERSION.encode())
        for t in (self.mean, self.encode, self.decode, self.step):
            h.update(t.contiguous().numpy().tobytes())
        object.__setattr__(self, "digest", h.hexdigest())

    @property
    def shape(self) -> tuple[int, int, int]:
        """(layers, KV heads, head dim) the calibration is for."""
        L, _, H, D = self.mean.shape
        return L, H, D

    @classmethod
    def fit(cls, keys: torch.Tensor, values: torch.Tensor, rel_mse: tuple[float, float] = REL_MSE) -> KVCalibration:
        """From sample KV [L, H, N, D] (keys before RoPE): each head's mean, principal axes, and a step per layer
        that makes the rounding error `rel_mse` of that layer's variance (keys, values)."""
        if keys.shape != values.shape or keys.dim() != 4 or keys.shape[2] < 2 * keys.shape[3]:
            raise ValueError(f"calibration needs keys and values [L, H, N, D] of one shape with N >= 2 D, "
                             f"got {tuple(keys.shape)} and {tuple(values.shape)}")  # fmt: skip
        L, H, _, D = keys.shape
        mean, step = torch.empty(L, 2, H, D), torch.empty(L, 2, H)
        encode, decode = torch.empty(L, 2, H, D, D), torch.empty(L, 2, H, D, D)
        for kind, (x, rel) in enumerate(((keys, rel_mse[0]), (values, rel_mse[1]))):
            x = x.double()
            mu = x.mean(2)  # [L, H, D]
            centred = x - mu[:, :, None]
            _, vectors = torch.linalg.eigh(centred.transpose(2, 3) @ centred / (x.shape[2] - 1))  # ascending
            vectors = vectors.flip(-1)
            mean[:, kind] = mu.float()
            encode[:, kind] = vectors.float()
            decode[:, kind] = vectors.transpose(2, 3).float()
            variance = centred.pow(2).mean((2, 3)).clamp_min(1e-12)  # [L, H], per coordinate
            step[:, kind] = (12 * rel * variance).sqrt().float()
        bits = torch.empty(L, 2)
        codec = TransformCodec(cls(mean, encode, decode, step, bits))
        for layer in range(L):
            for kind, x in enumerate((keys, values)):
                codes = codec.codes(x[layer], layer, kind)
                bits[layer, kind] = len(codec.pack(codes)) * 8 / codes.numel()
        return cls(mean, encode, decode, step, bits)

    def save(self, path: str | Path) -> None:
        tensors = {name: getattr(self, name) for name in _TENSORS}
        meta = {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION, "digest": self.digest}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> KVCalibration:
        """A saved calibration; ValueError when the file is not one, or not the one its header says."""
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
            if meta.get("format") != CALIBRATION_FORMAT or meta.get("version") != CALIBRATION_VERSION:
                raise ValueError(f"{path} is not a version-{CALIBRATION_VERSION} KV calibration (header {meta})")
            t = load_file(str(path))
            calibration = cls(*(t[name].float() for name in _TENSORS))
        except (SafetensorError, KeyError) as exc:
            raise ValueError(f"{path} is not a readable KV calibration: {exc}") from exc
        if calibration.digest != meta.get("digest"):
            raise ValueError(f"{path} does not match its own digest: damaged")
        return calibration


def component_groups(head_dim: int) -> list[tuple[int, int]]:
    """[start, end) ranks of the components coded as one zstd frame each: 0-3, 4-7, 8-15, ... doubling up to
    head_dim (ranks count from the largest variance)."""
    edges = [0]
    while edges[-1] < head_dim:
        edges.append(min(head_dim, max(4, 2 * edges[-1])))
    return list(zip(edges[:-1], edges[1:], strict=True))


class TransformCodec:
    """The `pca` codec over one calibration (`KVCalibration`): a `KVCodec` whose payloads vary in length."""

    def __init__(self, calibration: KVCalibration) -> None:
        self.calibration = calibration
        self.name = f"pca{PAYLOAD_LAYOUT}-{calibration.digest[:16]}"
        self._groups = component_groups(calibration.shape[2])
        self._head = struct.Struct(f"<{1 + len(self._groups)}I")  # outside codes, then each frame's length
        # decoding in one product from the codes: the way back with the step folded in, [L, 2, H, D, D]
        self._back = calibration.decode * calibration.step[..., None, None]

    def _check(self, shape: Shape3) -> None:
        L, H, D = self.calibration.shape
        if shape[0] != H or shape[2] != D:
            raise ValueError(f"this calibration is for {H} KV heads of {D} dims, got a layer of shape {tuple(shape)}")

    def payload_spec(self, shape: Shape3, dtype: torch.dtype) -> PayloadSpec:
        """Variable payloads; their typical length (the calibration's bits per value, whole layers averaged)."""
        self._check(shape)
        per_layer = self.calibration.bits.mean(0)  # [2]
        n = math.prod(shape)
        typical = [int(math.ceil(n * float(b) / 8)) + self._head.size for b in per_layer]
        return PayloadSpec(torch.uint8, (typical[0],), (typical[1],), variable=True)

    # -- one layer -----------------------------------------------------------------------------------------------
    def codes(self, x: torch.Tensor, layer: int, kind: int) -> torch.Tensor:
        """x [H, T, D] -> integer codes [H, D, T] (int32, component-major) of its coordinates in the basis."""
        c = self.calibration
        mean = c.mean[layer, kind].to(x.device)[:, None, :]
        step = c.step[layer, kind].to(x.device)[:, None, None]
        z = torch.matmul(x.float() - mean, c.encode[layer, kind].to(x.device)).div_(step)  # [H, T, D]
        return z.round_().clamp_(-(2**30), 2**30).to(torch.int32).transpose(1, 2).contiguous()

    def pack(self, codes: torch.Tensor) -> bytes:
        """Codes [H, D, T] -> the payload bytes: the frames' lengths, outliers, then a zstd frame per group of ranks."""
        codes = codes.cpu()
        flat = codes.reshape(-1)
        wide = (flat.abs() > 127).nonzero().squeeze(1)
        small = codes.clamp(-127, 127).to(torch.int8)
        zstd = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
        frames = [zstd.compress(small[:, a:b].contiguous().numpy().tobytes()) for a, b in self._groups]
        head = self._head.pack(len(wide), *(len(f) for f in frames))
        positions = wide.to(torch.int32).numpy().tobytes()
        wide_values = flat[wide].numpy().astype("<i4").tobytes()
        return b"".join((head, positions, wide_values, *frames))

    def unpack(self, payload: bytes | memoryview | torch.Tensor, shape: Shape3) -> torch.Tensor:
        """Payload bytes of a layer of `shape` [H, T, D] -> codes [H, D, T] (float32); CorruptEntryError if they do
        not hold exactly that many codes."""
        data = memoryview(payload.numpy()) if isinstance(payload, torch.Tensor) else memoryview(payload)
        h, t, d = shape
        n = h * t * d
        head = self._head
        if len(data) < head.size:
            raise CorruptEntryError(f"pca payload of {len(data)} bytes is too short for its header")
        n_wide, *frame_lengths = head.unpack_from(data)
        start = head.size + 8 * n_wide
        if n_wide > n or start + sum(frame_lengths) != len(data):
            raise CorruptEntryError(
                f"pca payload holds {len(data)} bytes, its header says {start + sum(frame_lengths)}"
            )
        codes = torch.empty(h, d, t)
        zstd = zstandard.ZstdDecompressor()
        for (a, b), length in zip(self._groups, frame_lengths, strict=True):
            want = h * (b - a) * t
            try:
                raw = zstd.decompress(data[start : start + length], max_output_size=want)
            except zstandard.ZstdError as exc:
                raise CorruptEntryError(f"pca payload's zstd frame is damaged: {exc}") from exc
            if len(raw) != want:
                raise CorruptEntryError(f"pca payload decodes to {len(raw)} codes for ranks {a}-{b - 1}, not {want}")
            codes[:, a:b] = torch.from_numpy(np.frombuffer(raw, np.int8).astype(np.float32).reshape(h, b - a, t))
            start += length
        if n_wide:
            positions = torch.from_numpy(np.frombuffer(data[head.size : head.size + 4 * n_wide], "<i4").copy())
            if int(positions.min()) < 0 or int(positions.max()) >= n:
                raise CorruptEntryError("pca payload names an outlier outside its layer")
            wide = np.frombuffer(data[head.size + 4 * n_wide : head.size + 8 * n_wide], "<i4").astype(np.float32)
            codes.view(-1)[positions.long()] = torch.from_numpy(wide)
        return codes

    def values_of(self, codes: torch.Tensor, layer: int, kind: int, dtype: torch.dtype) -> torch.Tensor:
        """Codes [H, D, T] -> x [H, T, D] in `dtype`: back from the basis."""
        h, d, t = codes.shape
        mean = self.calibration.mean[layer, kind].to(codes.device)[:, None, :].expand(h, t, d)
        return torch.baddbmm(mean, codes.transpose(1, 2), self._back[layer, kind].to(codes.device)).to(dtype)

    # -- the KVCodec protocol ---------------------------------------------------------------------------------------
    def encode(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._encode(k, v, layer, None)

    def decode(
        self, key_payload: torch.Tensor, value_payload: torch.Tensor, shape: Shape3, dtype: torch.dtype, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._values(self.codes_of(key_payload, value_payload, shape, layer), layer, dtype)

    # -- the CodesCodec protocol: an entry coded against another (a chunk's captured entry against its isolated one)
    def codes_of(
        self, key_payload: torch.Tensor, value_payload: torch.Tensor, shape: Shape3, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._check(shape)
        if not 0 <= layer < self.calibration.shape[0]:
            raise CorruptEntryError(f"pca entry has a layer {layer}; the calibration has {self.calibration.shape[0]}")
        return self.unpack(key_payload, shape), self.unpack(value_payload, shape)

    def encode_against(
        self, k: torch.Tensor, v: torch.Tensor, layer: int, base: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._encode(k, v, layer, base)

    def decode_against(
        self,
        key_payload: torch.Tensor,
        value_payload: torch.Tensor,
        shape: Shape3,
        dtype: torch.dtype,
        layer: int,
        base: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        delta = self.codes_of(key_payload, value_payload, shape, layer)
        if any(b.shape != d.shape for b, d in zip(base, delta, strict=True)):
            raise CorruptEntryError(f"pca entry's base codes are of shape {tuple(base[0].shape)}, its own of "
                                    f"{tuple(delta[0].shape)}")  # fmt: skip
        return self._values((delta[0].add_(base[0]), delta[1].add_(base[1])), layer, dtype)

    def _encode(
        self, k: torch.Tensor, v: torch.Tensor, layer: int, base: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The payloads of k and v: their codes, less `base`'s (another entry's codes of this layer) when given."""
        self._check(tuple(k.shape))
        payloads = []
        for kind, x in enumerate((k, v)):
            codes = self.codes(x, layer, kind).cpu()
            if base is not None:
                if base[kind].shape != codes.shape:
                    raise ValueError(f"base codes of shape {tuple(base[kind].shape)} for a layer coded as "
                                     f"{tuple(codes.shape)}")  # fmt: skip
                codes = codes - base[kind].to(torch.int32)
            payloads.append(self.pack(codes))
        return tuple(torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in payloads)  # type: ignore[return-value]

    def _values(
        self, codes: tuple[torch.Tensor, torch.Tensor], layer: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Key codes and value codes [H, D, T] -> k, v [H, T, D] in `dtype`."""
        return self.values_of(codes[0], layer, 0, dtype), self.values_of(codes[1], layer, 1, dtype)
