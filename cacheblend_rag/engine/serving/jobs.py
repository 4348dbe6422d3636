"""What the scheduler queues and what a turn does to it: a `Job` (one request, its decoding state, what watches its
prefill's layers), the `Channel` that carries its events, in order, from whoever serves it to whoever reads it, and
`JobSteps`: start a job (its decode slot, its prefill, its first token), run one batched decode step for the decoding
ones and hand each its text, and finish one (its last text, its result, and the chunks it was answered without
queued to be stored). The `Scheduler` decides which jobs and when; `JobSteps` does the work."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from ...fusion import LayerEvents
from ..prefill.prefiller import Prefiller
from ..request.prompt import TokenizedPrompt
from ..request.request import Request, SamplingParams
from .decode_slots import DecodeSlots
from .decoding import Event, GenerationResult, RequestCancelled, TokenLoop
from .deferred_fills import DeferredFills
from .tokens import greedy_tokens

logger = logging.getLogger(__name__)


class Channel:
    """The events of one job, in order, from the worker to its reader: a thread (`loop` None) or an event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop
        self._sync: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._async: asyncio.Queue[Event] | None = asyncio.Queue() if loop is not None else None

    def take(self) -> Event | None:
        """The next event of a thread's channel if one is there, else None (never waits)."""
        try:
            return self._sync.get_nowait()
        except queue.Empty:
            return None

    def put(self, event: Event) -> bool:
        """-> False when the reader's event loop is gone (the job has no one left to answer)."""
        if self._async is None:
            self._sync.put(event)
            return True
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._async.put_nowait, event)
        except RuntimeError:  # the loop was closed
            return False
        return True

    def get(self) -> Event:
        """The next event of a thread's channel, waiting for it."""
        return self._sync.get()

    async def async_events(self) -> AsyncIterator[Event]:
        assert self._async is not None
        while True:
            event = await self._async.get()
            yield event
            if isinstance(event, (GenerationResult, BaseException)):
                return


@dataclass(eq=False)
class Job:
    prompt: TokenizedPrompt
    request: Request
    channel: Channel
    t0: float = field(default_factory=time.perf_counter)  # arrival: the time to first token counts from here
    cancelled: bool = False  # its reader left
    finished: bool = False  # its last event is sent
    loop: TokenLoop | None = None
    slot: int | None = None  # its place in the scheduler's `SlotPool` while it decodes
    deferred: tuple[tuple[int, ...], ...] = ()
    last_token_at: float = 0.0  # perf_counter when its last token (the first one, then each step's) was picked
    # what watches its prefill's layers, registered once: its cancellation (here), the scheduler's decode steps for
    # the others (`Scheduler.submit`, with `max_token_gap_s`)
    events: LayerEvents = field(default_factory=LayerEvents)

    def __post_init__(self) -> None:
        self.events.watch(self.stop_if_cancelled)

    @property
    def positions(self) -> int:
        """The KV positions it holds while decoding: its prompt and room for its whole answer."""
        return self.prompt.num_tokens + self.request.sampling.max_new_tokens

    def cancel(self) -> None:
        self.cancelled = True

    def stop_if_cancelled(self, layer_idx: int) -> None:
        """Watches the job's prefill (`events`): RequestCancelled once the job is cancelled, and the prefill stops."""
        if self.cancelled:
            raise RequestCancelled(f"the request was cancelled after layer {layer_idx} of its prefill")


class JobSteps:
    """Starting, stepping and finishing jobs: their prefills (`prefiller`), the decoding jobs' KV (`slots`), their
    token loops (`loops`, one per request), under the engine's lock, which every prefill and decode step holds, and
    the chunks a cold request was answered without (`fills`), queued when it ends."""

    def __init__(
        self,
        prefiller: Prefiller,
        fills: DeferredFills,
        slots: DecodeSlots,
        lock: threading.RLock,
        loops: Callable[[SamplingParams], TokenLoop],
    ) -> None:
        self.prefiller = prefiller
        self.fills = fills
        self.slots = slots
        self._lock = lock
        self._loops = loops
        self.hosted = 0  # decode steps run between the layers of the prefill in progress
        self.largest_batch = 0  # the most jobs one step has decoded together (for tests and benchmarks)
        self.largest_batch_tokens = 0  # the most KV positions (`Job.positions`) of the jobs of one step

    def start(self, job: Job) -> bool:
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
            pre = self.prefiller.run(job.prompt, job.request, job.events, buffers)
            pre.metrics.interleaved_steps = self.hosted
            job.deferred = pre.deferred
            job.loop = self._loops(job.request.sampling)
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
            self.fills.submit(job.prompt.prefix_ids, job.deferred)
        finally:
            job.channel.put(result)
