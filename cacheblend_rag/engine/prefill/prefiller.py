"""Building a prompt's KV cache in one of the four modes, with the request's metrics.

- full:   the model's own forward over the whole prompt (the reference; uses no cache).
- prefix: the shared prefix and the first chunk come from the cache (exactly what prefix caching can reuse:
          the first chunk was precomputed right after the prefix); everything after is computed.
- reuse:  every chunk's cached KV is placed at its real offset, only the suffix is computed (PromptCache).
- blend:  CacheBlend's selective recompute, with the rule of the request's `BlendConfig`.
The three cached modes run through the same fusor (`fusion.fuse`) with plans from `planning`. A chunk missing
from the store is prefilled on the spot and stored (`gather`). Chunks found on disk or in Redis are read layer by layer
while the fusor runs (`prefetch.LayerPrefetcher`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ...config import BlendConfig, Guard, PrefillMode, normalize_dtype_name
from ...fusion import FusionPlan, FusionResult, LayerSteps, PromptKV, fuse
from ...guard import escalate, first_token_signals
from ...models.adapter import LayerwiseModel
from ...store import ChunkKV, ChunkReader, CorruptEntryError
from ..chunks.cache import ChunkCache
from ..chunks.capture import capture
from ..chunks.placement import Placement, missing_chunks, to_capture
from ..request.after_layer import AfterLayer, between_layers
from ..request.metrics import RequestMetrics
from ..request.prompt import TokenizedPrompt
from .gather import gather
from .planning import (
    RatioPolicy,
    blend_plan,
    cold_cost_share,
    prefix_and_chunk_masks,
    question_mask,
    reuse_plan,
)
from .prefetch import LayerPrefetcher, LoadTiming
from .state import PrefillRun

logger = logging.getLogger(__name__)


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


class Prefiller:
    """Runs one prefill: reads the chunks through the chunk cache, plans, fuses, and fills the metrics."""

    def __init__(
        self,
        model: torch.nn.Module,
        lm: LayerwiseModel,
        chunks: ChunkCache,
        *,
        pipelined: bool,
        miss_policy: str,
        guard: Guard | None = None,
        steps: LayerSteps | None = None,
    ) -> None:
        self.model = model
        self.lm = lm
        self.chunks = chunks
        # stored layers are read on a thread ahead of the fusor (`prefetch`); False reads each one when the fusor
        # needs it, the reference the benchmarks and tests compare the pipeline with
        self.pipelined = pipelined
        self.miss_policy = miss_policy  # see EngineConfig.miss_policy
        self.guard = guard  # see EngineConfig.guard
        self.steps = steps  # how the fusor runs each layer's row-wise work (`fusion.layer_rows`); None: eagerly

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, cache: DynamicCache, *, all_logits: bool = False) -> torch.Tensor:
        """The model's own forward of `ids` ([T]) at positions start.., extending `cache`.

        -> logits of the last token [vocab], or of every token [T, vocab] with `all_logits` (float32).
        """
        device = self.lm.device
        out = self.model(
            input_ids=ids.to(device).unsqueeze(0),
            position_ids=torch.arange(start, start + ids.shape[0], device=device).unsqueeze(0),
            cache=cache,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
        )
        return out.logits[0].float() if all_logits else out.logits[0, -1].float()

    def run_retrying(
        self,
        prompt: TokenizedPrompt,
        mode: PrefillMode,
        blend: BlendConfig,
        policy: RatioPolicy | None,
        tiers: int,
        after_layer: AfterLayer | None = None,
        buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Prefill:
        """`run`, again when a stored chunk turns out damaged mid-request, then as a full prefill.

        A chunk read layer by layer can turn out damaged after the fusor has started; its tier has dropped it by
        then, so trying again finds it in another tier or recomputes it. Each retry follows the removal of one
        entry from one tier, so a prompt's entries (prefix and chunks, in each of the store's `tiers`) bound the
        retries; past that bound the request runs as a full prefill, which reads no stored KV.
        """
        fresh: set[str] = set()  # chunks prefilled during this request: misses, even when found on a retry
        for attempt in range((len(prompt.chunk_ids) + 1) * tiers + 1):
            try:
                return self.run(prompt, mode, blend, policy, after_layer, fresh, buffers)
            except CorruptEntryError as exc:
                logger.warning("prefill attempt %d read a damaged chunk (%s); trying again", attempt + 1, exc)
        logger.warning("the store kept returning damaged chunks; answering with a full prefill")
        return self.run(prompt, PrefillMode.FULL, blend, None, after_layer, fresh, buffers)

    def run(
        self,
        prompt: TokenizedPrompt,
        mode: PrefillMode,
        blend: BlendConfig,
        policy: RatioPolicy | None = None,
        after_layer: AfterLayer | None = None,
        fresh: set[str] | None = None,
        buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Prefill:
        """One attempt: `policy` chooses the blend ratio when given; `after_layer(layer_idx)` runs between the layers
        of each pass over the prompt (the scheduler's decode steps for the requests already answering); `fresh`
        collects the chunks prefilled during this request, across its attempts (`PrefillRun`); `buffers`: where a cached
        mode lays the prompt's KV (the request's decode slot), None for buffers of its own."""
        n = prompt.num_tokens
        num_layers = self.lm.shape.num_layers
        run = PrefillRun(prompt, self._metrics(mode, n), after_layer, set() if fresh is None else fresh)
        m = run.metrics

        if mode is PrefillMode.FULL or not prompt.chunk_ids:
            # Without chunks there is nothing to reuse or blend: every mode is a full prefill. It reads no stored
            # KV, and stores, at no cost, the chunks whose entries it computes exactly: a full prefill asked for
            # (a reference to measure other modes against, say) never stores its prompt's in-context KV, which
            # any later mode would read (captured entries come from cold requests and guard escalations).
            plan = self.chunks.place(prompt.prefix_ids, prompt.chunk_ids, "exact")
            return self._full(run, to_capture(plan))
        plan = self.chunks.place(prompt.prefix_ids, prompt.chunk_ids)  # which entry each chunk reads
        if any(p.found is None for p in plan):
            m.stored_otherwise = self.chunks.stored_otherwise(prompt.prefix_ids, plan)
        if mode is not PrefillMode.PREFIX and self.miss_policy != "blend":
            cold = self._answer_cold_in_full(run, plan, mode, blend)
            if cold is not None:
                return cold

        # Which chunks this mode reads from the cache: prefix caching can reuse only the first one.
        n_chunks = 1 if mode is PrefillMode.PREFIX else len(prompt.chunk_ids)
        got = gather(self.chunks, run, plan[:n_chunks], lazy=self.pipelined)
        t_found = time.perf_counter()
        m.load_s = t_found - run.t0 - m.precompute_s  # store lookups

        blend_cfg = None  # prefix / reuse: every token with loaded KV is used as is
        if mode is PrefillMode.BLEND:
            if policy is not None:
                decision = policy.choose_ratio(n, got.bytes_by_tier, m.hits_by_tier)
                blend = blend.with_ratio(decision.ratio)
                m.controller = decision.to_dict()
            blend_cfg = blend
            m.recompute_ratio = blend.recompute_ratio
        with self._loaded(got.parts, n, buffers) as (kv, loading):
            result = self._fuse(run, kv, n_chunks, blend_cfg)
        load_s, wait_s = loading.times()
        assert result.logits is not None
        m.recomputed_per_layer = result.recomputed_per_layer
        m.recomputed_tokens = int(result.selected_positions.numel())
        m.load_s += load_s
        m.wait_s = wait_s
        m.pipelined = self.pipelined
        m.compute_s = time.perf_counter() - t_found - wait_s
        m.compute_share = sum(m.recomputed_per_layer) / (n * num_layers)
        captured: dict[tuple[int, ...], ChunkKV] = {}
        if m.escalations and m.escalations[-1] >= 1.0:  # the guard recomputed every token: a full prefill's KV
            layers = result.kv.layers()
            todo = [p for p in to_capture(plan) if p.keys[0] not in run.fresh]  # not what this request just stored
            captured = capture(self.chunks, prompt, layers, todo)
            m.chunks_captured = len(captured)
        return Prefill(result.logits, n, m, captured=captured, kv=result.kv, model_config=self.model.config)

    def capture_full(self, prompt: TokenizedPrompt, placements: Sequence[Placement]) -> dict[tuple[int, ...], ChunkKV]:
        """A full prefill of `prompt` run for the entries it computes: those of the chunks `placements` (of the
        prompt's plan), cut from it; nothing runs when there are none."""
        if not placements:
            return {}
        return self._full(PrefillRun(prompt, self._metrics(PrefillMode.FULL, 0)), placements).captured

    def _metrics(self, mode: PrefillMode, n: int) -> RequestMetrics:
        return RequestMetrics(mode=mode.value, prompt_tokens=n, dtype=normalize_dtype_name(self.lm.dtype),
                              device=str(self.lm.device))  # fmt: skip

    def _full(self, run: PrefillRun, placements: Sequence[Placement] = ()) -> Prefill:
        """The model's own prefill of the whole prompt: exact, and reads nothing from the store. The entries of
        the chunks `placements` (of the prompt's plan, those to capture) are cut from it (`Prefill.captured`)."""
        prompt, m = run.prompt, run.metrics
        n, num_layers = prompt.num_tokens, self.lm.shape.num_layers
        m.mode = PrefillMode.FULL.value
        # every layer's cache whole, a sliding window's too (the model masks it): what capture and decoding read
        cache = DynamicCache()
        with between_layers(self.lm.layers, run.after_layer):
            logits = self.forward(prompt.input_ids(), 0, cache)
        layers = [(layer.keys[0], layer.values[0]) for layer in cache.layers]
        captured = capture(self.chunks, prompt, layers, placements)
        m.compute_s = time.perf_counter() - run.t0
        m.recomputed_tokens = n
        m.recomputed_per_layer = [n] * num_layers
        m.compute_share = 1.0
        m.chunks_captured = len(captured)
        return Prefill(logits, n, m, captured=captured, model_cache=cache)

    def _answer_cold_in_full(
        self, run: PrefillRun, plan: Sequence[Placement], mode: PrefillMode, blend: BlendConfig
    ) -> Prefill | None:
        """A full prefill when prefilling the request's missing chunks first would cost more than it (the miss
        policy). The missing chunks that prefill computes as their entries are stored from it (`Prefill.captured`);
        the others are prefilled and stored after the answer (`Prefill.deferred`). None: go on cached."""
        prompt, m = run.prompt, run.metrics
        missing = missing_chunks(plan)
        if not missing:
            return None
        share = cold_cost_share(prompt, missing, blend if mode is PrefillMode.BLEND else None, self.lm.shape.num_layers)
        if self.miss_policy == "auto" and share < 1.0:
            return None
        pre = self._full(run, to_capture(plan))
        gone = set(missing)
        m.chunks_missed = sum(tuple(ids) in gone for ids in prompt.chunk_ids)
        m.chunks_hit = len(prompt.chunk_ids) - m.chunks_missed
        m.cold_tokens = sum(len(ids) for ids in missing)
        m.fallback = f"full prefill: {len(missing)} of {len(prompt.chunk_ids)} chunks not stored yet"
        pre.deferred = tuple(ids for ids in missing if ids not in pre.captured)
        m.chunks_deferred = len(pre.deferred)
        return pre

    @contextmanager
    def _loaded(
        self, parts: Sequence[ChunkReader], n: int, buffers: tuple[torch.Tensor, torch.Tensor] | None
    ) -> Iterator[tuple[PromptKV, LoadTiming]]:
        """The prompt's KV buffers over the stored `parts`, and what reading them cost.
        Parts on disk or in Redis are read layer by layer as the fusor first needs each layer: on a thread ahead of
        it when pipelined."""
        timing = LoadTiming()
        t = time.perf_counter()
        whole = self.chunks.in_memory(parts)  # asked once: a chunk read whole is stacked into one tensor each time
        if whole is not None or not self.pipelined:
            load = None if whole is not None else timing.timed(self.chunks.layer_loader(parts))
            kv = self.chunks.prompt_kv(parts if whole is None else whole, n, load=load, buffers=buffers)
            timing.assembly_s = time.perf_counter() - t
            yield kv, timing
            return
        with LayerPrefetcher(self.chunks.layer_loader(parts), self.lm.shape.num_layers, self.lm.device) as prefetcher:
            timing.prefetcher = prefetcher
            kv = self.chunks.prompt_kv(parts, n, load=prefetcher.get, buffers=buffers)
            timing.assembly_s = time.perf_counter() - t
            yield kv, timing

    def _fuse(self, run: PrefillRun, kv: PromptKV, n_loaded: int, blend: BlendConfig | None) -> FusionResult:
        """Run the fusor over the prompt's KV `kv` (stored KV of the prefix, then of the first `n_loaded` chunks in
        order, at the head of the prompt).

        With a blend config, chunk tokens are recomputed as its rule chooses (`planning.blend_plan`); without
        one, every loaded token is used as is (prefix caching when `n_loaded` is 1 in a longer prompt, full KV
        reuse when it covers all). The "attention" rule first runs a full-reuse pass that records how much the
        question attends to each chunk token, then recomputes the top ones over that pass's KV (the same buffers;
        the choice is made on the device), records the risk signals of the result (`guard.first_token_signals`)
        and, with a guard, escalates a risky one (`guard.escalate`) from a copy of the first pass's KV.
        """
        prompt, m, after_layer, steps = run.prompt, run.metrics, run.after_layer, self.steps
        if blend is None:
            return fuse(self.lm, reuse_plan(prompt, n_loaded), kv, after_layer=after_layer, steps=steps)
        if not blend.uses_attention_pass:
            return fuse(self.lm, blend_plan(prompt, blend), kv, after_layer=after_layer, steps=steps)
        probe = fuse(self.lm, reuse_plan(prompt), kv, attention_from=question_mask(prompt), steps=steps,
                     layers=blend.probe_layers(self.lm.shape.num_layers), after_layer=after_layer)  # fmt: skip
        assert probe.attention is not None
        scores = probe.attention
        guard = self.guard if probe.logits is not None else None  # as for the rules without a first pass
        spent = list(probe.recomputed_per_layer)  # the probe's question-only pass is part of this rule's compute
        _, chunks = prefix_and_chunk_masks(prompt)
        # The fusor writes into the KV it reads: a guard that may blend again keeps a copy of the probe's.
        first_pass = kv.copy() if guard is not None else None

        def blend_at(cfg: BlendConfig, over: PromptKV) -> tuple[FusionResult, FusionPlan]:
            plan = blend_plan(prompt, cfg, scores)
            out = fuse(self.lm, plan, over, after_layer=after_layer, steps=steps)
            spent[:] = [a + b for a, b in zip(spent, out.recomputed_per_layer, strict=True)]
            return out, plan

        result, plan = blend_at(blend, kv)
        assert result.logits is not None and plan.chosen is not None
        if probe.logits is not None:  # a shallow first pass has no full-reuse logits to read the risk from
            m.risk = first_token_signals(result.logits, probe.logits, scores, chunks, plan.chosen)
        m.guard_reason = guard.reason(m.risk) if guard is not None else None
        if guard is not None and m.guard_reason is not None:
            assert first_pass is not None
            result, steps = escalate(guard, result, blend.recompute_ratio,
                                     lambda r: blend_at(blend.with_ratio(r), first_pass.copy())[0])  # fmt: skip
            m.escalations.extend(steps)
            if steps:
                m.recompute_ratio = steps[-1]
        result.recomputed_per_layer = spent
        return result


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
