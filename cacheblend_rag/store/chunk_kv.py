"""A chunk's precomputed KV cache (an immutable value) and the key it is stored under.

A chunk is prefilled once after the shared prefix; only the chunk's own K/V are kept. Keys are kept *raw*
(before RoPE) so that the engine can place the chunk at any offset of any prompt with `rotate_keys`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import CacheBlendError, CorruptEntryError


def chunk_key(
    fingerprint: str,
    dtype: torch.dtype | str,
    prefix_ids: Sequence[int],
    chunk_ids: Sequence[int],
    context: str = "",
) -> str:
    """Content address of a chunk's KV: sha256 of the model, the dtype, the prefix tokens, the chunk tokens and
    the digest of the context the chunk was prefilled after ("" for none: the isolated entry, whose key is the
    same as before contexts existed).

    The prefix and the context are part of the key because the chunk was prefilled after them: other text before
    it gives other KV. Lengths are hashed before the token lists so that no two (prefix, chunk) splits collide.
    """
    h = hashlib.sha256()
    h.update(fingerprint.encode())
    h.update(b"\0" + str(dtype).removeprefix("torch.").encode() + b"\0")
    for ids in (prefix_ids, chunk_ids):
        h.update(struct.pack("<Q", len(ids)))
        h.update(struct.pack(f"<{len(ids)}q", *ids))
    if context:
        h.update(b"\0context\0" + context.encode())
    return h.hexdigest()


@dataclass(frozen=True, eq=False)
class ChunkKV:
    """K/V of one chunk on every layer.

    keys:   [L, Hkv, T, D] before RoPE
    values: [L, Hkv, T, D]
    base:   the key of the chunk's isolated entry when this is another entry of the same chunk (a captured one);
            a tier may store this entry coded against that one ("" for none)
    """

    key: str
    keys: torch.Tensor
    values: torch.Tensor
    base: str = ""

    def __post_init__(self) -> None:
        if self.keys.shape != self.values.shape or self.keys.dim() != 4:
            raise CacheBlendError(
                f"chunk KV must be two [layers, kv_heads, tokens, head_dim] tensors of one shape, "
                f"got keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)}"
            )
        if self.keys.dtype != self.values.dtype:
            raise CacheBlendError(f"keys and values differ in dtype: {self.keys.dtype} vs {self.values.dtype}")

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """[L, Hkv, T, D] of the keys (and of the values)."""
        return tuple(self.keys.shape)  # type: ignore[return-value]

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> raw keys, values of one layer, [Hkv, T, D] each (views, no copy)."""
        return self.keys[layer_idx], self.values[layer_idx]

    def materialize(self) -> ChunkKV:
        """Already whole: itself (the `ChunkReader` protocol that `LazyChunkKV` shares)."""
        return self

    def in_memory(self) -> ChunkKV:
        """Every layer is here: itself."""
        return self

    def when_whole(self, callback: Callable[[ChunkKV], None]) -> None:
        """Call `callback(self)` now: every layer is here already."""
        callback(self)

    def when_corrupt(self, callback: Callable[[CorruptEntryError], None]) -> None:
        """Never calls `callback`: a chunk in memory was checked when it was made."""

    def to(self, device: torch.device | str) -> ChunkKV:
        if self.keys.device == torch.device(device):
            return self
        return ChunkKV(self.key, self.keys.to(device), self.values.to(device), self.base)
