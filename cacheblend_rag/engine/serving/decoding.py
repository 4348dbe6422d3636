"""Decoding after the prefill: one request's token loop as a state machine, and the streams callers read.

`TokenLoop` is a request's decoding state: it picks each token from logits, assembles the text, and knows when the
answer ends (end of turn, a stop string, the budget). It never runs a forward: the scheduler feeds it the logits of
batched steps, so that any number of requests advance together. Its text deltas and final `GenerationResult` go
to the caller through a `TextStream` (iterate for text) or an `AsyncTextStream` (`async for`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..request.metrics import RequestMetrics
from ..request.request import SamplingParams
from .tokens import TextAssembler, TokenPicker


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end of turn or a stop string) or "length"
    metrics: RequestMetrics


class TokenLoop:
    """One request's decoding: `first` after its prefill, then `next` per step, until `done`.

    `token` is the token the next step must feed (None once done). Each call returns the text it made safe to
    show (possibly empty); `result()` gives the `GenerationResult` once done, with the rest of the text.
    """

    def __init__(self, tokenizer: Any, eos_ids: set[int], params: SamplingParams, device: torch.device) -> None:
        self.params = params
        self.eos_ids = eos_ids
        self.picker = TokenPicker(params, device)
        self.text = TextAssembler(tokenizer, params.stop)
        self.generated: list[int] = []
        self.token: int | None = None
        self.finish: str | None = None
        self.metrics: RequestMetrics | None = None
        self._t_decode = 0.0

    @property
    def done(self) -> bool:
        return self.finish is not None

    def first(self, logits: torch.Tensor, metrics: RequestMetrics, t0: float) -> str:
        """The prefill's logits give the first token; `t0` is when the request arrived (TTFT counts from it)."""
        self.metrics = metrics
        out = self._accept(self.picker(logits, self.generated))
        metrics.ttft_s = time.perf_counter() - t0
        self._t_decode = time.perf_counter()
        return out

    def next(self, logits: torch.Tensor) -> str:
        """logits [vocab] float32 of the step that fed `token`."""
        return self._accept(self.picker(logits, self.generated))

    def take(self, token: int) -> str:
        """`next` with the token already picked from the step's logits (a greedy request's, by `greedy_tokens`)."""
        if not self.picker.greedy:
            raise ValueError("a sampled request picks its own tokens (its seed and settings): call next(logits)")
        return self._accept(token)

    def _accept(self, token: int) -> str:
        self.token = None
        if token in self.eos_ids:
            self.finish = "stop"
            return ""
        self.generated.append(token)
        delta = self.text.add(token)
        if self.text.stopped:
            self.finish = "stop"
        elif len(self.generated) >= self.params.max_new_tokens:
            self.finish = "length"
        else:
            self.token = token
        return delta

    def result(self) -> tuple[str, GenerationResult]:
        """-> (the text held back until the end, the result). Call once `done`."""
        assert self.finish is not None and self.metrics is not None
        m = self.metrics
        m.decode_s = time.perf_counter() - self._t_decode
        m.generated_tokens = len(self.generated)
        rest = self.text.flush()
        return rest, GenerationResult(self.text.text, self.generated, self.finish, m)


class RequestCancelled(Exception):
    """A request's reader left (a stream closed, an asyncio task cancelled or timed out): raised between the layers
    of its prefill, which stops there, and the last event of its channel, which wakes a reader still waiting on it.
    A closed stream ends quietly on it; no caller sees it."""


Event = str | GenerationResult | BaseException  # what a request's channel carries, in order


class _Events:
    """What both streams share: the request's cancel, the `.result` once it arrives, and reading one event."""

    def __init__(self, cancel: Callable[[], None]) -> None:
        self._cancel = cancel
        self._closed = False
        self.result: GenerationResult | None = None

    def _stop(self) -> None:
        """End the stream now; the request is cancelled unless it finished."""
        self._closed = True
        if self.result is None:
            self._cancel()

    def _take(self, event: Event) -> str:
        """An event's text ("" for none); the result is kept, an error raised (a closed stream's cancel ends it)."""
        if isinstance(event, RequestCancelled) and self._closed:
            return ""
        if isinstance(event, BaseException):
            raise event
        if isinstance(event, GenerationResult):
            self.result = event
            return ""
        return event


class TextStream(_Events):
    """Iterator over text deltas of one generation; `.result` holds the GenerationResult once exhausted.

    `close()` (or leaving a `with` block, or dropping the stream), from any thread, cancels the request: the engine
    stops its prefill at the next layer, or its decoding at the next step, and the others go on.
    """

    def __init__(self, events: Iterator[Event], cancel: Callable[[], None]) -> None:
        super().__init__(cancel)
        self._events = events

    def __iter__(self) -> TextStream:
        return self

    def close(self) -> None:
        """Stop generating now (a consumer that abandons the stream); `.result` stays None unless finished.
        The stream then ends: `next` raises StopIteration."""
        self._stop()

    def __del__(self) -> None:
        self._stop()

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def __next__(self) -> str:
        while not self._closed:
            text = self._take(next(self._events))  # StopIteration ends the stream
            if text:
                return text
        raise StopIteration

    def collect(self) -> GenerationResult:
        """Run to the end and return the result (what `engine.generate` does): every event read, as `next` reads
        them, with no text handed back on the way."""
        while not self._closed:
            event = next(self._events, None)
            if event is None:
                break
            self._take(event)
        assert self.result is not None
        return self.result


class AsyncTextStream(_Events):
    """`async for` over text deltas of one generation; `.result` holds the GenerationResult once exhausted.

    Awaiting a delta parks the task without a thread: the engine's scheduler hands each event to the event loop.
    `aclose()` cancels the request, as does a task cancelled while it waits (`asyncio.wait_for` timing out): its
    prefill stops at the next layer, its decoding at the next step.
    """

    def __init__(self, events: AsyncIterator[Event], cancel: Callable[[], None]) -> None:
        super().__init__(cancel)
        self._events = events

    def __aiter__(self) -> AsyncTextStream:
        return self

    async def aclose(self) -> None:
        """Stop generating now; the stream then ends."""
        self._stop()

    def __del__(self) -> None:
        if self.result is None:
            self._cancel()

    async def __aenter__(self) -> AsyncTextStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop()

    async def __anext__(self) -> str:
        while not self._closed:
            try:
                event = await self._events.__anext__()  # StopAsyncIteration ends the stream
            except BaseException:
                if self.result is None:
                    self._cancel()
                raise
            text = self._take(event)
            if text:
                return text
        raise StopAsyncIteration

    async def collect(self) -> GenerationResult:
        """Run to the end and return the result (what `engine.agenerate` does)."""
        async for _ in self:
            pass
        assert self.result is not None
        return self.result
