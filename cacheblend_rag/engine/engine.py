"""The engine that serves one request: find the chunks' KV, build the prompt's KV in the chosen mode, decode.

Modes (`PrefillMode`):
- full:   the model's own forward over the whole prompt (the reference; uses no cache).
- prefix: the shared prefix and the first chunk come from the cache (exactly what prefix caching can reuse:
          the first chunk was precomputed right after the prefix); everything after is computed.
- reuse:  every chunk's cached KV is placed at its real offset, only the suffix is computed (PromptCache).
- blend:  CacheBlend's selective recompute.
The three cached modes run through the same fusor (`fusion.fuse`) with different plans; tests check each
against the model's own forward.
A chunk missing from the store is prefilled on the spot (after the prefix) and stored, in every cached mode.
Chunks found on disk or in Redis are read layer by layer while the fusor runs (`pipeline.LayerPrefetcher`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..config import BlendConfig, EngineConfig, PrefillMode
from ..controller import LoadingController
from ..errors import ConfigError, PromptError
from ..fusion import FusionPlan, fuse
from ..models.adapter import LayerwiseModel
from ..models.fingerprint import model_fingerprint
from ..models.support import max_blend_length
from ..store import ChunkKV, ChunkReader, ChunkStore, CorruptEntryError, Hit, TieredStore, build_store, chunk_key
from ..store.lazy import LazyChunkKV
from .generation import SamplingParams, TextAssembler, TokenPicker, check_encodable, check_ratio_arg, eos_token_ids
from .metrics import RequestMetrics
from .pipeline import LayerPrefetcher
from .planning import blend_plan, reuse_plan
from .prompt import PromptTemplate, TokenizedPrompt, tokenize_chunks, tokenize_parts, tokenize_prefix

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Prefill:
    """A built KV cache, ready for decoding."""

    cache: DynamicCache
    logits: torch.Tensor  # [vocab] float32, of the prompt's last token
    num_tokens: int
    metrics: RequestMetrics


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end of turn or a stop string) or "length"
    metrics: RequestMetrics


class TextStream:
    """Iterator over text deltas of one generation; `.result` holds the GenerationResult once exhausted."""

    def __init__(self, events: Iterator[str | GenerationResult]) -> None:
        self._events = events
        self.result: GenerationResult | None = None

    def __iter__(self) -> TextStream:
        return self

    def close(self) -> None:
        """Stop generating now (a consumer that abandons the stream); `.result` stays None unless finished."""
        close = getattr(self._events, "close", None)
        if close is not None:
            close()

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


class CacheBlendEngine:
    """One model, one chunk store, and the four ways to prefill a prompt made of chunks."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        config: EngineConfig | None = None,
        store: ChunkStore | None = None,
        template: PromptTemplate | None = None,
        controller: LoadingController | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        # Picks the blend ratio per request from load time (paper §5.1) when the caller does not pin one.
        self.controller = controller
        dtype = _TORCH_DTYPES[self.config.dtype]
        device = torch.device(self.config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {self.config.device!r} asked for, but no CUDA device is present; use 'cpu'")
        model = model.to(device=device, dtype=dtype).eval()
        self.model = model
        self.tokenizer = tokenizer
        self.lm = LayerwiseModel(model)
        self.device, self.dtype = device, dtype
        self.store: ChunkStore = (
            store
            if store is not None
            else build_store(
                memory_bytes=self.config.memory_budget_bytes,
                disk_dir=self.config.disk_dir,
                disk_bytes=self.config.disk_budget_bytes,
                redis_url=self.config.redis_url,
                redis_bytes=self.config.redis_budget_bytes,
                hmac_key=self.config.store_hmac_key,
            )
        )
        self.template = template or PromptTemplate()
        self.fingerprint = model_fingerprint(model)
        if controller is not None and (
            controller.profile.model != self.fingerprint or controller.profile.dtype != self.config.dtype
        ):
            raise ConfigError(
                f"the loading profile was measured for model {controller.profile.model[:12]} in "
                f"{controller.profile.dtype}, this engine runs {self.fingerprint[:12]} in {self.config.dtype}; "
                f"run `cacheblend-rag profile` for this model and dtype"
            )
        self.eos_ids = eos_token_ids(model, tokenizer)
        limits = [self.lm.shape.max_positions]
        if self.config.max_prompt_tokens is not None:
            limits.append(self.config.max_prompt_tokens)
        window = max_blend_length(model.config)
        if window is not None:
            limits.append(window)
        self.max_tokens = min(limits)
        last_check = self.config.blend.check_layers[-1]
        if last_check >= self.lm.shape.num_layers:
            raise ConfigError(
                f"blend.check_layers has layer {last_check}, but the model has {self.lm.shape.num_layers} "
                f"layers (0..{self.lm.shape.num_layers - 1})"
            )
        # One forward at a time: the model's modules are shared, and on CPU parallel forwards only contend.
        self._lock = threading.RLock()

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | None = None,
        *,
        config: EngineConfig | None = None,
        store: ChunkStore | None = None,
        template: PromptTemplate | None = None,
        controller: LoadingController | None = None,
        cache_dir: str | None = None,
        show_progress: bool = True,
    ) -> CacheBlendEngine:
        """Load a preset (default: the default preset) or a local Llama/Mistral/Qwen2/Qwen3 checkpoint."""
        from ..models import DEFAULT_PRESET, load_model

        config = config or EngineConfig()
        model, tokenizer = load_model(
            name_or_path or DEFAULT_PRESET,
            device=config.device,
            dtype=config.dtype,
            cache_dir=cache_dir,
            show_progress=show_progress,
        )
        return cls(model, tokenizer, config=config, store=store, template=template, controller=controller)

    # -- prompts --------------------------------------------------------------------------------------------

    def build_prompt(
        self,
        chunks: Sequence[str],
        question: str | None = None,
        *,
        template: PromptTemplate | None = None,
        prefix: str | None = None,
        suffix: str | None = None,
    ) -> TokenizedPrompt:
        """Tokenize a request. Either a question (rendered with the template) or an explicit prefix/suffix."""
        if question is not None:
            if prefix is not None or suffix is not None:
                raise PromptError("give either a question (the template renders it) or prefix/suffix, not both")
            if not question.strip():
                raise PromptError("the question is empty")
            prefix, suffix = (template or self.template).render(self.tokenizer, question)
        elif suffix is None:
            raise PromptError("give a question, or a suffix (the text after the chunks)")
        return tokenize_parts(self.tokenizer, prefix or "", chunks, suffix, separator=self.config.chunk_separator)

    def _check_length(self, prompt: TokenizedPrompt, max_new_tokens: int = 0) -> None:
        total = prompt.num_tokens + max_new_tokens
        if total > self.max_tokens:
            raise PromptError(
                f"prompt of {prompt.num_tokens} tokens + {max_new_tokens} new tokens exceeds the model's limit of "
                f"{self.max_tokens}; retrieve fewer or shorter chunks, or lower max_new_tokens"
            )

    # -- chunk KV -------------------------------------------------------------------------------------------

    def chunk_key(self, prefix_ids: Sequence[int], chunk_ids: Sequence[int]) -> str:
        """The store key of a chunk's KV when it follows `prefix_ids` (model fingerprint, dtype and tokens)."""
        return chunk_key(self.fingerprint, self.dtype, prefix_ids, chunk_ids)

    _key = chunk_key  # the name the engine's own methods use

    def _layer_loader(
        self, parts: Sequence[ChunkReader], total: int
    ) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        """Loads layer l of the given KV parts laid end to end, padded with zeros up to `total` tokens."""
        covered = sum(p.num_tokens for p in parts)
        pad = total - covered
        hkv, d = self.lm.shape.num_kv_heads, self.lm.shape.head_dim

        def load(layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
            ks, vs = [], []
            for p in parts:
                k, v = p.layer(layer_idx)  # [Hkv, T_p, D] each; a stored chunk may read (and check) it only now
                ks.append(k.to(self.device, non_blocking=True))
                vs.append(v.to(self.device, non_blocking=True))
            if pad:
                z = torch.zeros(hkv, pad, d, dtype=self.dtype, device=self.device)
                ks.append(z)
                vs.append(z)
            return torch.cat(ks, dim=1), torch.cat(vs, dim=1)  # [Hkv, total, D], fresh tensors

        return load

    def _prefill_kv(self, prefix: ChunkReader | None, prefix_ids: Sequence[int], ids: Sequence[int]) -> ChunkKV:
        """Prefill `ids` after the (cached) prefix and keep only their KV."""
        p = len(prefix_ids)
        all_ids = torch.tensor([*prefix_ids, *ids], dtype=torch.long)
        n = all_ids.shape[0]
        exact = torch.zeros(n, dtype=torch.bool)
        exact[:p] = True
        plan = FusionPlan(
            input_ids=all_ids,
            positions=torch.arange(n),
            exact=exact,
            reused=torch.zeros(n, dtype=torch.bool),
        )
        parts = [prefix] if prefix is not None else []
        result = fuse(self.lm, plan, self._layer_loader(parts, n), want_logits=False, keep_raw_keys=True)
        assert result.raw_keys is not None
        keys = torch.stack([k[:, p:] for k in result.raw_keys])  # [L, Hkv, T, D]
        values = torch.stack([v[:, p:] for v in result.values])
        return ChunkKV(self._key(prefix_ids, ids), keys, values)

    def _lookup(self, key: str, num_tokens: int) -> Hit | None:
        """The store's hit for `key` if it has this model's dtype and the shape of `num_tokens` tokens.

        The key hashes model, dtype and tokens, so any other shape is a damaged or forged entry: it is dropped
        (and recomputed by the caller) before a single layer of it is read.
        """
        hit = self.store.open(key)
        if hit is None:
            return None
        shape = (self.lm.shape.num_layers, self.lm.shape.num_kv_heads, num_tokens, self.lm.shape.head_dim)
        if hit.kv.dtype == self.dtype and tuple(hit.kv.shape) == shape:
            return hit
        logger.warning(
            "chunk %s in the %s tier has dtype %s and shape %s, expected %s and %s; recomputing it",
            key[:12],
            hit.tier,
            hit.kv.dtype,
            tuple(hit.kv.shape),
            self.dtype,
            shape,
        )
        self.store.discard(key)
        return None

    def _get_or_prefill(
        self, prefix: ChunkReader | None, prefix_ids: Sequence[int], ids: Sequence[int], *, lazy: bool
    ) -> tuple[ChunkReader, str | None]:
        """-> (KV, the name of the store tier it came from, or None if it was prefilled now)

        With `lazy` (pipelined loading), a chunk found on disk or in Redis comes back unread: its layers are
        fetched while the fusor runs. Without it, the chunk is read whole now, and one that turns out damaged
        is recomputed here (its tier has dropped it and counted a miss).
        """
        key = self._key(prefix_ids, ids)
        hit = self._lookup(key, len(ids))
        if hit is not None:
            if lazy:
                return hit.kv, hit.tier
            try:
                return hit.kv.materialize(), hit.tier
            except CorruptEntryError as exc:
                logger.warning("chunk %s from the %s tier is damaged (%s); recomputing it", key[:12], hit.tier, exc)
        kv = self._prefill_kv(prefix, prefix_ids, ids)
        self.store.put(kv)
        return kv, None

    def _prefix_kv(self, prefix_ids: Sequence[int]) -> ChunkReader | None:
        """The shared prefix's KV, read whole (it is short, and a prefill after it needs every layer at once)."""
        if not prefix_ids:
            return None
        return self._get_or_prefill(None, (), prefix_ids, lazy=False)[0]

    def precompute(
        self,
        chunks: Sequence[str],
        question: str | None = None,
        *,
        template: PromptTemplate | None = None,
        prefix: str | None = None,
        show_progress: bool = False,
    ) -> tuple[int, int]:
        """Make sure every chunk's KV is in the store, for the template's prefix or an explicit prefix.

        The template's prefix does not depend on the question, so `question` is only needed by templates
        that place it before the chunks. Returns (already cached, newly computed).
        """
        check_encodable(chunks, question=question, prefix=prefix)
        if prefix is None:
            prefix, _ = (template or self.template).render(self.tokenizer, question or "?")
        prefix_ids = tokenize_prefix(self.tokenizer, prefix)
        chunk_ids = tokenize_chunks(self.tokenizer, chunks, self.config.chunk_separator)
        hits = misses = 0
        with self._lock:
            prefix_kv = self._prefix_kv(prefix_ids)
            for ids in tqdm(chunk_ids, desc="precomputing chunk KV", unit="chunk", disable=not show_progress):
                _, tier = self._get_or_prefill(prefix_kv, prefix_ids, ids, lazy=True)
                hits, misses = hits + (tier is not None), misses + (tier is None)
        return hits, misses

    def clear_store(self, tiers: Sequence[str] | None = None) -> None:
        """Drop the stored chunk KV: every tier, or only the named ones (`["memory"]` frees this process's
        memory and keeps disk and Redis, which other workers may share). Waits for a request in flight to
        finish first; the next request recomputes whatever it no longer finds.
        """
        with self._lock:
            if tiers is None:
                self.store.clear()
            elif isinstance(self.store, TieredStore):
                self.store.clear(tiers)
            elif list(tiers) == [self.store.name]:
                self.store.clear()
            else:
                raise ConfigError(
                    f"this engine's store is the single tier {self.store.name!r}, not {list(tiers)}; call "
                    f"clear_store() without `tiers`"
                )

    # -- prefill --------------------------------------------------------------------------------------------

    def _cache_from(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> DynamicCache:
        """A transformers DynamicCache holding rotated keys and values ([Hkv, N, D] per layer)."""
        cache = DynamicCache(config=self.model.config)
        for layer_idx, (k, v) in enumerate(zip(keys, values, strict=True)):
            cache.update(k.unsqueeze(0), v.unsqueeze(0), layer_idx)
        return cache

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, start: int, cache: DynamicCache) -> torch.Tensor:
        """The model's own forward of `ids` ([T]) at positions start.., extending `cache`; -> last logits."""
        positions = torch.arange(start, start + ids.shape[0], device=self.device).unsqueeze(0)
        out = self.model(
            input_ids=ids.to(self.device).unsqueeze(0),
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1].float()

    def prefill(
        self,
        prompt: TokenizedPrompt,
        mode: PrefillMode | str = PrefillMode.BLEND,
        *,
        recompute_ratio: float | None = None,
        blend: BlendConfig | None = None,
    ) -> Prefill:
        """Build the prompt's KV cache in the given mode. Times exclude tokenization (see `generate`)."""
        mode = PrefillMode.parse(mode)
        if mode is not PrefillMode.BLEND and recompute_ratio is not None:
            raise ConfigError(f"recompute_ratio applies to mode 'blend' only, got mode {mode.value!r}")
        pinned = recompute_ratio if recompute_ratio is not None else blend
        blend = blend or self.config.blend
        if recompute_ratio is not None:
            blend = blend.with_ratio(recompute_ratio)
        if blend.check_layers[-1] >= self.lm.shape.num_layers:
            raise ConfigError(f"check layer {blend.check_layers[-1]} >= the model's {self.lm.shape.num_layers} layers")
        self._check_length(prompt)
        # The controller may choose the ratio only when neither a ratio nor a whole blend config was given.
        auto_ratio = mode is PrefillMode.BLEND and self.controller is not None and pinned is None
        with self._lock:
            # A chunk read layer by layer can turn out damaged after the fusor has started; its tier has dropped
            # it by then, so trying again finds it in another tier or recomputes it. Each retry follows the
            # removal of one entry, so this ends.
            fresh: set[str] = set()  # chunks prefilled during this request: misses, even when found on a retry
            for attempt in range(len(prompt.chunk_ids) + 2):
                try:
                    return self._prefill_locked(prompt, mode, blend, fresh, auto_ratio)
                except CorruptEntryError as exc:
                    logger.warning("prefill attempt %d read a damaged chunk (%s); trying again", attempt + 1, exc)
            return self._prefill_locked(prompt, mode, blend, fresh, auto_ratio)

    def _prefill_locked(
        self, prompt: TokenizedPrompt, mode: PrefillMode, blend: BlendConfig, fresh: set[str], auto_ratio: bool
    ) -> Prefill:
        n = prompt.num_tokens
        num_layers = self.lm.shape.num_layers
        m = RequestMetrics(mode=mode.value, prompt_tokens=n)
        input_ids = prompt.input_ids()
        t0 = time.perf_counter()

        if mode is PrefillMode.FULL or not prompt.chunk_ids:
            # Without chunks there is nothing to reuse or blend: every mode is a full prefill.
            m.mode = PrefillMode.FULL.value
            cache = DynamicCache(config=self.model.config)
            logits = self._forward(input_ids, 0, cache)
            m.compute_s = time.perf_counter() - t0
            m.recomputed_tokens = n
            m.recomputed_per_layer = [n] * num_layers
            m.compute_share = 1.0
            return Prefill(cache, logits, n, m)

        # Which chunks this mode reads from the cache: prefix caching can reuse only the first one.
        n_chunks = 1 if mode is PrefillMode.PREFIX else len(prompt.chunk_ids)
        prefix_kv = self._prefix_kv(prompt.prefix_ids)
        parts: list[ChunkReader] = [prefix_kv] if prefix_kv is not None else []
        bytes_by_tier: dict[str, int] = {}
        seen: set[str] = set()  # a chunk repeated in one prompt is prefilled once: one miss, then hits
        for ids in prompt.chunk_ids[:n_chunks]:
            t = time.perf_counter()
            kv, tier = self._get_or_prefill(prefix_kv, prompt.prefix_ids, ids, lazy=self.config.pipelined_loading)
            if tier is None:
                fresh.add(kv.key)
            repeat = kv.key in seen
            seen.add(kv.key)
            if tier is not None and (repeat or kv.key not in fresh):
                m.chunks_hit += 1
                m.hits_by_tier[tier] = m.hits_by_tier.get(tier, 0) + 1
                m.bytes_loaded += kv.nbytes
                bytes_by_tier[tier] = bytes_by_tier.get(tier, 0) + kv.nbytes
            else:
                m.chunks_missed += 1
                m.precompute_s += time.perf_counter() - t
            parts.append(kv)
        if prefix_kv is not None:
            m.bytes_loaded += prefix_kv.nbytes
        m.reused_tokens = sum(len(ids) for ids in prompt.chunk_ids[:n_chunks])
        t_found = time.perf_counter()
        m.load_s = t_found - t0 - m.precompute_s  # store lookups

        if mode is PrefillMode.BLEND:
            if auto_ratio:
                assert self.controller is not None
                decision = self.controller.choose_ratio(n, bytes_by_tier, m.hits_by_tier)
                blend = blend.with_ratio(decision.ratio)
                m.controller = decision.to_dict()
            blend_cfg = blend
            m.recompute_ratio = blend.recompute_ratio
        else:
            # prefix / reuse: every token with loaded KV is used as is: no checks, nothing reused-but-recomputed
            blend_cfg = None
        result, load_s, wait_s = self._fuse(prompt, parts, blend_cfg)
        assert result.logits is not None
        cache = self._cache_from(result.keys, result.values)
        m.recomputed_per_layer = result.recomputed_per_layer
        m.recomputed_tokens = int(result.selected_positions.numel())
        m.load_s += load_s
        m.wait_s = wait_s
        m.pipelined = self.config.pipelined_loading
        m.compute_s = time.perf_counter() - t_found - wait_s
        m.compute_share = sum(m.recomputed_per_layer) / (n * num_layers)
        return Prefill(cache, result.logits, n, m)

    def _fuse(self, prompt: TokenizedPrompt, parts: Sequence[ChunkKV | LazyChunkKV], blend: BlendConfig | None):
        """Run the fusor with the loaded `parts` (the prefix, then chunks in order) at the head of the prompt.

        With a blend config, chunk tokens are recomputed as its rule chooses (`planning.blend_plan`); without
        one, every loaded token is used as is (prefix caching when `parts` stop after the first chunk, full KV
        reuse when they cover all). The "attention" rule first runs a reuse pass that records how much the
        question attends to each chunk token, then recomputes the chosen tokens over that pass's KV.
        Returns the result, the time spent loading KV (reading, checking, assembling) and the part of it the
        fusor waited for (all of it without pipelining; with it, only what compute did not hide).
        """
        n_loaded = len(parts) - (1 if prompt.prefix_ids else 0)
        load = self._layer_loader(parts, prompt.num_tokens)
        if blend is None:
            return self._run_fusor(reuse_plan(prompt, n_loaded), load)
        if blend.selection != "attention":
            return self._run_fusor(blend_plan(prompt, blend), load)
        question = torch.zeros(prompt.num_tokens, dtype=torch.bool)
        question[prompt.num_tokens - len(prompt.suffix_ids) :] = True
        probe, load_s, wait_s = self._run_fusor(
            reuse_plan(prompt), load, want_logits=False, keep_raw_keys=True, attention_from=question
        )
        assert probe.raw_keys is not None and probe.attention is not None
        raw_keys, values = probe.raw_keys, probe.values
        result, _, _ = self._run_fusor(blend_plan(prompt, blend, probe.attention), lambda i: (raw_keys[i], values[i]))
        # The probe's question-only pass is part of this rule's compute.
        result.recomputed_per_layer = [a + b for a, b in zip(result.recomputed_per_layer, probe.recomputed_per_layer)]
        return result, load_s, wait_s

    def _run_fusor(self, plan: FusionPlan, load: Callable[[int], tuple[torch.Tensor, torch.Tensor]], **kwargs: Any):
        """-> (fusion result, load time, time the fusor waited for loads)"""
        if self.config.pipelined_loading:
            with LayerPrefetcher(load, self.lm.shape.num_layers, self.device) as prefetcher:
                result = fuse(self.lm, plan, prefetcher.get, **kwargs)
            return result, prefetcher.load_s, prefetcher.wait_s

        load_time = 0.0

        def timed_load(layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal load_time
            t = time.perf_counter()
            out = load(layer_idx)
            load_time += time.perf_counter() - t
            return out

        result = fuse(self.lm, plan, timed_load, **kwargs)
        return result, load_time, load_time

    @torch.inference_mode()
    def extend(self, prefill: Prefill, token_ids: Sequence[int]) -> torch.Tensor:
        """Feed tokens after a prefilled prompt in one forward (teacher forcing); -> logits [T, vocab] float32.

        Row t is the next-token distribution after `token_ids[t]`, so `prefill.logits` followed by rows 0..T-2
        score a continuation of T tokens. The prefill's cache grows by these tokens and `num_tokens` with it.
        """
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        if ids.ndim != 1 or ids.numel() == 0:
            raise ConfigError("extend needs a non-empty list of token ids")
        positions = torch.arange(prefill.num_tokens, prefill.num_tokens + ids.numel(), device=self.device)
        with self._lock:
            out = self.model(
                input_ids=ids.to(self.device).unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                past_key_values=prefill.cache,
                use_cache=True,
            )
        prefill.num_tokens += ids.numel()
        return out.logits[0].float()

    # -- generation -----------------------------------------------------------------------------------------

    def generate(
        self,
        chunks: Sequence[str] | TokenizedPrompt,
        question: str | None = None,
        *,
        mode: PrefillMode | str = PrefillMode.BLEND,
        recompute_ratio: float | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] | str | None = (),
        seed: int | None = None,
        template: PromptTemplate | None = None,
        prefix: str | None = None,
        suffix: str | None = None,
    ) -> GenerationResult:
        """Answer a question over chunks (or a prebuilt prompt) and return the text with the request's metrics."""
        stream = self.stream(
            chunks, question, mode=mode, recompute_ratio=recompute_ratio, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, seed=seed, template=template,
            prefix=prefix, suffix=suffix,
        )  # fmt: skip
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(
        self,
        chunks: Sequence[str] | TokenizedPrompt,
        question: str | None = None,
        *,
        mode: PrefillMode | str = PrefillMode.BLEND,
        recompute_ratio: float | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] | str | None = (),
        seed: int | None = None,
        template: PromptTemplate | None = None,
        prefix: str | None = None,
        suffix: str | None = None,
    ) -> TextStream:
        """Like `generate`, but yields text as it is produced. Arguments are checked before the first token."""
        t0 = time.perf_counter()
        # Every argument is checked here, before any compute: `stop=None` means no stop strings.
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k, stop, seed)
        check_ratio_arg(recompute_ratio)
        if isinstance(chunks, TokenizedPrompt):
            prompt = chunks
        else:
            check_encodable(chunks, question=question, prefix=prefix, suffix=suffix)
            prompt = self.build_prompt(chunks, question, template=template, prefix=prefix, suffix=suffix)
        self._check_length(prompt, params.max_new_tokens)
        mode = PrefillMode.parse(mode)
        if mode is not PrefillMode.BLEND and recompute_ratio is not None:
            raise ConfigError(f"recompute_ratio applies to mode 'blend' only, got mode {mode.value!r}")
        if recompute_ratio is not None:
            self.config.blend.with_ratio(recompute_ratio)  # validate now, not at the first next()
        return TextStream(self._events(prompt, mode, recompute_ratio, params, t0))

    def _events(
        self,
        prompt: TokenizedPrompt,
        mode: PrefillMode,
        recompute_ratio: float | None,
        params: SamplingParams,
        t0: float,
    ) -> Iterator[str | GenerationResult]:
        # The lock is taken per forward, never across a yield: a consumer may pause, or resume from another thread.
        pre = self.prefill(prompt, mode, recompute_ratio=recompute_ratio)
        m = pre.metrics
        picker = TokenPicker(params, self.device)
        text = TextAssembler(self.tokenizer, params.stop)
        generated: list[int] = []
        token = picker(pre.logits, generated)
        m.ttft_s = time.perf_counter() - t0
        t_decode = time.perf_counter()
        finish = "length"
        pos = pre.num_tokens
        while True:
            if token in self.eos_ids:
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
            with self._lock:
                logits = self._forward(torch.tensor([token]), pos, pre.cache)
            pos += 1
            token = picker(logits, generated)
        yield text.flush()
        m.decode_s = time.perf_counter() - t_decode
        m.generated_tokens = len(generated)
        yield GenerationResult(text.text, generated, finish, replace(m))
