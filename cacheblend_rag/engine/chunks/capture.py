"""KV captured from a full prefill: a prompt's full prefill computes some chunks' entries exactly, and storing them
costs nothing but the write (no chunk is prefilled a second time).

`capturable` says which positions of a prompt those are under the engine's capture policy ("exact": the first
chunk's isolated entry, and a later chunk whose recorded context is exactly the chunks before it here; "all":
every chunk, into its captured entry); `capture` cuts them out of the prefill's KV, keys turned back to raw.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...models.adapter import unrotate_keys
from ...store import ChunkKV
from ..request.prompt import TokenizedPrompt
from .cache import ChunkCache

__all__ = ["capturable", "capture"]


def capturable(chunks: ChunkCache, prompt: TokenizedPrompt, policy: str | None = None) -> list[int]:
    """The positions of `prompt` whose best entry (`read_keys`) is not stored and a full prefill of the prompt
    computes exactly: the first chunk's isolated entry; under capture="all", every later chunk's captured
    entry; under "exact", a later chunk whose own entry is prefilled after just the chunks before it here.
    Each chunk once, at its first place. Reads no KV. `policy` replaces the engine's."""
    policy = policy or chunks.capture_policy
    out: list[int] = []
    seen: set[tuple[int, ...]] = set()
    before: list[int] = []
    reading = chunks.reading(prompt.chunk_ids, policy)
    for j, (ids, (isolated, copies)) in enumerate(zip(prompt.chunk_ids, reading, strict=True)):
        # whether this prompt computes the entry exactly (in memory) before asking the store whether it has it;
        # a later chunk read from its isolated entry is not computed by this prompt (it follows other chunks)
        exact = j == 0 or (
            not isolated and (policy == "all" or chunks.context_of(prompt.prefix_ids, ids) == tuple(before))
        )
        key = chunks.read_keys(prompt.prefix_ids, ids, j, policy, isolated=isolated, copies=copies)[0]
        if ids not in seen and exact and key not in chunks.store:
            out.append(j)
        seen.add(ids)
        before.extend(ids)
    return out


def capture(chunks: ChunkCache, prompt: TokenizedPrompt, layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
            positions: Sequence[int], policy: str | None = None) -> dict[tuple[int, ...], ChunkKV]:  # fmt: skip
    """The entries of the chunks at `positions` of `prompt` (`capturable` under `policy`), cut from a full
    prefill of it.

    `layers`: per layer, the prefill's rotated keys and values [Hkv, N, D] (N >= the prompt's tokens). The keys
    are turned back to raw (float32 arithmetic); the values are copied as they are. -> {chunk ids: entry}
    """
    if not positions:
        return {}
    spans = prompt.chunk_spans
    cos, sin = chunks.lm.rope(torch.arange(prompt.num_tokens, device=chunks.lm.device), torch.float32)
    out: dict[tuple[int, ...], ChunkKV] = {}
    reading = chunks.reading(prompt.chunk_ids, policy)
    for j in positions:
        s, e = spans[j]
        ids = prompt.chunk_ids[j]
        keys = torch.stack([unrotate_keys(k[:, s:e].float(), cos[s:e], sin[s:e]).to(chunks.dtype) for k, _ in layers])
        values = torch.stack([v[:, s:e] for _, v in layers])
        isolated, copies = reading[j]
        out[ids] = ChunkKV(chunks.read_keys(prompt.prefix_ids, ids, j, policy, isolated=isolated, copies=copies)[0],
                           keys, values)  # fmt: skip
    return out
