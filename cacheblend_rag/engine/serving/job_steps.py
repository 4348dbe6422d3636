"""What a server's turn does to its jobs: start one (its decode slot, its prefill, its first token), run one batched
decode step for the decoding ones and hand each its text, and finish one (its last text, its result, and the chunks
it was answered without queued to be stored). The `Scheduler` decides which jobs and when; this does the work."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from ..request.after_layer import AfterLayer
from .decode_slots import DecodeSlots
from .decoding import RequestCancelled
from .jobs import Job, Served
from .tokens import greedy_tokens

logger = logging.getLogger(__name__)


class JobSteps:
    """Starting, stepping and finishing jobs over the engine (`served`), the decoding jobs' KV (`slots`) and the
    engine's lock, which every prefill and decode step holds."""

    def __init__(self, served: Served, slots: DecodeSlots, lock: threading.RLock) -> None:
        self.served = served
        self.slots = slots
        self._lock = lock
        self.hosted = 0  # decode steps run between the layers of the prefill in progress
        self.largest_batch = 0  # the most jobs one step has decoded together (for tests and benchmarks)
        self.largest_batch_tokens = 0  # the most KV positions (`Job.positions`) of the jobs of one step

    def start(self, job: Job, after_layer: AfterLayer | None) -> bool:
        """Prefill `job` and send its first token; -> True when it goes on decoding (it then holds its slot).
        An error ends the job with that error, never the server; a job cancelled during its prefill stops it at the
        next layer and lets go of its slot."""
        try:
            self.hosted = 0
            if job.cancelled:
                raise RequestCancelled("the request was cancelled before its prefill")
            # its decode slot first: a prefill that reads stored KV lays the prompt's there, and decoding starts
            # from it with no copy
            buffers = self.slots.reserve(job, job.positions)
            pre = self.served.run_prefill(job.prompt, job.request, job.watching(after_layer), buffers)
            pre.metrics.interleaved_steps = self.hosted
            job.deferred = pre.deferred
            job.loop = self.served.token_loop(job.request)
            first = job.loop.first(pre.logits, pre.metrics, job.t0)
            job.last_token_at = time.perf_counter()
            if not self.send(job, first):
                self.slots.free(job)
                return False
            if job.loop.done:
                self.finish(job)
                return False
            self.slots.admit(job, pre)
        except Exception as exc:
            self.slots.free(job)
            if isinstance(exc, RequestCancelled):
                job.cancel()
                logger.debug("%s", exc)
            job.channel.put(exc)  # a reader still waiting wakes up; one that left never reads it
            return False
        return True

    def step(self, batch: Sequence[Job]) -> None:
        """One decode step for every job of `batch`, as one batched forward; each gets its text (and ends when done).
        A failed step fails the jobs in it."""
        self.largest_batch = max(self.largest_batch, len(batch))
        self.largest_batch_tokens = max(self.largest_batch_tokens, sum(j.positions for j in batch))
        try:
            with self._lock:
                logits = self.slots.step([j.loop.token for j in batch], batch)  # type: ignore[union-attr]
        except Exception as exc:
            logger.exception("a decode step failed for %d requests", len(batch))
            for job in batch:
                job.cancel()
                job.channel.put(exc)
            return
        now = time.perf_counter()
        picked = greedy_tokens(logits, [job.loop is not None and job.loop.picker.greedy for job in batch])
        for row, job in enumerate(batch):
            try:
                assert job.loop is not None
                job.last_token_at = now
                token = picked.get(row)
                delta = job.loop.take(token) if token is not None else job.loop.next(logits[row])
                if self.send(job, delta) and job.loop.done:
                    self.finish(job)
            except Exception as exc:
                job.cancel()
                job.channel.put(exc)

    def send(self, job: Job, delta: str) -> bool:
        """Hand a job its text; -> False when the job has no reader left."""
        if delta and not job.channel.put(delta):
            job.cancel()
        return not job.cancelled

    def finish(self, job: Job) -> None:
        """Send the job's last text and its result; queue the chunks a cold request was answered without."""
        assert job.loop is not None
        job.finished = True  # leaves the batch
        self.slots.free(job)
        rest, result = job.loop.result()
        if rest:
            job.channel.put(rest)
        try:  # stored off its path
            self.served.fills.submit(job.prompt.prefix_ids, job.deferred)
        finally:
            job.channel.put(result)
