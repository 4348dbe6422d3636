"""One prompt's KV on the device, every layer in one buffer: stored keys placed and rotated once per request.

The fusor reads and writes a prompt's KV through a `PromptKV`: keys rotated at their prompt positions and values,
each one tensor [L, Hkv, N, D] made once per request. Stored chunk KV is laid into it end to end and rotated there
once for all layers (`whole`), or, when the chunks are read from disk or Redis layer by layer, one layer at a time
as the fusor first asks for it (`layerwise`). The fusor writes the KV it recomputes into the same buffers, a
second pass over the prompt reads them as the first left them, and decoding reads them as they are (the buffers can
be the request's slot of the decode pool): no per-layer `cat`, `clone` or re-rotation of the whole prompt.

Keys are rotated with the adapter's `rope_rotate`: the model's formula, with the sine table made once. A model whose
layers rotate differently (`LayerwiseModel.rope`: one block of tables per kind) gives each layer's block
(`rope_blocks`); its layers are then rotated one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..errors import CacheBlendError
from ..models.adapter import rope_rotate, signed_sin

# layer_idx -> (raw keys [Hkv, T, D], values [Hkv, T, D]) of the prompt's stored KV laid end to end (T <= N tokens,
# from the prompt's start), read when the fusor first needs that layer
LayerLoader = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def _block(
    cos: torch.Tensor, sin_signed: torch.Tensor, block: int, head_dim: int, tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `tokens` rows of one block of D channels of the tables ([N, K * D] -> [tokens, D])."""
    start = block * head_dim
    return cos[:tokens, start : start + head_dim], sin_signed[:tokens, start : start + head_dim]


