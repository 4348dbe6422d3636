"""What the scheduler queues and serves: a `Job` (one request, its decoding state and its cache), the `Channel` that
carries its events, in order, from whoever serves it to whoever reads it, and `Served`, what the scheduler needs of
the engine."""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..prefill.prefiller import Prefill
from ..request.after_layer import AfterLayer
from ..request.prompt import TokenizedPrompt
from ..request.request import Request
from .decoding import Event, GenerationResult, RequestCancelled, TokenLoop
from .deferred_fills import DeferredFills


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

    @property
    def positions(self) -> int:
        """The KV positions it holds while decoding: its prompt and room for its whole answer."""
        return self.prompt.num_tokens + self.request.sampling.max_new_tokens

    def cancel(self) -> None:
        self.cancelled = True

    def watching(self, after_layer: AfterLayer | None) -> AfterLayer:
        """What this job's prefill runs between its layers: RequestCancelled once the job is cancelled (the prefill
        stops there), else `after_layer` (the scheduler's decode steps for the others) if given."""

        def between(layer_idx: int) -> None:
            if self.cancelled:
                raise RequestCancelled(f"the request was cancelled after layer {layer_idx} of its prefill")
            if after_layer is not None:
                after_layer(layer_idx)

        return between


class Served(Protocol):
    """What the scheduler serves (the engine): a request's two steps, and the chunks to store in its turns."""

    @property
    def fills(self) -> DeferredFills:
        """The chunks cold requests were answered without, stored by the scheduler's worker in its turns."""
        ...

    def run_prefill(
        self,
        prompt: TokenizedPrompt,
        request: Request,
        after_layer: AfterLayer | None,
        buffers: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> Prefill:
        """The request's prefill (taking the engine's lock itself), `after_layer` between its layers if given, its KV
        laid in `buffers` (the request's decode slot) when given and its mode reads stored KV."""
        ...

    def token_loop(self, request: Request) -> TokenLoop:
        """A fresh token loop for the request's sampling settings."""
        ...
