"""The engine: one model, one chunk store, and the four ways to prefill a prompt made of chunks.

`CacheBlendEngine` is a facade over parts it builds once and holds, each a plain object that calls the ones below it
and never back up (docs/map.md draws them): `chunks` (`chunks/`: each chunk's stored entry, found or prefilled),
`prefiller` (`prefill/`: a request's prefill), `fills` (chunks stored after cold answers), `scheduler` (`serving/`:
one queue, its job steps, batched decode steps) and `corpus` (`corpus/`: precompute). The call path: `generate`
checks a `Request` and tokenizes its prompt once -> `scheduler.stream` -> (a turn) -> `JobSteps.start` ->
`Prefiller.run` -> `fusion.fuse`. One forward runs at a time (a lock): on a CPU parallel forwards only contend;
concurrency comes from batching decode steps.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from typing_extensions import Unpack

from ..config import BlendConfig, EngineConfig, PrefillMode, resolve_device, torch_dtype
from ..cpu import warn_if_slow_bf16
from ..errors import EngineClosedError
from ..fusion import GraphedLayerSteps
from ..models.adapter import LayerwiseModel
from ..models.attention import use_blocked_attention
from ..models.fingerprint import fingerprints_by_dtype, model_fingerprint
from ..models.fused import fuse_qkv
from ..models.int8 import int8_decode_lm
from ..models.packed import pack_linears, packing_available
from ..models.support import check_supported, max_blend_length
from ..store import ChunkStore, build_store
from .chunks.cache import ChunkCache
from .chunks.calibrate import store_options
from .chunks.context import ContextArg
from .chunks.placement import Placement
from .corpus.groups import PrecomputePlan
from .corpus.precompute import AUTO, Corpus, Precomputed
from .prefill.planning import RatioPolicy, check_blend
from .prefill.prefiller import Prefill, Prefiller
from .request.prompt import PromptTemplate, TokenizedPrompt, tokenize_request
from .request.request import Request, RequestOptions, calling, check_length, check_prompt_parts
from .request.token_cache import TokenCache
from .serving.batch_decode import BatchDecoder
from .serving.decoding import AsyncTextStream, GenerationResult, TextStream, TokenLoop
from .serving.deferred_fills import DeferredFills, FillStats
from .serving.forking import ForkSteps, prepare_for_forks
from .serving.graphs import GraphedSteps
from .serving.scheduler import Scheduler
from .serving.thread_pools import releasing_thread_pool
from .serving.tokens import eos_token_ids

logger = logging.getLogger(__name__)
Chunks = Sequence[str] | TokenizedPrompt  # a request's chunks (their texts), or its prompt built already


class CacheBlendEngine:
    """One model, one chunk store, and the four ways to prefill a prompt made of chunks.

    `controller`: a ratio policy (e.g. `LoadingController`) that picks the blend ratio per request from the
    time its chunks take to load (paper §5.1), whenever the caller does not pin a ratio or a blend config.
    """

    @releasing_thread_pool  # loading and quantizing ran here; requests may be served on another thread
    def __init__(
        self, model: torch.nn.Module, tokenizer: Any, *, config: EngineConfig | None = None,
        store: ChunkStore | None = None, template: PromptTemplate | None = None, controller: RatioPolicy | None = None,
    ) -> None:  # fmt: skip
        check_supported(model.config)  # a family the adapter cannot read is refused before anything touches it
        self.config = config or EngineConfig()
        device, dtype = torch.device(resolve_device(self.config.device)), torch_dtype(self.config.dtype)
        if getattr(model, "dtype", None) != dtype:  # converted here (`load_model` warns for the models it loads)
            warn_if_slow_bf16(device, dtype)
        in_other_dtypes = fingerprints_by_dtype(model, dtype)  # before the cast, which may lose the model's values
        self.model = model.to(device=device, dtype=dtype).eval()
        self.tokenizer = tokenizer
        self.token_cache = TokenCache(tokenizer)  # chunk texts -> ids: a chunk retrieved again is not tokenized again
        fused = fuse_qkv(self.model)  # q/k/v in one product; bf16 on a CPU: weights packed once for oneDNN
        if packing_available(device, dtype):  # and attention as bf16 products over blocks of queries
            fused = pack_linears(self.model, fused)
            use_blocked_attention(self.model)
        self.lm = LayerwiseModel(self.model, fused_qkv=fused)
        # int8 decode weights and CUDA graphs are written for Llama's layer: other families run the exact path
        fast = self.lm.spec.llama_like
        serving = self.config.serving
        asked = serving.decode_weights == "int8" or self.config.prefill_graphs or serving.decode_graphs
        if asked and not fast:
            logger.info("%s: int8 decode weights and CUDA graphs cover Llama-like layers only; using the exact path",
                        self.lm.spec.family)  # fmt: skip
        self.device, self.dtype = device, dtype
        check_blend(self.config.blend, self.lm.shape.num_layers, "blend.check_layers")
        self.template = template or PromptTemplate()
        self.fingerprint = model_fingerprint(self.model)
        if store is None:  # the configured tiers, with a codec fitted to this model where one is named ("pca")
            store = build_store(**store_options(self.config.store, self.lm, tokenizer, self.template, self.fingerprint,
                                                self.dtype))  # fmt: skip
        self.controller = controller
        if controller is not None:
            controller.check_model(self.fingerprint, self.config.dtype)
        self.eos_ids = eos_token_ids(self.model, tokenizer)
        limits = [self.lm.shape.max_positions, self.config.max_prompt_tokens, max_blend_length(self.model.config)]
        self.max_tokens = min(x for x in limits if x is not None)
        self.chunks = ChunkCache(self.lm, store, self.fingerprint, self.dtype, self.config.capture_policy,
                                 fingerprint_in=in_other_dtypes)  # fmt: skip
        self._lock = threading.RLock()
        # the chunks cold requests were answered without, stored after their answers (by the scheduler while it serves)
        self.fills = DeferredFills(self.chunks.store_or_fill, self._lock)
        steps = GraphedLayerSteps(self.lm) if self.config.prefill_graphs and fast else None
        self.prefiller = Prefiller(self.model, self.lm, self.chunks, self.fills, self._lock, blend=self.config.blend,
                                   controller=controller, miss_policy=self.config.miss_policy, guard=self.config.guard,
                                   steps=steps)  # fmt: skip
        # decode steps run on the model itself, or on int8 copies of its linear layers (`serving.decode_weights`)
        decoder = BatchDecoder(int8_decode_lm(self.model) if serving.decode_weights == "int8" and fast else self.lm)
        loops = functools.partial(TokenLoop, tokenizer, self.eos_ids, device=device)  # a request's token loop
        graphs = GraphedSteps(self.lm) if serving.decode_graphs and fast else None
        self.scheduler = Scheduler(self.prefiller, self.fills, decoder, loops, self._lock, serving, graphs)
        # a process that forks with this engine: the child serves too, with workers of its own (`forking`)
        workers = (self.scheduler, self.fills, self.token_cache)
        self._forks = ForkSteps(self._lock, workers, lambda: self.chunks.store, device.type == "cuda")
        prepare_for_forks(self._forks)
        self.corpus = Corpus(tokenizer, self.template, self.config, self.chunks, self.prefiller, self.token_cache,
                             self._lock, self._forks, self.max_tokens)  # fmt: skip
        self._closed = False  # set by `close`: the public methods then raise EngineClosedError

    @classmethod
    def from_pretrained(
        cls, name_or_path: str | None = None, *, config: EngineConfig | None = None, store: ChunkStore | None = None,
        template: PromptTemplate | None = None, controller: RatioPolicy | None = None, cache_dir: str | None = None,
        revision: str | None = None, local_files_only: bool = False, show_progress: bool = True,
    ) -> CacheBlendEngine:  # fmt: skip
        """Load a preset (default: the default preset), a local folder or a Hugging Face hub id of a
        model of a supported family (`models.support`; see `load_model` for `cache_dir`, `revision`,
        `local_files_only`)."""
        from ..models import default_model, load_model

        config = config or EngineConfig()
        model, tokenizer = load_model(name_or_path or default_model(), device=config.device, dtype=config.dtype,
                                      cache_dir=cache_dir, revision=revision, local_files_only=local_files_only,
                                      show_progress=show_progress)  # fmt: skip
        return cls(model, tokenizer, config=config, store=store, template=template, controller=controller)

    @property
    def store(self) -> ChunkStore:
        """The chunk store (a tier or a stack of tiers)."""
        return self.chunks.store

    @store.setter
    def store(self, store: ChunkStore) -> None:
        """Serve later requests from another store (after the request in flight, if any)."""
        self._check_open("store")
        with self._lock:
            self.chunks.store = store

    # -- answering: a request checked and tokenized once, then the scheduler's -----------------------------------
    def generate(
        self, chunks: Chunks, question: str | None = None, **options: Unpack[RequestOptions]
    ) -> GenerationResult:
        """Answer a question over chunks (or a prebuilt prompt) and return the text with the request's metrics.

        Takes the keyword arguments of `stream`, and collects its stream.
        """
        prompt, request = self._request("generate", chunks, question, options)
        return self.scheduler.stream(prompt, request).collect()

    def stream(self, chunks: Chunks, question: str | None = None, **options: Unpack[RequestOptions]) -> TextStream:
        """Yield the answer's text as it is produced; `.result` holds the `GenerationResult` at the end.

        Keyword arguments: `RequestOptions` (all optional): the prefill `mode`, `recompute_ratio` or another
        `blend` rule; decoding (`max_new_tokens`, greedy at `temperature` 0, else `top_p` / `top_k` / `seed`;
        `stop` strings); the prompt: chunks + question (rendered by `template`), chunks + explicit `prefix` /
        `suffix`, or a prebuilt `TokenizedPrompt` in place of the chunks. Every argument is checked here, before
        any compute.
        """
        prompt, request = self._request("stream", chunks, question, options)
        return self.scheduler.stream(prompt, request)

    async def agenerate(
        self, chunks: Chunks, question: str | None = None, **options: Unpack[RequestOptions]
    ) -> GenerationResult:
        """`generate` for asyncio: awaits the answer without holding a thread; concurrent calls decode together."""
        prompt, request = self._request("agenerate", chunks, question, options)
        return await self.scheduler.astream(prompt, request).collect()

    def astream(
        self, chunks: Chunks, question: str | None = None, **options: Unpack[RequestOptions]
    ) -> AsyncTextStream:
        """`stream` for asyncio (`async for delta in engine.astream(...)`); call it inside a running event loop."""
        prompt, request = self._request("astream", chunks, question, options)
        return self.scheduler.astream(prompt, request)

    def _request(
        self, method: str, chunks: Chunks, question: str | None, options: Mapping[str, Any]
    ) -> tuple[TokenizedPrompt, Request]:
        """The checked request of one `generate` / `stream` call and its tokenized prompt."""
        self._check_open(method)
        request = Request.from_options(method, options)
        prompt = check_prompt_parts(method, chunks, question, request)
        if prompt is None:
            with calling(method):
                prompt = self.build_prompt(chunks, question, template=request.template, prefix=request.prefix,
                                           suffix=request.suffix)  # fmt: skip
        self._check_request(prompt, request, method)
        return prompt, request

    # -- a corpus: `corpus` (`corpus/precompute.py`) says how ---------------------------------------------------
    def precompute(
        self, chunks: Sequence[str], question: str | None = None, *, template: PromptTemplate | None = None,
        prefix: str | None = None, context: ContextArg = AUTO, show_progress: bool = False,
        group_tokens: int | None = None, on_plan: Callable[[PrecomputePlan], object] | None = None,
    ) -> Precomputed:  # fmt: skip
        """Make sure every chunk's KV is in the store before requests need it: in groups of similar chunks under the
        default `chunk_context="grouped"`, else alone, or after the texts given per chunk (`Corpus.precompute`
        describes `context`, `group_tokens`, `on_plan`). Returns (chunks stored already, chunks computed now)."""
        self._check_open("precompute")
        return self.corpus.precompute(chunks, question, template=template, prefix=prefix, context=context,
                                      show_progress=show_progress, group_tokens=group_tokens,
                                      on_plan=on_plan)  # fmt: skip

    def precompute_groups(
        self, groups: Sequence[Sequence[str]], question: str | None = None, *, template: PromptTemplate | None = None,
        prefix: str | None = None, show_progress: bool = False,
    ) -> Precomputed:  # fmt: skip
        """`precompute(context="groups")` with the groups given (each a list of chunks in prefill order; a chunk in
        one group only; `Corpus.precompute_groups`). Returns (chunks stored already, computed now)."""
        self._check_open("precompute_groups")
        return self.corpus.precompute_groups(groups, question, template=template, prefix=prefix,
                                             show_progress=show_progress)  # fmt: skip

    def set_chunk_context(
        self, chunks: Sequence[str], context: ContextArg, *, question: str | None = None,
        template: PromptTemplate | None = None, prefix: str | None = None,
    ) -> int:  # fmt: skip
        """Record what each chunk's KV is prefilled after, computing none: the texts given per chunk, or nothing
        (None: isolated entries; `Corpus.set_chunk_context`). Returns how many chunks have a context."""
        self._check_open("set_chunk_context")
        return self.corpus.set_chunk_context(chunks, context, question=question, template=template, prefix=prefix)

    # -- prompts and chunk KV; prefill -------------------------------------------------------------------------
    def build_prompt(
        self, chunks: Sequence[str], question: str | None = None, *, template: PromptTemplate | None = None,
        prefix: str | None = None, suffix: str | None = None,
    ) -> TokenizedPrompt:  # fmt: skip
        """Tokenize a request. Either a question (rendered with the template) or an explicit prefix/suffix."""
        self._check_open("build_prompt")
        return tokenize_request(self.tokenizer, template or self.template, chunks, question, prefix, suffix,
                                self.config.chunk_separator, self.token_cache)  # fmt: skip

    def check_length(self, prompt: TokenizedPrompt, max_new_tokens: int = 0) -> None:
        """PromptError when the prompt and its answer budget do not fit the model's context."""
        self._check_open("check_length")
        check_length(prompt, max_new_tokens, self.max_tokens)

    def chunk_key(
        self, prefix_ids: Sequence[int], chunk_ids: Sequence[int], *, captured: bool = False,
        copies: Sequence[Sequence[int]] = (),
    ) -> str:  # fmt: skip
        """The store key of a chunk's KV when it follows `prefix_ids` (model fingerprint, dtype, tokens, context);
        with `captured`, of its captured entry (a full prefill's, read unless chunk_context="isolated"), cached after
        the near copies of it `copies` (token ids of overlapping windows of its text; none: the plain captured
        entry)."""
        self._check_open("chunk_key")
        return self.chunks.key(prefix_ids, chunk_ids, captured=captured, copies=copies)

    def placements(self, prompt: TokenizedPrompt) -> tuple[Placement, ...]:
        """Which stored entry each chunk of the prompt reads now, and which a miss or a full prefill stores: the plan
        a request makes before reading any KV (`engine.chunks.placement`)."""
        self._check_open("placements")
        return self.chunks.place(prompt.prefix_ids, prompt.chunk_ids)

    def prompt_keys(self, prompt: TokenizedPrompt, *, with_prefix: bool = True) -> list[str]:
        """The store keys this engine reads a prompt's KV from now: the prefix's (if any, and `with_prefix`), then
        the entry each chunk's plan finds, or the one a miss stores (`placements`)."""
        self._check_open("prompt_keys")
        return self.chunks.prompt_keys(prompt.prefix_ids, prompt.chunk_ids, with_prefix=with_prefix)

    def clear_store(self, tiers: Sequence[str] | None = None) -> None:
        """Drop the stored chunk KV: every tier, or only the named ones (`["memory"]` frees this process's memory and
        keeps disk and Redis, which other workers may share), once the request in flight and the chunks being stored
        after cold requests are done; the next request recomputes whatever it no longer finds."""
        self._check_open("clear_store")
        self.fills.wait()
        with self._lock:
            self.chunks.clear(tiers)

    def prefill(
        self, prompt: TokenizedPrompt, mode: PrefillMode | str = PrefillMode.BLEND, *,
        recompute_ratio: float | None = None, blend: BlendConfig | None = None,
    ) -> Prefill:  # fmt: skip
        """Build the prompt's KV cache in the given mode. Times exclude tokenization (see `generate`).

        `blend` replaces the engine's `BlendConfig` for this request (another rule); `recompute_ratio` changes
        only its ratio. The controller, if any, chooses the ratio only when neither is given.
        """
        request = Request(mode=mode, recompute_ratio=recompute_ratio, blend=blend)
        self._check_request(prompt, request, "prefill")
        pre = self.prefiller.run(prompt, request)
        # the chunks a cold prefill answered without are stored now, so the next request finds them (`generate` and
        # `stream` leave that to the background: `wait_for_fills`)
        self.fills.submit(prompt.prefix_ids, pre.deferred)
        self.fills.wait_for(prompt.chunk_ids)
        return pre

    @property
    def fill_stats(self) -> FillStats:
        """What storing the chunks cold requests skipped has done so far: chunks prefilled and stored, entries stored
        from full prefills, failures, the seconds it took, and what is still queued (see `wait_for_fills`)."""
        return self.fills.stats

    def wait_for_fills(self, timeout: float | None = None) -> bool:
        """Wait until the chunks that cold requests were answered without are stored (they are stored on a
        background thread after the call returns; a request that needs one waits for it by itself). -> False
        if `timeout` seconds ran out first. After `close` it returns True at once: what was queued was dropped."""
        return self.fills.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Stop serving: requests not answered yet end with EngineClosedError, and the chunks still queued to be
        stored are dropped (`wait_for_fills()` first keeps them); then the store is closed (its files and
        connections released: a store shared with another engine is closed for it too). From then on every public
        method but `wait_for_fills` raises EngineClosedError; a second `close` does nothing. At exit, the serving
        threads stop by themselves (`shutdown`); the store is left as it is."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.scheduler.stop(timeout)
        self.fills.stop(timeout)
        with self._lock:  # after a prefill in flight
            self.chunks.store.close()

    def _check_open(self, method: str) -> None:
        """EngineClosedError, naming `method`, once `close` has run."""
        if self._closed:
            raise EngineClosedError(f"{method}: the engine is closed (engine.close() ran): no new request runs, "
                                    "nothing more is computed or stored; build a new engine to go on")  # fmt: skip

    def _check_request(self, prompt: TokenizedPrompt, request: Request, method: str) -> None:
        """What a request needs of this engine: a process it can run in, a rule this model has the layers for, a
        prompt that fits."""
        self._check_open(method)
        self._forks.check()
        with calling(method):
            check_blend(request.blend or self.config.blend, self.lm.shape.num_layers, "blend")
            self.check_length(prompt, request.sampling.max_new_tokens if method != "prefill" else 0)

    def extend(self, prefill: Prefill, token_ids: Sequence[int]) -> torch.Tensor:
        """Feed tokens after a prefilled prompt in one forward (teacher forcing); -> logits [T, vocab] float32.

        Row t is the next-token distribution after `token_ids[t]`, so `prefill.logits` followed by rows 0..T-2
        score a continuation of T tokens. The prefill's cache grows by these tokens and `num_tokens` with it.
        """
        self._check_open("extend")
        self._forks.check()
        return self.prefiller.extend(prefill, token_ids)
