"""The engine: one model, one chunk store, and the four ways to prefill a prompt made of chunks.

It composes the rooms beside it:
- `request/`: a request's checked arguments, its tokenized prompt, its metrics, the hook between a prefill's layers;
- `chunks/`: which stored entry each chunk of a prompt reads (`placement`), found or prefilled (`cache`), and the
  entries a full prefill computes for free (`capture`);
- `prefill/`: the four prefill modes over the KV gathered for them, planned by pure functions (`planning`);
- `serving/`: the answering methods (`generation`), one queue for every request, decode steps batched across
  requests, the token loop and streams, and the chunks cold requests skipped, stored after their answers
  (`deferred_fills`);
- `corpus/`: a corpus's chunk KV ahead of requests (`precompute`, grouped or alone).
The call path: `generate` (`serving.generation`) -> `scheduler.stream` -> (a turn of the scheduler) ->
`run_prefill` -> `Prefiller.run` -> `fusion.fuse`. One forward runs at a time (a lock): the model's modules are
shared, and on a CPU parallel forwards only contend; concurrency comes from batching decode steps, not from
parallel forwards.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ..config import BlendConfig, EngineConfig, PrefillMode, resolve_device, torch_dtype
from ..cpu import warn_if_slow_bf16
from ..errors import ConfigError, EngineClosedError
from ..fusion import GraphedLayerSteps
from ..models.adapter import LayerwiseModel
from ..models.fingerprint import fingerprints_by_dtype, model_fingerprint
from ..models.fused import fuse_qkv
from ..models.int8 import int8_decode_lm
from ..models.packed import pack_linears, packing_available
from ..models.support import check_supported, max_blend_length
from ..store import ChunkStore, TieredStore, build_store
from .chunks.cache import ChunkCache
from .chunks.placement import Placement
from .corpus.precompute import CorpusMethods
from .prefill.planning import RatioPolicy, check_blend
from .prefill.prefiller import Prefill, Prefiller
from .request.after_layer import AfterLayer
from .request.prompt import PromptTemplate, TokenizedPrompt, tokenize_request
from .request.request import Request, calling, check_length
from .request.token_cache import TokenCache
from .serving.batch_decode import BatchDecoder
from .serving.decoding import TokenLoop
from .serving.deferred_fills import DeferredFills, FillStats
from .serving.forking import ForkSteps, prepare_for_forks
from .serving.generation import GenerationMethods
from .serving.graphs import GraphedSteps
from .serving.scheduler import Scheduler
from .serving.thread_pools import releasing_thread_pool
from .serving.tokens import eos_token_ids

logger = logging.getLogger(__name__)


class CacheBlendEngine(CorpusMethods, GenerationMethods):
    """One model, one chunk store, and the four ways to prefill a prompt made of chunks.

    `controller`: a ratio policy (e.g. `LoadingController`) that picks the blend ratio per request from the
    time its chunks take to load (paper §5.1), whenever the caller does not pin a ratio or a blend config.
    """

    @releasing_thread_pool  # loading and quantizing ran here; requests may be served on another thread
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        config: EngineConfig | None = None,
        store: ChunkStore | None = None,
        template: PromptTemplate | None = None,
        controller: RatioPolicy | None = None,
    ) -> None:
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
        fused = pack_linears(self.model, fused) if packing_available(device, dtype) else fused
        self.lm = LayerwiseModel(self.model, fused_qkv=fused)
        # int8 decode weights and CUDA graphs are written for Llama's layer: other families run the exact path
        fast = self.lm.spec.llama_like
        asked = self.config.decode_weights == "int8" or self.config.prefill_graphs or self.config.decode_graphs
        if asked and not fast:
            logger.info("%s: int8 decode weights and CUDA graphs cover Llama-like layers only; using the exact path",
                        self.lm.spec.family)  # fmt: skip
        self.device, self.dtype = device, dtype
        check_blend(self.config.blend, self.lm.shape.num_layers, "blend.check_layers")
        store = store if store is not None else build_store(**self.config.store.build_options())
        self.template = template or PromptTemplate()
        self.fingerprint = model_fingerprint(self.model)
        self.controller = controller
        if controller is not None:
            controller.check_model(self.fingerprint, self.config.dtype)
        self.eos_ids = eos_token_ids(self.model, tokenizer)
        limits = [self.lm.shape.max_positions, self.config.max_prompt_tokens, max_blend_length(self.model.config)]
        self.max_tokens = min(x for x in limits if x is not None)
        self.chunks = ChunkCache(self.lm, store, self.fingerprint, self.dtype, self.config.capture_policy,
                                 fingerprint_in=in_other_dtypes)  # fmt: skip
        self.prefiller = Prefiller(
            self.model,
            self.lm,
            self.chunks,
            pipelined=True,
            miss_policy=self.config.miss_policy,
            guard=self.config.guard,
            steps=GraphedLayerSteps(self.lm) if self.config.prefill_graphs and fast else None,
        )
        self._lock = threading.RLock()
        # the chunks cold requests were answered without, stored after their answers (by the scheduler while it serves)
        self.fills = DeferredFills(self.chunks.store_or_fill, self._lock)
        self.scheduler = Scheduler(
            self,  # its steps: `run_prefill`, `token_loop` and `fills`
            # decode steps run on the model itself, or on int8 copies of its linear layers (`decode_weights`)
            BatchDecoder(int8_decode_lm(self.model) if self.config.decode_weights == "int8" and fast else self.lm),
            self._lock,
            max_batch=self.config.max_batch_size,
            max_tokens=self.config.max_batch_tokens,
            max_token_gap_s=self.config.max_token_gap_s,
            graphs=GraphedSteps(self.lm) if self.config.decode_graphs and fast else None,
        )
        # a process that forks with this engine: the child serves too, with workers of its own (`forking`)
        workers = (self.scheduler, self.fills, self.token_cache)
        self._forks = ForkSteps(self._lock, workers, lambda: self.chunks.store, device.type == "cuda")
        prepare_for_forks(self._forks)
        self._closed = False  # set by `close`: the public methods then raise EngineClosedError

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | None = None,
        *,
        config: EngineConfig | None = None,
        store: ChunkStore | None = None,
        template: PromptTemplate | None = None,
        controller: RatioPolicy | None = None,
        cache_dir: str | None = None,
        revision: str | None = None,
        local_files_only: bool = False,
        show_progress: bool = True,
    ) -> CacheBlendEngine:
        """Load a preset (default: the default preset), a local folder or a Hugging Face hub id of a
        model of a supported family (`models.support`; see `load_model` for `cache_dir`, `revision`,
        `local_files_only`)."""
        from ..models import default_model, load_model

        config = config or EngineConfig()
        model, tokenizer = load_model(
            name_or_path or default_model(),
            device=config.device,
            dtype=config.dtype,
            cache_dir=cache_dir,
            revision=revision,
            local_files_only=local_files_only,
            show_progress=show_progress,
        )
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

    # -- prompts and chunk KV ---------------------------------------------------------------------------------

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
        self._check_open("build_prompt")
        return tokenize_request(self.tokenizer, template or self.template, chunks, question, prefix, suffix,
                                self.config.chunk_separator, self.token_cache)  # fmt: skip

    def check_length(self, prompt: TokenizedPrompt, max_new_tokens: int = 0) -> None:
        """PromptError when the prompt and its answer budget do not fit the model's context."""
        self._check_open("check_length")
        check_length(prompt, max_new_tokens, self.max_tokens)

    def chunk_key(
        self,
        prefix_ids: Sequence[int],
        chunk_ids: Sequence[int],
        *,
        captured: bool = False,
        copies: Sequence[Sequence[int]] = (),
    ) -> str:
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

    # -- prefill ----------------------------------------------------------------------------------------------

    def prefill(
        self,
        prompt: TokenizedPrompt,
        mode: PrefillMode | str = PrefillMode.BLEND,
        *,
        recompute_ratio: float | None = None,
        blend: BlendConfig | None = None,
    ) -> Prefill:
        """Build the prompt's KV cache in the given mode. Times exclude tokenization (see `generate`).

        `blend` replaces the engine's `BlendConfig` for this request (another rule); `recompute_ratio` changes
        only its ratio. The controller, if any, chooses the ratio only when neither is given.
        """
        request = Request(mode=mode, recompute_ratio=recompute_ratio, blend=blend)
        self._check_request(prompt, request, "prefill")
        pre = self.run_prefill(prompt, request)
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
            raise EngineClosedError(
                f"{method}: the engine is closed (engine.close() ran): no new request runs, nothing more is "
                "computed or stored; build a new engine to go on"
            )

    def _check_request(self, prompt: TokenizedPrompt, request: Request, method: str) -> None:
        """What a request needs of this engine: a process it can run in, a rule this model has the layers for, a
        prompt that fits."""
        self._check_open(method)
        self._forks.check()
        with calling(method):
            check_blend(request.blend or self.config.blend, self.lm.shape.num_layers, "blend")
            self.check_length(prompt, request.sampling.max_new_tokens if method != "prefill" else 0)

    def run_prefill(
        self,
        prompt: TokenizedPrompt,
        request: Request,
        after_layer: AfterLayer | None = None,
        buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Prefill:
        """The prefill of a checked request, as the scheduler runs it: the ratio the request, the engine's blend or
        the controller gives; after any chunk of the prompt still being stored; under the engine's lock, with
        `after_layer` between its layers; a cached mode lays the prompt's KV in `buffers` when given (the request's
        decode slot). The entries a full prefill computed are queued to be stored at once."""
        self._check_open("run_prefill")
        mode = request.mode
        pinned = request.recompute_ratio is not None or request.blend is not None
        blend = request.blend or self.config.blend
        if request.recompute_ratio is not None:
            blend = blend.with_ratio(request.recompute_ratio)
        policy = self.controller if mode is PrefillMode.BLEND and not pinned else None
        self.fills.wait_for(prompt.chunk_ids)  # a chunk an earlier cold request is storing: wait, not recompute
        with self._lock:
            pre = self.prefiller.run_retrying(prompt, mode, blend, policy, self.store_tiers, after_layer, buffers)
        # entries a full prefill computed: stored at once on the fills' thread (no compute, only the store's writes)
        self.fills.submit(prompt.prefix_ids, pre.captured, pre.captured)
        pre.captured = {}  # the fills' thread holds them until stored
        return pre

    def token_loop(self, request: Request) -> TokenLoop:
        """A fresh token loop (sampling, stops, the answer's text) for a request's decoding."""
        self._check_open("token_loop")
        return TokenLoop(self.tokenizer, self.eos_ids, request.sampling, self.device)

    @property
    def store_tiers(self) -> int:
        """How many tiers the store has (1 for a single tier)."""
        store = self.chunks.store
        return len(store.tiers) if isinstance(store, TieredStore) else 1

    def extend(self, prefill: Prefill, token_ids: Sequence[int]) -> torch.Tensor:
        """Feed tokens after a prefilled prompt in one forward (teacher forcing); -> logits [T, vocab] float32.

        Row t is the next-token distribution after `token_ids[t]`, so `prefill.logits` followed by rows 0..T-2
        score a continuation of T tokens. The prefill's cache grows by these tokens and `num_tokens` with it.
        """
        self._check_open("extend")
        self._forks.check()
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        if ids.ndim != 1 or ids.numel() == 0:
            raise ConfigError("extend needs a non-empty list of token ids")
        with self._lock:
            logits = self.prefiller.forward(ids, prefill.num_tokens, prefill.cache, all_logits=True)
        prefill.num_tokens += ids.numel()
        return logits
