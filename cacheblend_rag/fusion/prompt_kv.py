"""One prompt's KV on the device, every layer in one buffer: stored keys placed and rotated once per request.

The fusor reads and writes a prompt's KV through a `PromptKV`: keys rotated at their prompt positions and values,
each one tensor [L, Hkv, N, D] made once per request. Stored chunk KV is laid into it end to end and rotated there
once for all layers (`whole`), or, when the chunks are read from disk or Redis layer by layer, one layer at a time
as the fusor first asks for it (`layerwise`). The fusor writes the KV it recomputes into the same buffers, a
second pass over the prompt reads them as the first left them, and the decode cache takes each layer's slice as it
is: no per-layer `cat`, `clone` or re-rotation of the whole prompt.

Keys are rotated with the adapter's `rope_rotate`: the model's formula, with the sine table made once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..errors import CacheBlendError
from ..models.adapter import rope_rotate, signed_sin

# layer_idx -> (raw keys [Hkv, T, D], values [Hkv, T, D]) of the prompt's stored KV laid end to end (T <= N tokens,
# from the prompt's start), read when the fusor first needs that layer
LayerLoader = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


class PromptKV:
    """The KV of a prompt's N tokens on every layer: `keys` (rotated at their positions) and `values`, each
    [L, Hkv, N, D], and with `raw_keys` the keys before RoPE too (what a chunk's entry stores).

    Build it with `whole` (stored KV of every layer at hand) or `layerwise` (read a layer when it is first asked
    for); `layer(i)` returns writable views of layer i. Tokens past the stored ones hold zeros until written.
    """

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        raw_keys: torch.Tensor | None = None,
        load: LayerLoader | None = None,
    ) -> None:
        if keys.shape != values.shape or keys.dim() != 4:
            raise CacheBlendError(f"keys and values must be two [L, Hkv, N, D] tensors of one shape, got "
                                  f"{tuple(keys.shape)} and {tuple(values.shape)}")  # fmt: skip
        self.keys = keys
        self.values = values
        self.raw_keys = raw_keys
        self.cos = cos  # [N, D]: the prompt positions' RoPE tables, in the keys' dtype
        self.sin_signed = sin_signed
        self._load = load
        self._filled = 0 if load is not None else keys.shape[0]  # layers 0.._filled-1 hold their stored KV
        self._views = list(zip(keys.unbind(0), values.unbind(0), strict=True))  # per layer, made once

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    @classmethod
    def whole(
        cls,
        parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
        total: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        shape: tuple[int, int, int],
        keep_raw: bool = False,
    ) -> PromptKV:
        """Stored KV of every layer (`parts`: raw keys and values [L, Hkv, T_p, D] each, laid end to end from the
        prompt's start) in one buffer of `total` tokens, rotated once. cos, sin: [total, D] of the prompt's
        positions; shape: (L, Hkv, D)."""
        num_layers, hkv, d = shape
        stored = sum(k.shape[2] for k, _ in parts)
        if stored > total:
            raise CacheBlendError(f"{stored} stored tokens do not fit a prompt of {total}")
        device, dtype = cos.device, cos.dtype
        keys = [k.to(device) for k, _ in parts]
        values = [v.to(device) for _, v in parts]
        if stored < total:
            pad = torch.zeros(num_layers, hkv, total - stored, d, dtype=dtype, device=device)
            keys.append(pad)
            values.append(pad)
        # The fusor writes into these buffers: one part filling the whole prompt is copied, never written into.
        raw = keys[0] if len(keys) == 1 else torch.cat(keys, dim=2)
        v = values[0].clone() if len(values) == 1 else torch.cat(values, dim=2)
        if keep_raw and len(keys) == 1:
            raw = raw.clone()
        sin_signed = signed_sin(sin)
        rotated = rope_rotate(raw, cos, sin_signed)  # every layer at once
        return cls(rotated, v, cos, sin_signed, raw_keys=raw if keep_raw else None)

    @classmethod
    def layerwise(
        cls,
        load: LayerLoader,
        total: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        shape: tuple[int, int, int],
        keep_raw: bool = False,
    ) -> PromptKV:
        """Empty buffers of `total` tokens; layer i is read with `load(i)` (in order 0, 1, ...) and rotated when it
        is first asked for."""
        num_layers, hkv, d = shape
        size = (num_layers, hkv, total, d)
        keys = torch.zeros(size, dtype=cos.dtype, device=cos.device)
        values = torch.zeros(size, dtype=cos.dtype, device=cos.device)
        raw = torch.zeros(size, dtype=cos.dtype, device=cos.device) if keep_raw else None
        return cls(keys, values, cos, signed_sin(sin), raw_keys=raw, load=load)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> rotated keys, values of one layer [Hkv, N, D]: views the fusor writes recomputed tokens into."""
        if layer_idx >= self._filled:
            self._read(layer_idx)
        return self._views[layer_idx]

    def _read(self, layer_idx: int) -> None:
        if layer_idx != self._filled or self._load is None:
            raise CacheBlendError(f"layers are first read in order: expected layer {self._filled}, got {layer_idx}")
        raw_k, v = self._load(layer_idx)  # [Hkv, T, D], T stored tokens from the start
        t = raw_k.shape[1]
        if t > self.num_tokens:
            raise CacheBlendError(f"layer {layer_idx} has {t} stored tokens for a prompt of {self.num_tokens}")
        raw_k, v = raw_k.to(self.keys.device), v.to(self.keys.device)
        self.keys[layer_idx, :, :t] = rope_rotate(raw_k, self.cos[:t], self.sin_signed[:t])
        self.values[layer_idx, :, :t] = v
        if self.raw_keys is not None:
            self.raw_keys[layer_idx, :, :t] = raw_k
        self._filled += 1
        if self._filled == self.num_layers:
            self._load = None  # the reader (and what it holds) is not needed any more

    def copy(self) -> PromptKV:
        """A copy of every layer, read to the end first (what a second blend over the same stored KV starts from)."""
        while self._filled < self.num_layers:
            self._read(self._filled)
        raw = None if self.raw_keys is None else self.raw_keys.clone()
        return PromptKV(self.keys.clone(), self.values.clone(), self.cos, self.sin_signed, raw_keys=raw)

    def layers(self, *, batched: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (rotated keys, values) [Hkv, N, D] as views, read to the end first; with `batched`
        [1, Hkv, N, D] (what a transformers cache holds)."""
        while self._filled < self.num_layers:
            self._read(self._filled)
        if not batched:
            return list(self._views)
        return list(zip(self.keys.unsqueeze(1).unbind(0), self.values.unsqueeze(1).unbind(0), strict=True))