class PromptKV:
    """The KV of a prompt's N tokens on every layer: `keys` (rotated at their positions) and `values`, each
    [L, Hkv, N, D], and with `raw_keys` the keys before RoPE too (what a chunk's entry stores).

    `keys` and `values` are the first N positions of the buffers `key_buffer`, `value_buffer` ([L, Hkv, >= N, D]),
    from which a request starts decoding (they are its slot of the decode pool when the scheduler gave them, else
    copied into it). Build it with `whole` (stored KV of
    every layer at hand) or `layerwise` (read a layer when it is first asked for); `layer(i)` returns writable views
    of layer i. Tokens past the stored ones hold zeros until written.
    """

    def __init__(
        self,
        key_buffer: torch.Tensor,
        value_buffer: torch.Tensor,
        num_tokens: int,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        raw_keys: torch.Tensor | None = None,
        load: LayerLoader | None = None,
        rope_blocks: Sequence[int] | None = None,
    ) -> None:
        if key_buffer.shape != value_buffer.shape or key_buffer.dim() != 4 or key_buffer.shape[2] < num_tokens:
            raise CacheBlendError(f"keys and values must be two [L, Hkv, >= {num_tokens}, D] tensors of one shape, "
                                  f"got {tuple(key_buffer.shape)} and {tuple(value_buffer.shape)}")  # fmt: skip
        self.key_buffer = key_buffer
        self.value_buffer = value_buffer
        self.keys = key_buffer[:, :, :num_tokens]
        self.values = value_buffer[:, :, :num_tokens]
        self.raw_keys = raw_keys
        self.cos = cos  # [N, K * D]: the prompt positions' RoPE tables (K blocks of D), in the keys' dtype
        self.sin_signed = sin_signed
        self.rope_blocks = None if rope_blocks is None else tuple(rope_blocks)  # per layer its block; None: K = 1
        self._load = load
        self._filled = 0 if load is not None else key_buffer.shape[0]  # layers 0.._filled-1 hold their stored KV
        self._views = list(zip(self.keys.unbind(0), self.values.unbind(0), strict=True))  # per layer, made once
        self._rows: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # the same, token-major (`rows`)
        self._batched: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # the same, [1, Hkv, N, D] (`batched`)

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
        buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
        rope_blocks: Sequence[int] | None = None,
    ) -> PromptKV:
        """Stored KV of every layer (`parts`: raw keys and values [L, Hkv, T_p, D] each, laid end to end from the
        prompt's start) in buffers of `total` tokens, rotated once. cos, sin: [total, K * D] of the prompt's
        positions; shape: (L, Hkv, D); rope_blocks: each layer's block of the tables (None: one block, K = 1).
        `buffers`: keys and values [L, Hkv, >= total, D] to lay them in (a request's slot of the decode pool, which
        then decodes from them as they are); None: new ones."""
        stored = sum(k.shape[2] for k, _ in parts)
        if stored > total:
            raise CacheBlendError(f"{stored} stored tokens do not fit a prompt of {total}")
        keys, values = cls._buffers(shape, total, cos, buffers)
        sin_signed = signed_sin(sin, shape[2])
        raw = None
        if parts:
            device = cos.device
            raw_parts = [k.to(device) for k, _ in parts]
            raw = raw_parts[0] if len(raw_parts) == 1 else torch.cat(raw_parts, dim=2)
            value_parts = [v.to(device) for _, v in parts]
            if len(value_parts) == 1:
                values[:, :, :stored] = value_parts[0]
            else:
                torch.cat(value_parts, dim=2, out=values[:, :, :stored])
            if rope_blocks is None:
                rope_rotate(raw, cos[:stored], sin_signed[:stored], out=keys[:, :, :stored])  # every layer at once
            else:
                for layer_idx, block in enumerate(rope_blocks):
                    c, s = _block(cos, sin_signed, block, shape[2], stored)
                    rope_rotate(raw[layer_idx], c, s, out=keys[layer_idx, :, :stored])
        keys[:, :, stored:total].zero_()
        values[:, :, stored:total].zero_()
        raw_keys = cls._raw_buffer(shape, total, cos) if keep_raw else None
        if raw_keys is not None and raw is not None:
            raw_keys[:, :, :stored] = raw
        return cls(keys, values, total, cos, sin_signed, raw_keys=raw_keys, rope_blocks=rope_blocks)

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
        buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
        rope_blocks: Sequence[int] | None = None,
    ) -> PromptKV:
        """Buffers of `total` tokens (`buffers`, as for `whole`); layer i is read with `load(i)` (in order 0, 1, ...)
        and rotated when it is first asked for."""
        keys, values = cls._buffers(shape, total, cos, buffers)
        keys[:, :, :total].zero_()
        values[:, :, :total].zero_()
        raw = cls._raw_buffer(shape, total, cos) if keep_raw else None
        return cls(keys, values, total, cos, signed_sin(sin, shape[2]), raw_keys=raw, load=load,
                   rope_blocks=rope_blocks)  # fmt: skip

    @staticmethod
    def _buffers(
        shape: tuple[int, int, int],
        capacity: int,
        like: torch.Tensor,
        given: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value buffers [L, Hkv, >= capacity, D] in `like`'s dtype and device, not initialized: `given`
        ones, checked, else new."""
        num_layers, hkv, d = shape
        if given is None:
            keys = torch.empty((num_layers, hkv, capacity, d), dtype=like.dtype, device=like.device)
            return keys, torch.empty_like(keys)
        keys, values = given
        for t in (keys, values):
            if (t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != shape or t.shape[2] < capacity
                    or t.dtype != like.dtype or t.device != like.device):  # fmt: skip
                raise CacheBlendError(
                    f"buffers for {capacity} tokens must be [{num_layers}, {hkv}, >= {capacity}, {d}] in "
                    f"{like.dtype} on {like.device}, got {tuple(t.shape)} in {t.dtype} on {t.device}"
                )
        return keys, values

    @staticmethod
    def _raw_buffer(shape: tuple[int, int, int], total: int, like: torch.Tensor) -> torch.Tensor:
        """Zeros [L, Hkv, total, D] for the keys before RoPE."""
        return torch.zeros(shape[0], shape[1], total, shape[2], dtype=like.dtype, device=like.device)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> rotated keys, values of one layer [Hkv, N, D]: views the fusor writes recomputed tokens into."""
        if layer_idx >= self._filled:
            self._read(layer_idx)
        return self._views[layer_idx]

    def rows(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer(layer_idx)` token-major: rotated keys, values [N, Hkv, D], views for writing rows of tokens (the
        views of every layer are made once, at the first call)."""
        self.layer(layer_idx)
        if self._rows is None:
            keys, values = self.keys.transpose(1, 2), self.values.transpose(1, 2)
            self._rows = list(zip(keys.unbind(0), values.unbind(0), strict=True))
        return self._rows[layer_idx]

    def batched(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer(layer_idx)` as a batch of one request: rotated keys, values [1, Hkv, N, D] (what attention and a
        transformers cache take; the views of every layer are made once, at the first call)."""
        self.layer(layer_idx)
        if self._batched is None:
            keys, values = self.keys.unsqueeze(1), self.values.unsqueeze(1)
            self._batched = list(zip(keys.unbind(0), values.unbind(0), strict=True))
        return self._batched[layer_idx]

    def _read(self, layer_idx: int) -> None:
        if layer_idx != self._filled or self._load is None:
            raise CacheBlendError(f"layers are first read in order: expected layer {self._filled}, got {layer_idx}")
        raw_k, v = self._load(layer_idx)  # [Hkv, T, D], T stored tokens from the start
        t = raw_k.shape[1]
        if t > self.num_tokens:
            raise CacheBlendError(f"layer {layer_idx} has {t} stored tokens for a prompt of {self.num_tokens}")
        raw_k, v = raw_k.to(self.keys.device), v.to(self.keys.device)
        block = 0 if self.rope_blocks is None else self.rope_blocks[layer_idx]
        cos, sin_signed = _block(self.cos, self.sin_signed, block, self.keys.shape[-1], t)
        rope_rotate(raw_k, cos, sin_signed, out=self.keys[layer_idx, :, :t])
        self.values[layer_idx, :, :t] = v
        if self.raw_keys is not None:
            self.raw_keys[layer_idx, :, :t] = raw_k
        self._filled += 1
        if self._filled == self.num_layers:
            self._load = None  # the reader (and what it holds) is not needed any more

    def copy(self) -> PromptKV:
        """A copy of every layer, read to the end first (what a second blend over the same stored KV starts from)."""
        self._read_all()
        raw = None if self.raw_keys is None else self.raw_keys.clone()
        return PromptKV(self.key_buffer.clone(), self.value_buffer.clone(), self.num_tokens, self.cos,
                        self.sin_signed, raw_keys=raw, rope_blocks=self.rope_blocks)  # fmt: skip

    def layers(self, *, batched: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (rotated keys, values) [Hkv, N, D] as views, read to the end first; with `batched`
        [1, Hkv, N, D] (what a transformers cache holds)."""
        self._read_all()
        return [self.batched(i) if batched else self._views[i] for i in range(self.num_layers)]

    def _read_all(self) -> None:
        """Read every layer not read yet (in order)."""
        while self._filled < self.num_layers:
            self._read(self._filled)
