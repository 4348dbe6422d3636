"""Decode steps of fixed shapes, replayed as CUDA graphs: one launch per step instead of hundreds.

A decode step is hundreds of small kernels; on a GPU their launches, not the bytes they move, set its time.
`StaticStep` is the slot pool's step (`BatchDecoder.step_slots`) with every shape fixed by a batch-size bucket:
- B requests run as a bucket of `size` rows, the rows past B written to a scratch slot (`SlotPool.reserve`) and
  dropped;
- attention covers every slot and every position of the pool, each slot masked to its length, the mask made on
  the device from a lengths vector;
- its inputs (token ids, positions, rows, lengths) live in tensors it owns, refilled before each run.
So one run has no host work between its kernels, and `GraphedSteps` captures it once per bucket with
`torch.cuda.graphs` and replays it, as gpt-fast and transformers' continuous batching do.

On a CPU the same `StaticStep` runs eagerly (that is how its numbers are tested against `step_slots`); graphs are
for CUDA only. Graphs hold on to the pool's tensors: a pool that grows needs new ones (`GraphedSteps` makes them
when it sees another pool).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...models.adapter import LayerwiseModel, signed_sin
from ...models.cuda_graphs import capture_graph
from .slots import SlotPool, StepPlan

BUCKETS = (1, 2, 4, 8, 16, 32)  # batch sizes a step is padded to


def bucket_for(batch: int, buckets: Sequence[int] = BUCKETS) -> int:
    """The smallest bucket that holds `batch` requests; ValueError past the largest."""
    for size in buckets:
        if batch <= size:
            return size
    raise ValueError(f"a step of {batch} requests is past the largest bucket ({max(buckets)})")


class StaticStep:
    """One decode step over `pool` for up to `size` requests, every shape fixed (see the module docstring)."""

    def __init__(self, lm: LayerwiseModel, pool: SlotPool, size: int) -> None:
        self.lm, self.pool, self.size = lm, pool, size
        self.scratch = pool.reserve()  # where the padding rows write; never given to a request
        device = pool.device
        self.ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.rows = torch.full((size,), self.scratch, dtype=torch.long, device=device)
        self.lengths = torch.ones(pool.slots, dtype=torch.long, device=device)  # after the step's write
        self.span = torch.arange(pool.capacity, device=device)

    def load(self, tokens: Sequence[int], slots: Sequence[int]) -> None:
        """Fill the inputs for the requests at `slots` (one token each): one copy per input."""
        pool, b = self.pool, len(tokens)
        if not 0 < b <= self.size or len(slots) != b:
            raise ValueError(f"{b} tokens for {len(slots)} slots, in a step of {self.size}")
        pool.check(slots)
        pad = self.size - b
        self.ids.copy_(torch.tensor([*tokens, *[0] * pad]), non_blocking=True)
        self.positions.copy_(torch.tensor([pool.lengths[s] for s in slots] + [0] * pad), non_blocking=True)
        self.rows.copy_(torch.tensor([*slots, *[self.scratch] * pad]), non_blocking=True)
        lengths = list(pool.lengths)  # a free slot sees nothing (its row is never read)
        for s in slots:
            lengths[s] += 1
        lengths[self.scratch] = 1
        self.lengths.copy_(torch.tensor(lengths), non_blocking=True)

    @torch.inference_mode()
    def run(self) -> torch.Tensor:
        """The step on the loaded inputs; -> logits [size, vocab] float32 (rows past the batch are padding)."""
        lm, pool, s = self.lm, self.pool, self.lm.shape
        mask = (self.span[None, :] < self.lengths[:, None])[:, None, None, :]  # [S, 1, 1, C]
        hidden = lm.embed(self.ids)
        cos, sin = lm.rope(self.positions)
        cos, sin = cos[:, None], signed_sin(sin)[:, None]  # [size, 1, D]
        plan = StepPlan(self.rows, self.positions, mask, False, pool.keys, pool.values)  # every slot, every position
        for layer_idx in range(s.num_layers):
            q, k, v = lm.rotated_qkv(layer_idx, lm.normed_input(layer_idx, hidden), cos, sin)  # [size, H | Hkv, D]
            attn = lm.layers[layer_idx].self_attn
            out = pool.attend(layer_idx, plan, q, k, v, attn.scaling)  # [size, H * D]
            hidden = lm.finish_layer(layer_idx, hidden, attn.o_proj(out))
        return lm.logits(hidden)


class GraphedSteps:
    """`StaticStep`s captured as CUDA graphs, one per bucket, replayed for each step over one pool."""

    def __init__(self, lm: LayerwiseModel, buckets: Sequence[int] = BUCKETS) -> None:
        self.lm, self.buckets = lm, tuple(buckets)
        self._keys: torch.Tensor | None = None  # the pool tensors the graphs were captured over
        self._graphs: dict[int, tuple[StaticStep, torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def step(self, tokens: Sequence[int], pool: SlotPool, slots: Sequence[int]) -> torch.Tensor:
        """`BatchDecoder.step_slots` by graph replay; -> logits [B, vocab] float32."""
        if pool.device.type != "cuda":
            raise ValueError("CUDA graphs need a pool on a CUDA device")
        if pool.keys is not self._keys:
            self._keys, self._graphs = pool.keys, {}  # another pool, or one that grew: its tensors are new
        size = bucket_for(len(tokens), self.buckets)
        if size not in self._graphs:
            self._graphs[size] = self._capture(StaticStep(self.lm, pool, size))
        static, graph, out = self._graphs[size]
        static.load(tokens, slots)
        graph.replay()
        pool.advance(list(slots))
        return out[: len(tokens)].clone()

    def _capture(self, static: StaticStep) -> tuple[StaticStep, torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm the step up twice, then capture it. The warm-up writes only to the scratch slot (every row is
        padding)."""
        graph, out = capture_graph(static.run, warmups=2)
        return static, graph, out
