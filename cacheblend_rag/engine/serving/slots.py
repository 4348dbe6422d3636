"""The decode KV of every answering request in one preallocated tensor per layer, attended in one call per layer.

`SlotPool` holds keys and values [S, Hkv, C, D] per layer: S slots of C positions. A request is given a slot before
its prefill, which lays the prompt's KV there itself when it reads stored KV (`take`, `buffers`, `fill`: nothing is
copied), or when it starts decoding (`admit`: its prefill's KV copied in once, every layer in one copy where the
prefill left one buffer), and gives it back when it ends; the pool keeps its requests in the lowest slots, so a
step's requests span slots 0..hi-1 with few gaps. `attend` runs one layer's attention for the whole batch as one call
over [hi, Hkv, n, D], n the longest length in the batch, each request masked to its own length: a step's attention
is then a handful of operations whatever the batch size, where one call per request was a handful each. The pool
grows when a request does not fit (twice the slots, or its positions rounded up to 256 per slot), copying what it
holds; its owner lets it go when no request holds a slot.

Each row is what the request's own attention computes: masked positions get exactly zero weight, so a request's
logits agree with it served alone to float rounding (`tests/test_slot_decode.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...models.adapter import ModelShape
from ...models.attention import attention_kernels, fused_attention, written_out_attention

Layers = torch.Tensor | Sequence[torch.Tensor]  # a request's keys or values: [L, Hkv, N, D], or L of [Hkv, N, D]


class SlotPool:
    """Decode KV for up to `slots` requests of up to `capacity` positions each, on one device in one dtype."""

    def __init__(self, shape: ModelShape, dtype: torch.dtype, device: torch.device | str, slots: int = 4,
                 capacity: int = 1024) -> None:  # fmt: skip
        self.shape, self.dtype, self.device = shape, dtype, torch.device(device)
        self.keys = self._empty(slots, capacity)  # [L, S, Hkv, C, D]
        self.values = self._empty(slots, capacity)
        self.lengths = [0] * slots  # filled positions per slot
        self.free = list(range(slots))  # kept sorted: the lowest free slot is taken first
        self.scratch: int | None = None  # a slot no request gets, that fixed-shape steps pad into (`reserve`)

    @property
    def slots(self) -> int:
        return self.keys.shape[1]

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def _empty(self, slots: int, capacity: int) -> torch.Tensor:
        """Uninitialised: nothing is written (or, on a CPU, even mapped) until a slot is given to a request, which
        then zeroes what it does not fill (`_clear_tail`). Zeroing the whole pool here would touch every page of
        every slot, about 0.3 s for a lone request of the default model at 3k positions."""
        s = self.shape
        return torch.empty(s.num_layers, slots, s.num_kv_heads, capacity, s.head_dim, dtype=self.dtype,
                           device=self.device)  # fmt: skip

    def _clear_tail(self, slots: slice | int, start: int) -> None:
        """Zero positions `start`.. of `slots`: a masked position has weight 0 in the attention, but 0 * NaN (or
        NaN plus the mask's -inf) from memory never written would still be NaN."""
        self.keys[:, slots, :, start:] = 0
        self.values[:, slots, :, start:] = 0

    def admit(self, keys: Layers, values: Layers, length: int, room: int) -> int:
        """A slot holding `length` positions of rotated KV ([L, Hkv, >= length, D] each, one tensor or one per
        layer), with `room` more to decode into; -> the slot."""
        slot = self.take(length + room)
        self.fill(slot, keys, values, length)
        return slot

    def take(self, positions: int) -> int:
        """A free slot of at least `positions` positions, holding nothing yet (`fill` it); -> the slot. The pool
        grows when needed."""
        if self.capacity < positions:
            self._grow(self.slots, rounded(positions))
        if not self.free:
            self._grow(2 * self.slots, self.capacity)
        slot = self.free.pop(0)
        self.lengths[slot] = 0
        return slot

    def buffers(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of a slot, [L, Hkv, C, D] views: a prefill can lay a request's KV there itself."""
        return self.keys[:, slot], self.values[:, slot]

    def fill(self, slot: int, keys: Layers, values: Layers, length: int) -> None:
        """The slot holds `length` positions of `keys` and `values` (as for `admit`): copied in, unless they are
        the slot's own memory already (`buffers`, written by the prefill)."""
        if slot in self.free or slot == self.scratch:
            raise ValueError(f"slot {slot} was not taken")
        if length > self.capacity:
            raise ValueError(f"{length} positions do not fit a slot of {self.capacity}")
        mine = self.keys[:, slot]
        if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor):
            if not (_same_view(keys, mine) and _same_view(values, self.values[:, slot])):  # one copy, every layer
                self.keys[:, slot, :, :length] = keys[:, :, :length]
                self.values[:, slot, :, :length] = values[:, :, :length]
        else:
            for i, (k, v) in enumerate(zip(keys, values, strict=True)):
                self.keys[i, slot, :, :length] = k[:, :length]
                self.values[i, slot, :, :length] = v[:, :length]
        self._clear_tail(slot, length)
        self.lengths[slot] = length

    @property
    def empty(self) -> bool:
        """No slot holds a request."""
        return len(self.free) + (self.scratch is not None) == self.slots

    def reserve(self) -> int:
        """The pool's scratch slot, taken out of use the first time it is asked for (the highest free one)."""
        if self.scratch is None:
            if not self.free:
                self._grow(2 * self.slots, self.capacity)
            self.scratch = self.free.pop()
            self._clear_tail(self.scratch, 0)
        return self.scratch

    def check(self, slots: Sequence[int]) -> None:
        """ValueError for a slot that holds no request, RuntimeError for one with no room left to write."""
        for slot in slots:
            if slot in self.free or slot == self.scratch or not 0 <= slot < self.slots:
                raise ValueError(f"slot {slot} holds no request")
            if self.lengths[slot] >= self.capacity:
                raise RuntimeError(f"decode slot {slot} is full ({self.capacity} positions)")

    def release(self, slot: int) -> None:
        """The slot's request has ended: its slot is free for the next."""
        if slot in self.free:
            raise ValueError(f"slot {slot} is free already")
        self.lengths[slot] = 0
        self.free.append(slot)
        self.free.sort()

    def _grow(self, slots: int, capacity: int) -> None:
        keys, values = self._empty(slots, capacity), self._empty(slots, capacity)
        keys[:, : self.slots, :, : self.capacity] = self.keys
        values[:, : self.slots, :, : self.capacity] = self.values
        old_slots, old_capacity = self.slots, self.capacity
        self.free += list(range(self.slots, slots))
        self.lengths += [0] * (slots - self.slots)
        self.keys, self.values = keys, values
        self._clear_tail(slice(0, old_slots), old_capacity)  # the slots held now, at their new positions

    def step_plan(self, slots: list[int]) -> StepPlan:
        """The index tensors and the mask of one decode step of the requests in `slots` (one token each).

        The mask is additive (0 / -inf in the pool's dtype), made once for every layer: given a boolean one, the
        fused kernels turn it into this form again in every layer's call. When the requests fill slots 0..hi-1
        and all see every position (one request, or several of one length), there is no mask at all."""
        self.check(slots)
        positions = [self.lengths[s] for s in slots]
        hi, n = max(slots) + 1, max(positions) + 1
        device = self.device
        rows = torch.tensor(slots, dtype=torch.long, device=device)
        dense = slots == list(range(hi))  # the requests fill slots 0..hi-1 in order: no gathering around attention
        mask = None
        if not (dense and all(p == n - 1 for p in positions)):
            lengths = torch.zeros(hi, dtype=torch.long)
            lengths[slots] = torch.tensor(positions) + 1
            seen = torch.arange(n)[None, :] < lengths[:, None]  # [hi, n]: each slot's keys, its new one included
            mask = torch.zeros(hi, 1, 1, n, dtype=self.dtype).masked_fill_(~seen[:, None, None, :], float("-inf"))
            mask = mask.to(device)
        at = torch.tensor(positions, dtype=torch.long, device=device)
        return StepPlan(rows, at, mask, dense, self.keys[:, :hi, :, :n], self.values[:, :hi, :, :n])

    def attend(self, layer_idx: int, plan: StepPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float, *, window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Write the step's keys and values ([B, Hkv, D], request b at slot plan.rows[b]) in place, then attend each
        request's query ([B, H, D]) over its slot (within the layer's sliding `window`, if it has one); -> [B, H * D]
        in the order of the requests. A layer with soft-capped scores or attention sinks (`softcap`, `sinks` [H]:
        see `models.attention.attention_probs`) attends through the written-out softmax."""
        keys, values = plan.keys[layer_idx], plan.values[layer_idx]  # [hi, Hkv, n, D]
        keys[plan.rows, :, plan.positions] = key  # one write per request and head
        values[plan.rows, :, plan.positions] = value
        if plan.dense:
            q = query
        else:
            q = query.new_zeros(keys.shape[0], *query.shape[1:])
            q[plan.rows] = query  # into the batch's slots
        mask = plan.mask if window is None else plan.window_mask(window)
        if softcap is None and sinks is None:
            out = self.attention(q, keys, values, mask, scale)
        else:  # one query row per slot: [hi, H, 1, D] -> [hi, H, 1, D]
            out = written_out_attention(q[:, :, None], keys, values, mask, scale, softcap=softcap, sinks=sinks)
        return (out if plan.dense else out[plan.rows]).reshape(len(plan.positions), -1)

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                  scale: float) -> torch.Tensor:  # fmt: skip
        """One query per slot ([hi, H, D]) over its slot's keys and values in one layer ([hi, Hkv, n, D], views of
        the pool), `mask` ([hi, 1, 1, n], bool or additive; None: every position) saying which positions it sees;
        -> [hi, Hkv, H / Hkv, D] (the query heads of each KV head).

        torch's fused kernel on every device: on a CPU too it beats the same attention written as two products,
        a scale, a mask and a softmax (by 10-25% in bf16, where a product over transposed keys copies them, and
        level in fp32; the default model's step at 300-3,100 positions, 1 and 8 requests)."""
        s = self.shape
        # the query heads of one KV head as that head's queries ([hi, Hkv, groups, D]): no GQA support needed of the
        # kernel, and a mask over keys is all a backend must take
        grouped = q.view(q.shape[0], s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim)
        with attention_kernels(q.device):
            return fused_attention(grouped, keys, values, mask, scale)

    def advance(self, slots: list[int]) -> None:
        """The step is written in every layer: each slot's next token goes one position further."""
        for slot in slots:
            self.lengths[slot] += 1


class StepPlan:
    """What every layer of one batched step reuses: the requests' slots and write positions, the mask over the keys
    attended ([hi, 1, 1, n] bool or additive, hi the slots spanned and n the keys; None when every slot sees them
    all), whether the requests are slots 0..hi-1 in order, and the pool's keys and values the step reads and writes
    ([L, hi, Hkv, n, D] views)."""

    __slots__ = ("rows", "positions", "mask", "dense", "keys", "values", "windows")

    def __init__(self, rows: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, dense: bool,
                 keys: torch.Tensor, values: torch.Tensor) -> None:  # fmt: skip
        self.rows, self.positions, self.mask, self.dense = rows, positions, mask, dense
        self.keys, self.values = keys, values
        self.windows: dict[int, torch.Tensor] = {}  # the masks of windowed layers, by window, made at first use

    def window_mask(self, window: int) -> torch.Tensor:
        """The mask of a layer with a sliding window ([hi, 1, 1, n], additive): each request sees its keys at
        positions p - window < j <= p, p its step's position. Slots outside the step see the last positions."""
        if window not in self.windows:
            hi, n = self.keys.shape[1], self.keys.shape[3]
            at = torch.full((hi,), n - 1, dtype=torch.long, device=self.rows.device)
            at[self.rows] = self.positions
            k = torch.arange(n, device=at.device)[None, :]
            seen = (k <= at[:, None]) & (k > at[:, None] - window)  # [hi, n]
            mask = torch.zeros(hi, 1, 1, n, dtype=self.keys.dtype, device=at.device)
            self.windows[window] = mask.masked_fill_(~seen[:, None, None, :], float("-inf"))
        return self.windows[window]


def _same_view(t: torch.Tensor, slot: torch.Tensor) -> bool:
    """Whether `t` starts where the slot's view does, with its strides: the slot's own memory."""
    return t.data_ptr() == slot.data_ptr() and t.stride() == slot.stride() and t.device == slot.device


def rounded(positions: int, step: int = 256) -> int:
    """Positions per slot for a request of `positions`: rounded up to a multiple of `step`."""
    return -(-positions // step) * step
