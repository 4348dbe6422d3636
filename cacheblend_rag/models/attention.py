"""torch's fused attention as the package calls it: the kernels it may pick on a GPU, and a query block shaped so
that the CPU's kernel takes its fast path; the masks built from positions (causal, and a sliding window); attention
written out for the softmaxes the fused kernel does not take (soft-capping, sinks).

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


def causal_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Boolean attention mask from true positions: query i may see key j iff pos(j) <= pos(i), and, in a layer with
    a sliding `window`, pos(i) - window < pos(j).

    q_positions: [A]; k_positions: [N] -> [A, N]. Built from positions, not from row/column order, so any
    subset of queries in any order attends exactly as it would inside a full causal prefill.
    """
    allowed = k_positions.unsqueeze(0) <= q_positions.unsqueeze(1)
    if window is not None:
        allowed &= k_positions.unsqueeze(0) > q_positions.unsqueeze(1) - window
    return allowed


def attention_probs(
    query: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention probabilities written out, for the softmaxes torch's fused kernel does not take (transformers' eager
    attention): scores soft-capped (`softcap * tanh(scores / softcap)`, Gemma 2) and one sink logit per head
    (GPT-OSS), whose weight is dropped after the softmax.

    query: [..., H, A, D]; keys: [..., Hkv, N, D]; mask: broadcastable to [..., H, A, N], bool (True = may attend) or
    additive; sinks: [H]. -> [..., H, A, N] float32; each query's row sums to 1 (less its sink's share).
    """
    groups = query.shape[-3] // keys.shape[-3]
    keys = keys.repeat_interleave(groups, dim=-3) if groups > 1 else keys
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scale  # [..., H, A, N]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    logits = torch.cat((scores, sink), dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    return torch.softmax(logits, dim=-1)[..., :-1]


def written_out_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
    *, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """`attention_probs` applied to the values ([..., Hkv, N, D]) -> [..., H, A, D] in the values' dtype."""
    probs = attention_probs(query, keys, mask, scale, softcap=softcap, sinks=sinks)
    groups = query.shape[-3] // values.shape[-3]
    values = values.repeat_interleave(groups, dim=-3) if groups > 1 else values
    return torch.matmul(probs.to(values.dtype), values)
