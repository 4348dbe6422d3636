"""torch's fused attention as the package calls it: the kernels it may pick on a GPU, and a query block shaped so
that the CPU's kernel takes its fast path.

cuDNN's attention builds an execution graph for every new shape, and keeps the graphs per thread: a new prompt
length, a new count of recomputed tokens, each decode step's longer cache, and every request again on a fresh
scheduler thread. On an H200 that took 1.1 ms of host time per call when decoding (36 ms of a 50 ms step), and a
warm blend served through `generate` took about twice its prefill's time. The other kernels need no such set-up.

On a CPU in bf16, the fused kernel works through the queries in tiles (32 rows below 192 queries, 64 below 768,
256 above) and a tile of one row takes a slow path: at 3,143 keys, one query costs 2.0 ms and two 0.5 ms, 65
queries 7.4 ms and 66 6.0 ms (14 query heads, 2 KV heads, the 2-core AVX-512 EPYC; fp32 and fp16 do not show it).
`fused_attention` gives such a block one more row, a copy of its last, and drops its output.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_GPU_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_kernels(device: torch.device) -> AbstractContextManager[object]:
    """Where `F.scaled_dot_product_attention` runs inside: off the cuDNN kernel on a GPU (`_GPU_ATTENTION`).
    Entering it costs ~10-20 us of host time, so a loop of calls enters it once."""
    return sdpa_kernel(_GPU_ATTENTION) if device.type == "cuda" else nullcontext()


def lone_query_row(query: torch.Tensor) -> bool:
    """Whether the CPU's bf16 kernel would leave one query of `query` ([..., A, D]) in a tile of its own."""
    if query.device.type != "cpu" or query.dtype != torch.bfloat16:
        return False
    a = query.shape[-2]
    tile = 32 if a < 192 else 64 if a < 768 else 256
    return a % tile == 1


def fused_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    *,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, ...)` ([..., A, D] -> [..., A, D]),
    with a query block that would leave the CPU's bf16 kernel one row in a tile of its own given a copy of its last
    row (and of its mask's row), whose output is dropped. Causal calls are left as they are: their queries are
    aligned with the keys."""
    pad = not is_causal and lone_query_row(query)
    if pad:
        query = torch.cat((query, query[..., -1:, :]), dim=-2)
        if mask is not None and mask.shape[-2] > 1:  # a mask per query row, not one broadcast over the queries
            mask = torch.cat((mask, mask[..., -1:, :]), dim=-2)
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )
    return out[..., :-1, :] if pad else out
