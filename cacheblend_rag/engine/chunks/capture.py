"""KV captured from a full prefill: a prompt's full prefill computes some chunks' entries exactly, and storing them
costs nothing but the write (no chunk is prefilled a second time).

Which chunks those are is the request's plan (`Placement.capture`: the first chunk's isolated entry; under the
capture policy "all", every later chunk's captured entry; under "exact", a later chunk whose recorded context is
exactly the chunks before it); `capture` cuts their entries out of the prefill's KV, keys turned back to raw. A
later chunk's entry names the chunk's isolated entry as its base (`ChunkKV.base`): the two share most of their codes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...models.adapter import unrotate_keys
from ...store import ChunkKV
from ..request.prompt import TokenizedPrompt
from .cache import ChunkCache
from .placement import Placement

__all__ = ["capture"]


def capture(chunks: ChunkCache, prompt: TokenizedPrompt, layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
            placements: Sequence[Placement]) -> dict[tuple[int, ...], ChunkKV]:  # fmt: skip
    """The entries of the chunks `placements` (of `prompt`'s plan, those to capture), cut from a full prefill of it.

    `layers`: per layer, the prefill's rotated keys and values [Hkv, N, D] (N >= the prompt's tokens). The keys
    are turned back to raw (float32 arithmetic); the values are copied as they are. Each is stored under the best
    key of its placement. -> {chunk ids: entry}
    """
    if not placements:
        return {}
    spans = prompt.chunk_spans
    cos, sin = chunks.lm.rope(torch.arange(prompt.num_tokens, device=chunks.lm.device), torch.float32)
    out: dict[tuple[int, ...], ChunkKV] = {}
    for placed in placements:
        s, e = spans[placed.position]
        keys = torch.stack([
            unrotate_keys(k[:, s:e].float(), *chunks.lm.layer_rope(i, cos[s:e], sin[s:e])).to(chunks.dtype)
            for i, (k, _) in enumerate(layers)
        ])  # fmt: skip
        values = torch.stack([v[:, s:e] for _, v in layers])
        base = chunks.base_key(prompt.prefix_ids, placed.ids, placed.keys[0])
        out[placed.ids] = ChunkKV(placed.keys[0], keys, values, base=base)
    return out
