"""One prefill's state, passed down its steps as one object: the prompt, what the prefill has cost so far, the hook
between its layers, and the entries it computed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..request.after_layer import AfterLayer
from ..request.metrics import RequestMetrics
from ..request.prompt import TokenizedPrompt


@dataclass
class PrefillRun:
    prompt: TokenizedPrompt
    metrics: RequestMetrics  # this attempt's (a retry starts new ones)
    # between the layers of each pass over the prompt: the decode steps of the requests already answering
    after_layer: AfterLayer | None = None
    # entries this request prefilled and stored: misses, even when a retry finds them (shared by the retries)
    fresh: set[str] = field(default_factory=set)
    t0: float = field(default_factory=time.perf_counter)  # when this attempt started
