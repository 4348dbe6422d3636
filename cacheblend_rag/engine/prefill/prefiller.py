"""A request's prefill: its KV cache built in one of the four modes, with the request's metrics.

- full:   the model's own forward over the whole prompt (the reference; uses no cache).
- prefix: the shared prefix and the first chunk come from the cache (exactly what prefix caching can reuse:
          the first chunk was precomputed right after the prefix); everything after is computed.
- reuse:  every chunk's cached KV is placed at its real offset, only the suffix is computed (PromptCache).
- blend:  CacheBlend's selective recompute, with the rule of the request's `BlendConfig`.
The three cached modes run through the same fusor (`fusion.fuse`) with plans from `planning`. A chunk missing
from the store is prefilled on the spot and stored (`gather`). Chunks found on disk or in Redis are read layer by layer
while the fusor runs (`prefetch.LayerPrefetcher`). `Prefiller.run` is the one place a request's prefill runs (the
scheduler's job step and `engine.prefill` call it): its ratio, after the chunks still being stored, under the
engine's lock, retried when a stored chunk turns out damaged, and the entries a full prefill computed queued to be
stored.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
from transformers import DynamicCache

from ...config import BlendConfig, Guard, PrefillMode, normalize_dtype_name
from ...errors import ConfigError
from ...fusion import FusionPlan, FusionResult, LayerEvents, LayerSteps, PromptKV, fuse, logits_of
from ...guard import escalate, first_token_signals
from ...models.adapter import LayerwiseModel
from ...store import ChunkKV, ChunkReader, CorruptEntryError
from ..chunks.cache import ChunkCache
from ..chunks.capture import capture
from ..chunks.placement import Placement, missing_chunks, to_capture
from ..request.metrics import RequestMetrics
from ..request.prompt import TokenizedPrompt
from ..request.request import Request
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
from .state import Fills, Prefill, PrefillRun, Reading

logger = logging.getLogger(__name__)


class Prefiller:
    """Runs one prefill: reads the chunks through the chunk cache, plans, fuses, and fills the metrics."""

    def __init__(
        self,
        model: torch.nn.Module,
        lm: LayerwiseModel,
        chunks: ChunkCache,
        fills: Fills,
        lock: threading.RLock,
        *,
        blend: BlendConfig,
        controller: RatioPolicy | None = None,
        pipelined: bool = True,
        miss_policy: str = "auto",
        guard: Guard | None = None,
        steps: LayerSteps | None = None,
    ) -> None:
        self.model = model
        self.lm = lm
        self.chunks = chunks
        self.fills = fills  # the chunks cold requests skipped, stored after their answers
        self.lock = lock  # the engine's: one forward at a time
        self.blend = blend  # the engine's rule (EngineConfig.blend), for a request that names none
        self.controller = controller  # chooses the ratio of a request that pins none (the loading controller)
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

    def extend(self, prefill: Prefill, token_ids: Sequence[int]) -> torch.Tensor:
        """Feed tokens after a prefilled prompt in one forward, under the engine's lock (`engine.extend`); -> logits
        [T, vocab] float32. The prefill's cache grows by these tokens and `num_tokens` with it."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        if ids.ndim != 1 or ids.numel() == 0:
            raise ConfigError("extend needs a non-empty list of token ids")
        with self.lock:
            logits = self.forward(ids, prefill.num_tokens, prefill.cache, all_logits=True)
        prefill.num_tokens += ids.numel()
        return logits

    def run(
        self,
        prompt: TokenizedPrompt,
        request: Request,
        events: LayerEvents | None = None,
        buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Prefill:
        """A checked request's prefill: the ratio the request, the engine's blend or the controller gives; after any
        chunk of the prompt still being stored; under the engine's lock, `events` told of each layer (the request's
        cancellation, the scheduler's decode steps for the requests answering); a cached mode lays the prompt's KV
        in `buffers` when given (the request's decode slot), else in buffers of its own. The entries a full prefill
        computed are queued to be stored at once.

        A chunk read layer by layer can turn out damaged after the fusor has started; its tier has dropped it by then,
        so the attempt is made again (`_attempts`), and the last one is a full prefill, which reads no stored KV.
        """
        pinned = request.recompute_ratio is not None or request.blend is not None
        blend = request.blend or self.blend
        if request.recompute_ratio is not None:
            blend = blend.with_ratio(request.recompute_ratio)
        policy = self.controller if request.mode is PrefillMode.BLEND and not pinned else None
        self.fills.wait_for(prompt.chunk_ids)  # a chunk an earlier cold request is storing: wait, not recompute
        with self.lock:
            for run in self._attempts(prompt, request.mode, events):
                try:
                    read = self._read(run, blend, policy)
                    if isinstance(read, Prefill):  # a full prefill: asked for, or cheaper than the missing chunks
                        pre = read
                        break
                    with self._loaded(read.parts, prompt.num_tokens, buffers) as (kv, loading):
                        result = fuse(self.lm, read.plan, kv, attention_from=read.attention_from, layers=read.layers,
                                      events=events, steps=self.steps,
                                      logits_later=read.attention_from is not None)  # fmt: skip
                        if read.attention_from is not None:  # the blend of the tokens the first pass chose
                            result = self._blend_after_probe(run, kv, read.blend, result)
                    pre = self._cached(run, read, result, loading)
                    break
                except CorruptEntryError as exc:
                    if run.last:
                        raise
                    logger.warning("a prefill attempt read a damaged chunk (%s); trying again", exc)
        # entries a full prefill computed: stored at once on the fills' thread (no compute, only the store's writes)
        self.fills.submit(prompt.prefix_ids, pre.captured, pre.captured)
        pre.captured = {}  # the fills' thread holds them until stored
        return pre

    def _attempts(self, prompt: TokenizedPrompt, mode: PrefillMode, events: LayerEvents | None) -> Iterator[PrefillRun]:
        """Each attempt's state, in `mode`, then as a full prefill. Each retry follows the removal of one entry from
        one tier, so a prompt's entries (prefix and chunks, in each of the store's tiers) bound the retries."""
        fresh: set[str] = set()  # chunks prefilled during this request: misses, even when found on a retry
        for _ in range((len(prompt.chunk_ids) + 1) * self.chunks.tiers + 1):
            yield PrefillRun(prompt, self._metrics(mode, prompt.num_tokens), mode, events, fresh)
        logger.warning("the store kept returning damaged chunks; answering with a full prefill")
        full = PrefillMode.FULL
        yield PrefillRun(prompt, self._metrics(full, prompt.num_tokens), full, events, fresh, last=True)

    def _read(self, run: PrefillRun, blend: BlendConfig, policy: RatioPolicy | None) -> Prefill | Reading:
        """Plan the chunks and read their stored KV for the fusor; or a full prefill (the mode asked, a prompt
        without chunks, or a cold request the miss policy answers in full). `policy` chooses the blend ratio."""
        prompt, m, mode = run.prompt, run.metrics, run.mode
        if mode is PrefillMode.FULL or not prompt.chunk_ids:
            # Without chunks there is nothing to reuse or blend: every mode is a full prefill. It reads no stored
            # KV, and stores, at no cost, the chunks whose entries it computes exactly: a full prefill asked for
            # (a reference to measure other modes against, say) never stores its prompt's in-context KV, which
            # any later mode would read (captured entries come from cold requests and guard escalations).
            return self._full(run, to_capture(self.chunks.place(prompt.prefix_ids, prompt.chunk_ids, "exact")))
        plan = self.chunks.place(prompt.prefix_ids, prompt.chunk_ids)  # which entry each chunk reads
        if any(p.found is None for p in plan):
            m.stored_otherwise = self.chunks.stored_otherwise(prompt.prefix_ids, plan)
        if mode is not PrefillMode.PREFIX and self.miss_policy != "blend":
            cold = self._answer_cold_in_full(run, plan, blend)
            if cold is not None:
                return cold

        # Which chunks this mode reads from the cache: prefix caching can reuse only the first one.
        n_chunks = 1 if mode is PrefillMode.PREFIX else len(prompt.chunk_ids)
        got = gather(self.chunks, run, plan[:n_chunks], lazy=self.pipelined)
        t_found = time.perf_counter()
        m.load_s = t_found - run.t0 - m.precompute_s  # store lookups
        if mode is not PrefillMode.BLEND:  # prefix / reuse: every token with loaded KV is used as is
            return Reading(got.parts, plan, reuse_plan(prompt, n_chunks), None, t_found=t_found)
        if policy is not None:
            decision = policy.choose_ratio(prompt.num_tokens, got.bytes_by_tier, m.hits_by_tier)
            blend = blend.with_ratio(decision.ratio)
            m.controller = decision.to_dict()
        m.recompute_ratio = blend.recompute_ratio
        if not blend.uses_attention_pass:
            return Reading(got.parts, plan, blend_plan(prompt, blend), blend, t_found=t_found)
        # The "attention" rule first runs a full-reuse pass that records how much the question attends to each chunk
        # token (`_blend_after_probe` then recomputes the top ones over that pass's KV).
        return Reading(got.parts, plan, reuse_plan(prompt), blend, question_mask(prompt),
                       blend.probe_layers(self.lm.shape.num_layers), t_found)  # fmt: skip

    def _cached(self, run: PrefillRun, read: Reading, result: FusionResult, loading: LoadTiming) -> Prefill:
        """A cached attempt's result, its metrics filled; a guard escalation to every token captures the entries its
        full prefill's KV holds."""
        prompt, m = run.prompt, run.metrics
        n, num_layers = prompt.num_tokens, self.lm.shape.num_layers
        load_s, wait_s = loading.times()
        assert result.logits is not None
        m.recomputed_per_layer = result.recomputed_per_layer
        m.recomputed_tokens = int(result.selected_positions.numel())
        m.load_s += load_s
        m.wait_s = wait_s
        m.pipelined = self.pipelined
        m.compute_s = time.perf_counter() - read.t_found - wait_s
        m.compute_share = sum(m.recomputed_per_layer) / (n * num_layers)
        captured: dict[tuple[int, ...], ChunkKV] = {}
        if m.escalations and m.escalations[-1] >= 1.0:  # the guard recomputed every token: a full prefill's KV
            layers = result.kv.layers()
            todo = [p for p in to_capture(read.placements) if p.keys[0] not in run.fresh]  # not what it just stored
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
        with run.events.hooked(self.lm.layers) if run.events is not None else nullcontext():
            logits = self.forward(prompt.input_ids(), 0, cache)
        layers = [(layer.keys[0], layer.values[0]) for layer in cache.layers]
        captured = capture(self.chunks, prompt, layers, placements)
        m.compute_s = time.perf_counter() - run.t0
        m.recomputed_tokens = n
        m.recomputed_per_layer = [n] * num_layers
        m.compute_share = 1.0
        m.chunks_captured = len(captured)
        return Prefill(logits, n, m, captured=captured, model_cache=cache)

    def _answer_cold_in_full(self, run: PrefillRun, plan: Sequence[Placement], blend: BlendConfig) -> Prefill | None:
        """A full prefill when prefilling the request's missing chunks first would cost more than it (the miss
        policy). The missing chunks that prefill computes as their entries are stored from it (`Prefill.captured`);
        the others are prefilled and stored after the answer (`Prefill.deferred`). None: go on cached."""
        prompt, m = run.prompt, run.metrics
        missing = missing_chunks(plan)
        if not missing:
            return None
        blended = blend if run.mode is PrefillMode.BLEND else None
        share = cold_cost_share(prompt, missing, blended, self.lm.shape.num_layers)
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

    def _blend_after_probe(
        self, run: PrefillRun, kv: PromptKV, blend: BlendConfig | None, probe: FusionResult
    ) -> FusionResult:
        """The "attention" rule after its first pass (`probe`, full reuse recording how much the question attends to
        each chunk token): recompute the top tokens over that pass's KV `kv` (the same buffers; the choice is made on
        the device), record the risk signals of the result (`guard.first_token_signals`) and, with a guard, escalate
        a risky one (`guard.escalate`) from a copy of the first pass's KV."""
        prompt, m, events, steps = run.prompt, run.metrics, run.events, self.steps
        assert blend is not None and probe.attention is not None
        scores = probe.attention
        reused = probe.hidden is not None  # a shallow first pass has no full-reuse logits to read the risk from
        guard = self.guard if reused else None  # as for the rules without a first pass
        spent = list(probe.recomputed_per_layer)  # the probe's question-only pass is part of this rule's compute
        _, chunks = prefix_and_chunk_masks(prompt)
        # The fusor writes into the KV it reads: a guard that may blend again keeps a copy of the probe's.
        first_pass = kv.copy() if guard is not None else None

        def blend_at(cfg: BlendConfig, over: PromptKV, logits_later: bool = False) -> tuple[FusionResult, FusionPlan]:
            plan = blend_plan(prompt, cfg, scores)
            out = fuse(self.lm, plan, over, events=events, steps=steps, logits_later=logits_later)
            spent[:] = [a + b for a, b in zip(spent, out.recomputed_per_layer, strict=True)]
            return out, plan

        result, plan = blend_at(blend, kv, logits_later=reused)
        if reused:  # the blend's and the first pass's logits from one read of the LM head's weights
            logits_of(self.lm, [result, probe])
            assert probe.logits is not None and result.logits is not None and plan.chosen is not None
            m.risk = first_token_signals(result.logits, probe.logits, scores, chunks, plan.chosen)
        m.guard_reason = guard.reason(m.risk) if guard is not None else None
        if guard is not None and m.guard_reason is not None:
            assert first_pass is not None
            result, ratios = escalate(guard, result, blend.recompute_ratio,
                                      lambda r: blend_at(blend.with_ratio(r), first_pass.copy())[0])  # fmt: skip
            m.escalations.extend(ratios)
            if ratios:
                m.recompute_ratio = ratios[-1]
        result.recomputed_per_layer = spent
        return result
