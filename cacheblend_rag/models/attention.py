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

That kernel also runs bf16 at a small share of the CPU's bf16 product rate (a causal prefill of ~1,400 tokens of the
default model: 26 ms a layer, against 3.4 ms of products at the packed-linear rate). `blocked_attention` writes the
same attention as bf16 products over blocks of queries: each block's scores against only the keys its rows may see
(the causal square is never filled), masked on the block's last keys, softmax, then the values: 10-12 ms a layer.
A query head's group (grouped-query attention) shares its KV head's products. Its scores are rounded to bf16
before the softmax (torch's CPU matrix products have no bf16-in, float32-out form); over a whole forward that moves
the default model's next-token distribution 0.0002-0.0004 nats further from float32's, and the blend stays as close
to full recompute (the study `research/prefill_cpu_paths.py` in the research log).
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


ATTENTION_BLOCK = 64  # query rows per block: 32-256 measured; 64 the fastest at 300-3,100 keys on AVX-512
_ABOVE_DIAGONAL = torch.ones(ATTENTION_BLOCK, ATTENTION_BLOCK, dtype=torch.bool).triu(1)


def blocked_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Attention as products over blocks of ATTENTION_BLOCK queries, for bf16 on a CPU (see the module's note).

    query: [H, A, D]; keys, values: [Hkv, N, D] (H a multiple of Hkv); mask: [A, N] bool (True = may attend), or
    None when the queries are the last A of the N keys' tokens, in order (causal, aligned at the end). A query row
    that may see no key gets NaN, as torch's kernel gives. -> [A, H, D], each query's heads side by side.
    """
    h, a, d = query.shape
    hkv, n = keys.shape[0], keys.shape[1]
    groups = h // hkv
    # [Hkv, A, groups, D]: a block of queries is then one contiguous [Hkv, rows x groups, D] operand; the scale is
    # applied here, once per query (exact where it is a power of two, as for head size 64)
    q = torch.mul(query.view(hkv, groups, a, d).transpose(1, 2), scale,
                  out=query.new_empty(hkv, a, groups, d))  # fmt: skip
    keys_t = keys.transpose(1, 2).contiguous()  # once: a product over transposed keys would copy them every block
    out = query.new_empty(a, hkv, groups, d)
    offset = n - a
    for start in range(0, a, ATTENTION_BLOCK):
        stop = min(a, start + ATTENTION_BLOCK)
        rows = stop - start
        if mask is None:
            seen = offset + stop
        else:  # keys up to the last one a row may see; the mask applied from the first one a row may not
            allowed = mask[start:stop].any(0).nonzero()
            seen = int(allowed[-1]) + 1 if allowed.numel() else 1
            hidden = mask[start:stop, :seen].logical_not().any(0).nonzero()
            first_hidden = int(hidden[0]) if hidden.numel() else seen
        scores = torch.bmm(q[:, start:stop].view(hkv, rows * groups, d), keys_t[:, :, :seen])
        scores = scores.view(hkv, rows, groups, seen)
        if mask is None:  # only the block's own square has keys after some of its rows
            scores[..., offset + start :].masked_fill_(_ABOVE_DIAGONAL[:rows, None, :rows], float("-inf"))
        elif first_hidden < seen:
            scores[..., first_hidden:].masked_fill_(~mask[start:stop, None, first_hidden:seen], float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(hkv, rows * groups, seen)
        out[start:stop] = torch.bmm(probs, values[:, :seen]).view(hkv, rows, groups, d).transpose(0, 1)
    return out.view(a, h, d)


def attend_queries(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    *,
    blocked: bool,
) -> torch.Tensor:
    """Attention of queries [H, A, D] over keys and values [Hkv, N, D] (or [1, Hkv, N, D]) -> [A, H x D], each
    query's heads side by side (what the output projection takes). mask: [A, N] (or [1, 1, A, N]), bool or additive
    (0 / -inf in the query's dtype), or None when the queries are the last A of the N tokens, in order (causal,
    aligned at the end). `blocked` (bf16 on a CPU, where the model's own forward attends so too): `blocked_attention`
    for a bool mask or none. Otherwise torch's fused kernel; queries aligned at the end are padded to the causal
    square (A == N is that square), which it runs without a mask, skipping the scores above the diagonal; the padded
    rows' outputs are dropped.
    """
    a, n = query.shape[1], keys.shape[-2]
    if blocked and query.dtype == torch.bfloat16 and (mask is None or mask.dtype == torch.bool):
        out = blocked_attention(query, keys.view(keys.shape[-3:]), values.view(values.shape[-3:]),
                                mask if mask is None else mask.view(mask.shape[-2:]), scale)  # fmt: skip
        return out.view(a, -1)
    padded = mask is None and a < n
    if padded:
        query = torch.cat((query.new_zeros(query.shape[0], n - a, query.shape[2]), query), dim=1)
    if keys.dim() == 3:
        keys, values = keys.unsqueeze(0), values.unsqueeze(0)
    with attention_kernels(query.device):
        out = fused_attention(query.unsqueeze(0), keys, values, mask if mask is None or mask.dim() == 4 else
                              mask[None, None], scale, is_causal=mask is None,
                              enable_gqa=query.shape[0] != keys.shape[1])  # fmt: skip
    if padded:
        out = out[:, :, -a:]
    return out.transpose(1, 2).reshape(a, -1)  # [1, H, A, D] -> [A, H x D]


BLOCKED_ATTENTION = "cacheblend_blocked"  # the name the model's own forward knows `blocked_attention` by


def _blocked_model_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention call ([B, H, T, D] queries, [B, Hkv, N, D] keys and values -> [B, T, H, D]):
    `blocked_attention` for one sequence in bf16 on a CPU attending causally without a mask (transformers leaves the
    mask out exactly then); every other call goes to transformers' own SDPA attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (
        attention_mask is None
        and is_causal is not False
        and query.shape[0] == 1
        and query.device.type == "cpu"
        and query.dtype == torch.bfloat16
        and kwargs.get("softcap") is None
        and kwargs.get("s_aux") is None
    ):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return blocked_attention(query[0], key[0], value[0], None, scale).unsqueeze(0), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


def use_blocked_attention(model: torch.nn.Module) -> None:
    """Make `model`'s own forward attend with `blocked_attention` where it applies (and the layer-wise adapter with
    it, which reads the model's choice): the engine does this for bf16 on a CPU. The model keeps SDPA's masks."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(BLOCKED_ATTENTION, _blocked_model_attention)
    AttentionMaskInterface.register(BLOCKED_ATTENTION, sdpa_mask)
    model.set_attn_implementation(BLOCKED_ATTENTION)


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
    *lead, h, a, d = query.shape
    hkv = keys.shape[-3]
    # each KV head's query heads as one block of rows ([..., Hkv, groups x A, D]): one product per KV head, and the
    # keys are not copied out to every query head
    grouped = query.reshape(*lead, hkv, (h // hkv) * a, d)
    scores = torch.matmul(grouped, keys.transpose(-1, -2))
    scores = scores.view(*scores.shape[:-3], h, a, -1).float()  # [..., H, A, N], a tensor of its own from here
    if scale != 1.0:  # float32 queries may come scaled already (`scale` 1): a pass over the scores less
        scores.mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None and mask.dim() > scores.dim():  # the shape broadcasting with the mask gives
        scores = scores.view((1,) * (mask.dim() - scores.dim()) + tuple(scores.shape))
    if mask is not None and mask.dtype == torch.bool:
        scores.masked_fill_(mask.logical_not(), float("-inf"))
    elif mask is not None:
        scores.add_(mask)
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
