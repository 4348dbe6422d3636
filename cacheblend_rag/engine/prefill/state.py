"""One prefill's state and its result: `PrefillRun`, passed down the steps of one attempt as one object (the prompt,
its mode, what it has cost so far, what watches its layers, the entries it computed), `Reading` (the stored KV a
cached attempt fuses), `Prefill` (the KV cache a prefill built, ready for decoding), and `Fills`, what a prefill needs
of the chunks stored after answers."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ...config import BlendConfig, PrefillMode
from ...fusion import FusionPlan, LayerEvents, PromptKV
from ...store import ChunkKV, ChunkReader
from ..chunks.placement import Placement
from ..request.metrics import RequestMetrics
from ..request.prompt import TokenizedPrompt


@dataclass
class PrefillRun:
    prompt: TokenizedPrompt
    metrics: RequestMetrics  # this attempt's (a retry starts new ones)
    mode: PrefillMode = PrefillMode.FULL  # this attempt's (the last retry is a full prefill)
    # what watches each pass over the prompt: a cancelled request's check, the decode steps of the requests answering
    events: LayerEvents | None = None
    # entries this request prefilled and stored: misses, even when a retry finds them (shared by the retries)
    fresh: set[str] = field(default_factory=set)
    last: bool = False  # the last attempt: an error is the request's
    t0: float = field(default_factory=time.perf_counter)  # when this attempt started


class Fills(Protocol):
    """What a prefill needs of the chunks stored after answers (`serving.deferred_fills.DeferredFills`)."""

    def wait_for(self, chunks: Iterable[Sequence[int]], timeout: float | None = None) -> bool:
        """Wait until none of `chunks` is queued or being stored."""
        ...

    def submit(
        self,
        prefix_ids: Sequence[int],
        chunks: Iterable[Sequence[int]],
        captured: Mapping[tuple[int, ...], ChunkKV] | None = None,
    ) -> None:
        """Queue `chunks` to be stored, from their `captured` entry where there is one."""
        ...


@dataclass
class Reading:
    """What a cached attempt fuses: the stored KV read for it, and its first pass over the prompt."""

    parts: list[ChunkReader]  # the prefix's KV, then the KV of each chunk the mode reads
    placements: Sequence[Placement]  # the prompt's plan (which entry each chunk reads)
    plan: FusionPlan  # the first pass's
    blend: BlendConfig | None  # the blend (its ratio chosen), None for prefix / reuse
    attention_from: torch.Tensor | None = None  # the "attention" rule: its first pass records the question's attention
    layers: int | None = None  # ... over this many layers (None: all)
    t_found: float = 0.0  # when the store lookups were done


@dataclass
class Prefill:
    """A built KV cache, ready for decoding: a cached mode's buffers (`kv`) or a full prefill's own cache; `cache`
    gives either as a transformers `DynamicCache`."""

    logits: torch.Tensor  # [vocab] float32, of the prompt's last token
    num_tokens: int
    metrics: RequestMetrics
    # chunks (token ids) that were not stored and were answered by a full prefill: store them after the answer
    deferred: tuple[tuple[int, ...], ...] = ()
    # entries cut from this request's full prefill (`chunks.capture`), to store at once
    captured: dict[tuple[int, ...], ChunkKV] = field(default_factory=dict)
    # a cached prefill's KV buffers, from which a request starts decoding (its first `num_tokens` positions)
    kv: PromptKV | None = None
    # the transformers cache: a full prefill's own; for a cached prefill, made over `kv` when `cache` is first read
    # (the engine's decoding reads `kv` itself, so a request never pays for it)
    model_cache: DynamicCache | None = None
    model_config: Any = field(default=None, repr=False)  # what `cache` is made with

    def __post_init__(self) -> None:
        if self.kv is None and self.model_cache is None:
            raise ValueError("a Prefill needs its KV buffers (kv) or a transformers cache (model_cache)")

    @property
    def cache(self) -> DynamicCache:
        """The prompt's KV as a transformers `DynamicCache` (over the `kv` buffers themselves, not a copy)."""
        if self.model_cache is None:
            assert self.kv is not None
            self.model_cache = decode_cache(self.model_config, self.kv)
        return self.model_cache


def decode_cache(config: Any, kv: PromptKV) -> DynamicCache:
    """A transformers decode cache over the prompt's KV buffers as they are: each full-attention layer takes its
    slice [1, Hkv, N, D] without a copy (other layer kinds, e.g. a sliding window's, are filled through `update`)."""
    cache = DynamicCache(config=config)
    for layer_idx, (layer, (k, v)) in enumerate(zip(cache.layers, kv.layers(batched=True), strict=True)):
        if type(layer) is DynamicLayer:  # what its first `update` sets, with the slice itself instead of a copy
            layer.keys, layer.values, layer.device, layer.is_initialized = k, v, k.device, True
        else:
            cache.update(k, v, layer_idx)
    return cache
