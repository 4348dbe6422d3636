"""RoPE as the adapter applies it: pure functions over keys (or queries) and cos / sin tables.

A model's tables are [T, K * D]: one block of D channels per kind of rotation its layers use (`LayerwiseModel.rope`):
one block for most families; Gemma 3's local and global layers rotate with different bases, and a layer without
RoPE (SmolLM3's every fourth, Exaone 4's global ones) reads a block of cos 1, sin 0, which leaves a key exactly as
it is. `LayerwiseModel.layer_rope` picks a layer's block; the functions here take one block ([..., D]).
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_keys(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to raw keys (or queries).

    x: [..., T, D]; cos, sin: [T, D] for the tokens' target positions. Same formula as transformers'
    `apply_rotary_pos_emb`, so a raw key rotated here equals the key an in-context prefill computes.
    """
    return x * cos + rotate_half(x) * sin


def signed_sin(sin: torch.Tensor, head_dim: int | None = None) -> torch.Tensor:
    """The sine table with the first half of each block of `head_dim` channels (default: the whole last dimension)
    negated ([..., K * D]): `rope_rotate`'s form of `rotate_half(x) * sin`."""
    d = sin.shape[-1] if head_dim is None else head_dim
    blocks = sin.unflatten(-1, (-1, d))  # [..., K, D]
    half = d // 2
    return torch.cat((-blocks[..., :half], blocks[..., half:]), dim=-1).flatten(-2)


def rope_rotate(
    x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`rotate_keys` with the sine table made once (`signed_sin`): one `roll` instead of two slices, a negation
    and a `cat`, and the second product added as it is made (`addcmul`). x: [..., T, D]; cos, sin_signed: [T, D];
    `out`: where to write the result (e.g. a slice of a buffer), instead of a new tensor."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed, out=out)


def unrotate_keys(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo `rotate_keys`: keys rotated at the positions of `cos`, `sin` ([T, D]) -> raw keys [H, T, D].

    RoPE turns each pair of channels by an angle; turning it back by minus that angle is exact in real numbers,
    and within a few units of the last place in floating point (pass float32 keys and cos, sin for stored KV).
    """
    return x * cos.unsqueeze(0) - rotate_half(x) * sin.unsqueeze(0)


def no_rotation(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block of a layer without RoPE: cos 1 and sin 0 in `like`'s shape, which rotate nothing (exactly)."""
    return torch.ones_like(like), torch.zeros_like(like)
