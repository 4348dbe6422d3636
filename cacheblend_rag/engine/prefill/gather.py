"""Reading a prompt's stored KV for the fusor: the prefix's entry, then each chunk's, in prompt order, as the
request's plan places them (`chunks.placement`).

A chunk with no entry is prefilled here and stored (the miss policy `blend`, or a chunk the policy chose to compute
inside the request), and the request's metrics count every chunk as a hit (by tier, with the bytes read) or a miss
(with the time its prefill took).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ...store import ChunkReader
from ..chunks.cache import ChunkCache
from ..chunks.placement import Placement
from .state import PrefillRun


@dataclass
class Gathered:
    parts: list[ChunkReader]  # the prefix's KV (when there is a prefix), then one per chunk
    bytes_by_tier: dict[str, int]  # stored bytes of the chunks found, per tier


def gather(chunks: ChunkCache, run: PrefillRun, plan: Sequence[Placement], *, lazy: bool) -> Gathered:
    """The prefix's KV and that of the chunks `plan` places (the prompt's first ones; `lazy`: entries on disk or in
    Redis come back unread, for pipelined loading). A missing chunk is prefilled with the run's `events` told of its
    layers, and its key added to the run's `fresh` (the entries this request computed: a later retry counts them
    as misses, not hits)."""
    prompt, m, fresh = run.prompt, run.metrics, run.fresh
    prefix = chunks.load_prefix(prompt.prefix_ids)
    prefix_kv = None if prefix is None else prefix.kv
    out = Gathered([prefix_kv] if prefix_kv is not None else [], {})
    seen: set[str] = set()  # a chunk repeated in one prompt is prefilled once: one miss, then hits
    for placed in plan:
        t0 = time.perf_counter()
        kv, tier, stored_bytes, captured = chunks.read(prefix_kv, prompt.prefix_ids, placed, lazy=lazy,
                                                       events=run.events)  # fmt: skip
        if tier is None:
            fresh.add(kv.key)
        repeat = kv.key in seen
        seen.add(kv.key)
        if tier is not None and (repeat or kv.key not in fresh):
            m.chunks_hit += 1
            m.hits_by_tier[tier] = m.hits_by_tier.get(tier, 0) + 1
            m.bytes_loaded += stored_bytes
            m.reused_tokens += len(placed.ids)
            m.chunks_hit_captured += captured
            out.bytes_by_tier[tier] = out.bytes_by_tier.get(tier, 0) + stored_bytes
        else:
            m.chunks_missed += 1
            m.cold_tokens += len(placed.ids)
            m.precompute_s += time.perf_counter() - t0
        out.parts.append(kv)
    if prefix is not None:
        m.bytes_loaded += prefix.stored_bytes
    return out
