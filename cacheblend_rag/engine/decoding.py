"""Decoding after the prefill: the token loop, streamed text deltas, and the final result.

`decode` is a generator of text deltas that ends with the `GenerationResult`; `TextStream` wraps it for callers
(iterate for text, `.result` once exhausted). The forward step is passed in, so that the engine decides how a
step runs (its lock, its device) and this loop stays about tokens and text.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from .generation import SamplingParams, TextAssembler, TokenPicker
from .metrics import RequestMetrics
from .prefill import Prefill

# (token id, its position, the cache to extend) -> logits [vocab] float32 of the next token
Step = Callable[[int, int, Any], torch.Tensor]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end of turn or a stop string) or "length"
    metrics: RequestMetrics


class TextStream:
    """Iterator over text deltas of one generation; `.result` holds the GenerationResult once exhausted."""

    def __init__(self, events: Generator[str | GenerationResult, None, None]) -> None:
        self._events = events
        self.result: GenerationResult | None = None

    def __iter__(self) -> TextStream:
        return self

    def close(self) -> None:
        """Stop generating now (a consumer that abandons the stream); `.result` stays None unless finished."""
        self._events.close()

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __next__(self) -> str:
        while True:
            event = next(self._events)  # StopIteration ends the stream
            if isinstance(event, GenerationResult):
                self.result = event
                continue
            if event:
                return event

    def collect(self) -> GenerationResult:
        """Run to the end and return the result (what `engine.generate` does)."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result


def decode(
    prefill: Callable[[], Prefill],
    step: Step,
    tokenizer: Any,
    eos_ids: set[int],
    params: SamplingParams,
    device: torch.device,
    t0: float,
    after: Callable[[RequestMetrics], None] | None = None,
) -> Generator[str | GenerationResult, None, None]:
    """Prefill (called on the first `next`), then pick tokens until end of turn, a stop string or the budget.

    `t0` is when the request arrived: the time to first token counts from it. `after` runs after the last text,
    before the result (`after`: work that must not delay the answer, e.g. storing chunks a cold request skipped).
    """
    pre = prefill()
    m = pre.metrics
    picker = TokenPicker(params, device)
    text = TextAssembler(tokenizer, params.stop)
    generated: list[int] = []
    token = picker(pre.logits, generated)
    m.ttft_s = time.perf_counter() - t0
    t_decode = time.perf_counter()
    finish = "length"
    pos = pre.num_tokens
    while True:
        if token in eos_ids:
            finish = "stop"
            break
        generated.append(token)
        delta = text.add(token)
        if text.stopped:
            finish = "stop"
            yield delta
            break
        yield delta
        if len(generated) >= params.max_new_tokens:
            break
        logits = step(token, pos, pre.cache)
        pos += 1
        token = picker(logits, generated)
    yield text.flush()
    m.decode_s = time.perf_counter() - t_decode
    m.generated_tokens = len(generated)
    if after is not None:
        after(m)
    yield GenerationResult(text.text, generated, finish, m)  # the same object: a background fill times itself in it
