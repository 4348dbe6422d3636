"""A callback handler that collects the blend metrics of every model call in a run.

A chain's answer is usually a plain string; the metrics of the calls behind it (one for stuff or blend, one
per document and a final one for map-reduce) travel in each generation's info, which this handler reads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.outputs import ChatGeneration, LLMResult


@dataclass
class CallRecord:
    """One model call: when it started (perf_counter seconds) and its `RequestMetrics.to_dict()`."""

    started: float
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def first_token_at(self) -> float:
        """perf_counter time of the call's first token."""
        return self.started + float(self.metrics.get("ttft_s", 0.0))


class CacheBlendMetricsHandler(BaseCallbackHandler):
    """Collects `CallRecord`s of CacheBlend model calls, in the order they finish.

    Example:
        ```python
        handler = CacheBlendMetricsHandler()
        chain.invoke({"input": question}, config={"callbacks": [handler]})
        handler.calls[-1].metrics["chunks_hit"]
        ```
    """

    def __init__(self) -> None:
        self.calls: list[CallRecord] = []
        self._started: dict[UUID, float] = {}

    def clear(self) -> None:
        self.calls.clear()
        self._started.clear()

    def _start(self, run_id: UUID) -> None:
        self._started[run_id] = time.perf_counter()

    def on_llm_start(self, serialized: dict[str, Any], prompts: list[str], *, run_id: UUID, **kwargs: Any) -> None:
        self._start(run_id)

    def on_chat_model_start(self, serialized: dict[str, Any], messages: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._start(run_id)

    def on_llm_end(self, response: LLMResult, *, run_id: UUID, **kwargs: Any) -> None:
        started = self._started.pop(run_id, time.perf_counter())
        for generations in response.generations:
            for generation in generations:
                metrics = (generation.generation_info or {}).get("cacheblend")
                if metrics is None and isinstance(generation, ChatGeneration):
                    # a streamed chat call keeps them in the message's metadata
                    metrics = generation.message.response_metadata.get("cacheblend")
                if metrics is not None:
                    self.calls.append(CallRecord(started, metrics))
