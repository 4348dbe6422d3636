"""A reference forward over stored chunk KV, independent of the fusor: the model's own forward over a prompt's
tail after a DynamicCache filled with the stored KV of its prefix and first chunks."""

from __future__ import annotations

import torch

from cacheblend_rag import CacheBlendEngine


def reference_logits_with_cache(engine: CacheBlendEngine, prompt, num_chunks: int) -> torch.Tensor:
    """Last-token logits from the model's own forward over the prompt's tail, after a DynamicCache filled with
    the stored KV of the prefix and the first `num_chunks` chunks, each rotated to its real offset.

    An implementation independent of the fusor: prefix caching is num_chunks=1, full KV reuse all chunks.
    """
    from transformers import DynamicCache

    from cacheblend_rag.models import rotate_keys

    keys = engine.prompt_keys(prompt)[: num_chunks + (1 if prompt.prefix_ids else 0)]
    parts = [engine.store.get(k) for k in keys]
    assert all(p is not None for p in parts), "run a cached mode first so the store holds the chunks"
    cached = sum(p.num_tokens for p in parts)
    cos, sin = engine.lm.rope(torch.arange(cached))
    cache = DynamicCache(config=engine.model.config)
    for layer_idx in range(engine.lm.shape.num_layers):
        k = torch.cat([p.keys[layer_idx] for p in parts], dim=1)
        v = torch.cat([p.values[layer_idx] for p in parts], dim=1)
        cache.update(rotate_keys(k, cos, sin)[None], v[None], layer_idx)
    tail = prompt.input_ids()[cached:]
    with torch.no_grad():
        out = engine.model(
            input_ids=tail[None],
            position_ids=torch.arange(cached, cached + tail.numel())[None],
            cache=cache,
            use_cache=True,
        )
    return out.logits[0, -1].float()
