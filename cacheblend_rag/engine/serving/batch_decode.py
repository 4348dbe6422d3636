"""One decoding step for several requests at once: the weights are read once for all of them.

A decode step is bound by reading the weights (every matrix, for one token). `BatchDecoder.step` runs the step of
B requests as one forward: embeddings, projections, MLPs and the LM head see B rows, so each weight is read once
per step, not once per request. Attention is the only part that differs per request (its own cache, its own
length): it runs per request, over that request's `DecodeCache`. Each row is computed exactly as the model's own
forward computes that request alone (same modules, same RoPE from true positions, causal over its own keys).

`DecodeCache` holds one request's KV in buffers sized for its whole answer, so a step writes one position in
place instead of copying the whole cache to grow it (what a `DynamicCache` does per token and layer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from ...models.adapter import LayerwiseModel, rope_rotate, signed_sin
from .slots import SlotPool


class DecodeCache:
    """One request's rotated keys and values per layer, [Hkv, capacity, D], of which the first `length` are filled."""

    def __init__(self, cache: DynamicCache, length: int, capacity: int) -> None:
        if capacity < length:
            raise ValueError(f"capacity {capacity} is below the cached length {length}")
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for layer in cache.layers:
            k, v = layer.keys[0], layer.values[0]  # [Hkv, N, D]
            if k.shape[1] != length:
                raise ValueError(f"the cache holds {k.shape[1]} positions, expected {length}")
            kb = k.new_empty(k.shape[0], capacity, k.shape[2])
            vb = v.new_empty(v.shape[0], capacity, v.shape[2])
            kb[:, :length] = k
            vb[:, :length] = v
            self.keys.append(kb)
            self.values.append(vb)
        self.length = length
        self.capacity = capacity

    def put(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the next position's key and value ([Hkv, D]) in a layer; -> that layer's keys and values so far."""
        n = self.length
        if n >= self.capacity:
            raise RuntimeError(f"decode cache full ({self.capacity} positions)")
        self.keys[layer_idx][:, n] = key
        self.values[layer_idx][:, n] = value
        return self.keys[layer_idx][:, : n + 1], self.values[layer_idx][:, : n + 1]

    def advance(self) -> None:
        """The step is written in every layer: the next one goes one position further."""
        self.length += 1


class BatchDecoder:
    """Batched decode steps over a `LayerwiseModel` (the model's own modules and weights)."""

    def __init__(self, lm: LayerwiseModel) -> None:
        self.lm = lm

    @torch.inference_mode()
    def step(self, tokens: Sequence[int], caches: Sequence[DecodeCache]) -> torch.Tensor:
        """Feed one token per request at its cache's next position; -> next-token logits [B, vocab] float32.

        Every cache grows by one position.
        """
        if len(tokens) != len(caches) or not tokens:
            raise ValueError(f"one token per cache, got {len(tokens)} tokens for {len(caches)} caches")
        lm = self.lm
        device = lm.device
        ids = torch.tensor(list(tokens), dtype=torch.long, device=device)
        positions = torch.tensor([c.length for c in caches], dtype=torch.long, device=device)
        hidden = lm.embed(ids)  # [B, hidden]
        cos, sin = lm.rope(positions)  # [B, K * D]
        sin = signed_sin(sin, lm.shape.head_dim)  # made once per step, for every layer's `rope_rotate`
        for layer_idx in range(lm.shape.num_layers):
            x = lm.normed_input(layer_idx, hidden)
            q, raw_k, v = lm.project_raw_qkv(layer_idx, x)  # [H, B, D], [Hkv, B, D] x 2
            cos_l, sin_l = lm.layer_rope(layer_idx, cos, sin)
            q, k = rope_rotate(q, cos_l, sin_l), rope_rotate(raw_k, cos_l, sin_l)
            per_request = [c.put(layer_idx, k[:, b], v[:, b]) for b, c in enumerate(caches)]
            hidden = lm.finish_layer(layer_idx, hidden, lm.attend_each(layer_idx, q, per_request))
        for c in caches:
            c.advance()
        return lm.logits(hidden)

    @torch.inference_mode()
    def step_slots(self, tokens: Sequence[int], pool: SlotPool, slots: Sequence[int]) -> torch.Tensor:
        """`step` for requests whose KV is in `pool` (request b at slot `slots[b]`): each layer's attention is one
        call for the whole batch (`SlotPool.attend`). -> next-token logits [B, vocab] float32."""
        if len(tokens) != len(slots) or not tokens:
            raise ValueError(f"one token per slot, got {len(tokens)} tokens for {len(slots)} slots")
        lm = self.lm
        plan = pool.step_plan(list(slots))
        hidden = lm.embed(torch.tensor(list(tokens), dtype=torch.long, device=lm.device))  # [B, hidden]
        cos, sin = lm.rope(plan.positions)  # [B, K * D]
        cos, sin = cos[:, None], signed_sin(sin, lm.shape.head_dim)[:, None]  # [B, 1, K * D]: for every head
        for layer_idx in range(lm.shape.num_layers):
            q, k, v = lm.rotated_qkv(layer_idx, lm.normed_input(layer_idx, hidden), cos, sin)  # [B, H | Hkv, D]
            attn, spec = lm.layers[layer_idx].self_attn, lm.spec.layers[layer_idx]
            out = pool.attend(layer_idx, plan, q, k, v, attn.scaling, window=spec.window, softcap=spec.softcap,
                              sinks=spec.sinks)  # fmt: skip
            hidden = lm.finish_layer(layer_idx, hidden, attn.o_proj(out))
        pool.advance(list(slots))
        return lm.logits(hidden)
