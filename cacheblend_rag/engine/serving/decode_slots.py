"""The scheduler's decode slots: which slot of one `SlotPool` each decoding job holds, and the steps over them.

The pool is made when the first job is given a slot (before its prefill), sized for it, and grows as later ones
need; it is let go once no job holds a slot (kept while CUDA graphs are captured over it, so that they are not
captured again). Slots are taken and given back only inside a scheduler turn, when no step is using them: a job that
leaves from another thread (its reader went away) is recorded with `leave` and its slot freed at the next turn
(`free`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..prefill.prefiller import Prefill
from .batch_decode import BatchDecoder
from .graphs import GraphedSteps
from .slots import SlotPool, rounded

if TYPE_CHECKING:  # a job holds its slot; the steps over jobs (`jobs.JobSteps`) hold these slots
    from .jobs import Job


class DecodeSlots:
    """The decoding jobs' KV, and their batched steps (eager, or replayed as CUDA graphs with `graphs`)."""

    def __init__(self, decoder: BatchDecoder, graphs: GraphedSteps | None, max_batch: int) -> None:
        self.decoder, self.graphs, self.max_batch = decoder, graphs, max_batch
        self.pool: SlotPool | None = None
        self._left: list[Job] = []  # jobs that left from another thread, holding a slot until the next turn
        self._lock = threading.Lock()

    def reserve(self, job: Job, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Give `job` a slot of `positions` positions before its prefill (in a turn); -> the slot's keys and values
        ([L, Hkv, C, D] views), where a prefill that reads stored KV lays the prompt's, so that `admit` copies
        nothing. Give it back with `free(job)` if the job never decodes."""
        self.free()  # those of jobs that left since, for this one to take
        if self.pool is None:
            lm = self.decoder.lm
            self.pool = SlotPool(lm.shape, lm.dtype, lm.device, min(4, self.max_batch), rounded(positions))
        job.slot = self.pool.take(positions)
        return self.pool.buffers(job.slot)

    def admit(self, job: Job, pre: Prefill) -> None:
        """`job`'s slot (given before its prefill by `reserve`) holds its prefill's KV: nothing to copy when the
        prefill laid it there, else copied in once (a full prefill's cache, a guard's escalated copy). In a turn."""
        self.free()  # those of jobs that left since
        if job.slot is None or self.pool is None:
            raise RuntimeError("a job is admitted to decoding in the slot reserve() gave it before its prefill")
        if pre.kv is not None:  # the cached modes' buffers: every layer in one tensor
            keys, values = pre.kv.key_buffer, pre.kv.value_buffer
        else:
            keys = [layer.keys[0] for layer in pre.cache.layers]
            values = [layer.values[0] for layer in pre.cache.layers]
        self.pool.fill(job.slot, keys, values, pre.num_tokens)

    def leave(self, jobs: Sequence[Job]) -> None:
        """Jobs dropped outside a turn: their slots are freed at the next one (any thread)."""
        with self._lock:
            self._left += [j for j in jobs if j.slot is not None]

    def free(self, *jobs: Job) -> None:
        """Give back the slots of `jobs` and of those that left (in a turn); the pool goes once it is empty."""
        with self._lock:
            jobs, self._left = (*jobs, *self._left), []
        for job in jobs:
            if job.slot is not None and self.pool is not None:
                self.pool.release(job.slot)
            job.slot = None
        if self.pool is not None and self.pool.empty and self.graphs is None:
            self.pool = None

    def step(self, tokens: Sequence[int], jobs: Sequence[Job]) -> torch.Tensor:
        """One decode step of `jobs` (in a turn); -> next-token logits [B, vocab] float32."""
        self.free()
        slots = [j.slot for j in jobs]
        if self.pool is None or None in slots:
            raise RuntimeError("a decode step for jobs that hold no slot")
        if self.graphs is not None and len(jobs) <= max(self.graphs.buckets):
            return self.graphs.step(tokens, self.pool, slots)  # type: ignore[arg-type]
        return self.decoder.step_slots(tokens, self.pool, slots)  # type: ignore[arg-type]

    def reset(self) -> None:
        """Forget every slot (the scheduler ended its jobs, or this is a forked child)."""
        with self._lock:
            self._left = []
        self.pool = None

    @property
    def shape(self) -> tuple[int, int]:
        """(slots, positions per slot) of the pool now; (0, 0) when none is held."""
        pool = self.pool
        return (0, 0) if pool is None else (pool.slots, pool.capacity)
