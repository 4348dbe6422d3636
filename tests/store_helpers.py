"""Chunk KV for the store tests: small entries made from a seed, entries shaped like real KV (for the `pca`
codec), and exact comparison."""

from __future__ import annotations

import torch

from cacheblend_rag.store.chunk_kv import ChunkKV

# The disk and Redis tiers here keep the exact codec, not the lossy default (int8): these tests check the tiers'
# bookkeeping bit for bit. The default codec has its own tests in test_codec_store.py and test_codec.py.
EXACT_CODEC = "native"

L, H, D = 3, 2, 16  # the shape of `structured_kv`'s entries: layers, KV heads, head dim


def make_kv(name: str, tokens: int = 4, dtype: torch.dtype = torch.float32, seed: int = 0) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    shape = (2, 2, tokens, 8)  # [L, Hkv, T, D]
    keys = torch.randn(shape, generator=g).to(dtype)
    values = torch.randn(shape, generator=g).to(dtype)
    return ChunkKV(name, keys, values)


def same(a: ChunkKV, b: ChunkKV) -> bool:
    return a.key == b.key and a.dtype == b.dtype and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def structured_kv(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KV [L, H, T, D] whose variance sits in a few directions, with an outlier channel in the keys (as real keys
    before RoPE have), the same directions for every seed."""
    mix = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(99)))[0]
    scales = torch.logspace(1, -2, D)
    g = torch.Generator().manual_seed(seed)
    keys = (torch.randn(L, H, tokens, D, generator=g) * scales) @ mix.T
    keys[..., 3] += 30.0
    values = (torch.randn(L, H, tokens, D, generator=g) * scales) @ mix.T
    return keys, values
