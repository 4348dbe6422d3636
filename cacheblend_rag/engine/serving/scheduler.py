"""Serving many requests at once: one queue, one server at a time, decode steps batched across requests.

Every `generate` / `stream` / `agenerate` / `astream` call becomes a `Job` in one queue, from any thread or event
loop. One server serves them all, in turns (the worker thread, or, for a request alone, its reader's thread):
1. start the oldest waiting job if fewer than `max_batch` decode and its KV fits beside theirs (`max_tokens`): its
   prefill (one at a time, under the engine's lock), then its first token;
2. store one chunk a cold request was answered without, if one is queued (`DeferredFills`);
3. run one decode step for every decoding job as one batched forward (`BatchDecoder`), and hand each its text.
A new request waits at most one decode step for its prefill, and each step reads the weights once for the batch.
What a turn does to its jobs (start, step, finish) is `JobSteps` (`jobs`); this module decides which jobs, and when.
With `max_token_gap_s`, decoding requests also get a step between two layers of a prefill (or of a chunk being
stored) once their last token is that old, so a long prefill does not stop their answers: the scheduler registers
that step with each job's `LayerEvents` when it is queued. Events reach each
job's reader through a `Channel` (a queue for a thread, the event loop for a task): a slow reader only lets its
own events pile up, and a reader that leaves cancels its job, whose prefill then stops at its next layer. The
worker exits when nothing is left and starts again with the next job; at interpreter exit `stop` (called by
`shutdown`) fails the jobs still in it.

A request alone is served by the thread that reads it: PyTorch keeps an OpenMP pool per thread, and a worker's
pool beside the caller's own oversubscribes a CPU's cores (each decode step 1.3-1.4x slower on 2 cores). When a
second request arrives the worker thread takes over between two turns, so a slow or gone reader holds no one up.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ...config import ServingConfig
from ...errors import EngineClosedError, PromptError
from ...fusion import LayerEvents
from ..prefill.prefiller import Prefiller
from ..request.prompt import TokenizedPrompt
from ..request.request import Request, SamplingParams
from .batch_decode import BatchDecoder
from .decode_slots import DecodeSlots
from .decoding import AsyncTextStream, Event, GenerationResult, RequestCancelled, TextStream, TokenLoop
from .deferred_fills import DeferredFills
from .graphs import GraphedSteps
from .jobs import Channel, Job, JobSteps
from .shutdown import joined, stop_at_exit
from .thread_pools import release_thread_pool


class Scheduler:
    """The queue and the worker, over the parts it drives: the prefiller (a job's prefill), the batched decoder, the
    token loops (`loops`: one per request's sampling settings) and the fills (the chunks stored in its turns).

    A job waits in the queue while one of its chunks is still being stored by a fill (later jobs may start first);
    after a job's last token, the chunks a cold request was answered without are queued to be stored.
    """

    def __init__(
        self,
        prefiller: Prefiller,
        fills: DeferredFills,
        decoder: BatchDecoder,
        loops: Callable[[SamplingParams], TokenLoop],
        lock: threading.RLock,
        serving: ServingConfig,
        graphs: GraphedSteps | None = None,
    ) -> None:
        self.decoder = decoder  # each step's forward (int8 weights or the model's: `serving.decode_weights`)
        self.max_batch = max_batch = serving.max_batch_size
        self.max_tokens = serving.max_batch_tokens
        self.max_token_gap_s = max_token_gap_s = serving.max_token_gap_s
        self.slots = DecodeSlots(decoder, graphs, max_batch)  # the decoding jobs' KV, and their steps (`graphs`)
        self.fills = fills
        # what a chunk being stored in a turn tells of its layers: the decoding jobs' steps (`max_token_gap_s`)
        self._fill_events = None if max_token_gap_s is None else LayerEvents(self._between_layers)
        self._cond = threading.Condition()
        self._waiting: list[Job] = []
        self._active: list[Job] = []
        self._thread: threading.Thread | None = None  # the worker, while it serves
        self._lone: Job | None = None  # the job alone in the queue whose reader serves it, while nothing else is
        self._turn = threading.Lock()  # held by whoever runs a turn: the worker or the lone job's reader
        self._stopped = False
        self.steps = JobSteps(prefiller, fills, self.slots, lock, loops)  # what a turn does to its jobs
        stop_at_exit(self)

    def submit(
        self,
        prompt: TokenizedPrompt,
        request: Request,
        loop: asyncio.AbstractEventLoop | None = None,
        serve_here: bool = False,
    ) -> Job:
        """Queue a request; PromptError, before anything runs, for one whose KV could never fit `max_tokens`.
        With `serve_here` (a thread's reader), a request alone is served by its reader (`_serve_turn`)."""
        job = Job(prompt, request, Channel(loop))
        if self.max_token_gap_s is not None:
            job.events.watch(self._between_layers)  # after its own cancellation check
        if self.max_tokens is not None and job.positions > self.max_tokens:
            raise PromptError(
                f"this request needs {job.positions} KV positions ({prompt.num_tokens} prompt tokens + "
                f"max_new_tokens={request.sampling.max_new_tokens}), more than max_batch_tokens={self.max_tokens} "
                "allows the whole batch: ask for fewer new tokens, retrieve fewer or shorter chunks, or raise "
                "ServingConfig.max_batch_tokens"
            )
        with self._cond:
            if self._stopped:
                raise EngineClosedError(
                    "the engine is closed (engine.close(), or the interpreter is exiting): no new "
                    "request runs; build a new engine to go on"
                )
            self._prune()
            others = self._waiting + self._active
            self._waiting.append(job)
            if self._thread is None:
                if serve_here and not others:
                    self._lone = job
                else:  # the worker serves every job from now on, the lone one's too (from its next turn)
                    self._lone = None
                    self._thread = threading.Thread(target=self._run, name="cacheblend-scheduler", daemon=True)
                    self._thread.start()
            lone = self._lone is job
            self._cond.notify_all()
        if not lone:
            release_thread_pool()  # this thread waits (or returns to an event loop) while the worker computes
        return job

    def stream(self, prompt: TokenizedPrompt, request: Request) -> TextStream:
        """Queue a request for a reader on this thread (or any other); alone, it is served by its reader."""
        job = self.submit(prompt, request, serve_here=True)
        return TextStream(self._served_events(job), job.cancel)

    def _served_events(self, job: Job) -> Iterator[Event]:
        """A thread's events of `job`: while the job is alone, each missing event is made here, in a turn this
        thread runs (`_lone_turn`). Once this thread no longer serves, its torch thread pool is let go
        (`release_thread_pool`)."""
        served = False
        while True:
            event = job.channel.take()
            if event is None:
                with self._lone_turn(job) as alone:
                    if alone:
                        self._one_turn()
                if alone:
                    served = True
                    continue
                if served:
                    release_thread_pool()  # handed to the worker: from now on this thread only waits
                    served = False
                event = job.channel.get()  # the worker serves it
            yield event
            if isinstance(event, (GenerationResult, BaseException)):
                if served:
                    release_thread_pool()
                return

    @contextmanager
    def _lone_turn(self, job: Job) -> Iterator[bool]:
        """The turn, held for the lone `job`'s reader (the calling thread) for the block; -> False, and nothing is
        held, when `job` is not alone (the worker serves it, or it is over). An interruption (KeyboardInterrupt)
        inside the block cancels the job."""
        # Wait for the turn only while the job is still alone (the previous lone request's reader may be ending its
        # turn): once a worker serves it, a reader queued behind the worker's turns would stop reading its text.
        while True:
            with self._cond:
                alone = self._lone is job
            if not alone or self._turn.acquire(timeout=0.01):
                break
        if not alone:
            yield False
            return
        try:
            with self._cond:
                alone = self._lone is job
            yield alone
        except BaseException:
            job.cancel()
            raise
        finally:
            with self._cond:
                if self._lone is job and (job.finished or job.cancelled):
                    self._lone = None  # nothing else is queued: let go of it (and of its cache) now
                    self._prune()
            self.slots.free()
            self._turn.release()

    def astream(self, prompt: TokenizedPrompt, request: Request) -> AsyncTextStream:
        """Queue a request for a reader on the running event loop."""
        job = self.submit(prompt, request, asyncio.get_running_loop())
        return AsyncTextStream(job.channel.async_events(), job.cancel)

    def stop(self, timeout: float | None = None) -> bool:
        """End the worker once its step in progress is done; the jobs waiting or decoding then end with
        EngineClosedError. -> False if it was still running after `timeout` seconds. Later requests raise."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            thread = self._thread
            lone = self._lone is not None
        if lone and self._turn.acquire(timeout=-1 if timeout is None else timeout):  # its reader may not come back
            try:
                self._one_turn()  # ends every job with the error
            finally:
                self._turn.release()
        return joined(thread, timeout)

    def after_fork_in_child(self) -> None:
        """In a forked child (`forking`): the parent's worker and readers do not exist here; start with no worker,
        nothing queued and fresh locks (one of the parent's threads may have held them)."""
        self._cond = threading.Condition()
        self._turn = threading.Lock()
        self._waiting, self._active = [], []
        self._thread = self._lone = None
        self.steps.hosted = 0
        self.slots.reset()

    @property
    def decode_pool(self) -> tuple[int, int]:
        """(slots, positions per slot) of the decoding requests' KV pool now; (0, 0) when none is held (the pool is
        let go once no request decodes)."""
        return self.slots.shape

    @property
    def largest_batch(self) -> int:
        """The most jobs one decode step has decoded together (for tests and benchmarks; set 0 to count anew)."""
        return self.steps.largest_batch

    @largest_batch.setter
    def largest_batch(self, value: int) -> None:
        self.steps.largest_batch = value

    @property
    def largest_batch_tokens(self) -> int:
        """The most KV positions (`Job.positions`) of the jobs of one decode step."""
        return self.steps.largest_batch_tokens

    @largest_batch_tokens.setter
    def largest_batch_tokens(self, value: int) -> None:
        self.steps.largest_batch_tokens = value

    @property
    def busy(self) -> int:
        """How many jobs are waiting or decoding (a job that ended is counted until the server's next turn drops it)."""
        with self._cond:
            return len(self._waiting) + len(self._active)

    def _run(self) -> None:
        """The worker thread: turns until nothing is left."""
        self.fills.host(True)
        try:
            while True:
                with self._turn:
                    if self._one_turn():
                        continue
                    with self._cond:
                        if self._waiting or self._active:
                            continue  # submitted meanwhile
                        self._thread = None
                        return
        finally:
            self.fills.host(False)  # what is left is stored on the fills' own thread

    def _one_turn(self) -> bool:
        """Start a waiting job, store one queued chunk, step the decoding jobs; -> False when nothing was left to
        serve (after a stop, every job has ended with an error). Run by one server at a time (`_turn`)."""
        with self._cond:
            self._prune()
            if self._stopped:
                for j in self._waiting + self._active:
                    j.cancel()
                    j.channel.put(EngineClosedError("the engine stopped before this request was answered"))
                self._waiting, self._active, self._lone = [], [], None
                self.slots.reset()
            if not self._waiting and not self._active:
                return False
            job = None
            if len(self._active) < self.max_batch:
                job = next((j for j in self._waiting if self._ready(j)), None)
                if job is not None and not self._fits(job):
                    job = None  # it waits for room; later jobs do not pass it
                if job is not None:
                    self._waiting.remove(job)
            batch = list(self._active)
        if job is not None and self.steps.start(job):
            with self._cond:
                self._active.append(job)
        stored = self.fills.run_next(self._fill_events)
        if job is None and not batch and not stored:
            with self._cond:
                self._cond.wait(0.02)  # only jobs whose chunks the fills' thread is storing: look again soon
            return True
        batch = [j for j in batch if not (j.cancelled or j.finished)]  # some may have ended in between
        if batch:
            self.steps.step(batch)
        return True

    def _ready(self, job: Job) -> bool:
        """False while one of the job's chunks is still being stored by a fill."""
        return self.fills.wait_for(job.prompt.chunk_ids, timeout=0)

    def _prune(self) -> None:
        """Drop the jobs no one serves any more: cancelled ones, and finished ones (under the condition's lock). A
        cancelled job's channel gets a last event, so a reader still waiting on it (another thread than the one
        that closed its stream) wakes up."""
        for job in self._waiting + self._active:
            if job.cancelled and not job.finished:
                job.channel.put(RequestCancelled("the request was cancelled"))
        self._waiting = [j for j in self._waiting if not j.cancelled]
        self.slots.leave([j for j in self._active if j.cancelled and not j.finished])
        self._active = [j for j in self._active if not (j.cancelled or j.finished)]

    def _fits(self, job: Job) -> bool:
        """Whether `job`'s KV fits beside the decoding jobs' under `max_tokens` (under the condition's lock)."""
        return self.max_tokens is None or job.positions + sum(j.positions for j in self._active) <= self.max_tokens

    def _between_layers(self, layer_idx: int) -> None:
        """A prefill (or the prefill of a chunk being stored) finished a layer: the requests already decoding get a
        step once one of them has waited `max_token_gap_s` since its last token."""
        assert self.max_token_gap_s is not None
        with self._cond:
            batch = [j for j in self._active if not (j.cancelled or j.finished)]
        if batch and time.perf_counter() - min(j.last_token_at for j in batch) >= self.max_token_gap_s:
            self.steps.hosted += 1
            self.steps.step(batch)
