"""The engine: one model, one chunk store, and the four ways to prefill a prompt made of chunks.

It composes the parts, each in its own module:
- `prompt`: templates and tokenized prompts (prefix, chunks, suffix);
- `chunk_cache`: chunk KV by key, from the store or prefilled and stored;
- `planning`: which tokens a prefill recomputes (pure functions to a `FusionPlan`);
- `prefill`: the four prefill modes and the request's metrics;
- `decoding`: the token loop and streamed text.
One forward runs at a time (a lock): the model's modules are shared, and on a CPU parallel forwards only contend.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from ..config import BlendConfig, EngineConfig, PrefillMode, torch_dtype
from ..errors import ConfigError, PromptError
from ..models.adapter import LayerwiseModel
from ..models.fingerprint import model_fingerprint
from ..models.support import max_blend_length
from ..store import ChunkStore, CorruptEntryError, build_store
from .chunk_cache import ChunkCache
from .decoding import GenerationResult, TextStream, decode
from .generation import SamplingParams, check_encodable, check_ratio_arg, eos_token_ids
from .planning import check_blend, check_token_scores
from .prefill import Prefill, Prefiller, RatioPolicy
from .prompt import PromptTemplate, TokenizedPrompt, encode, tokenize_chunks, tokenize_parts, tokenize_prefix

if TYPE_CHECKING:
    from typing_extensions import Unpack

logger = logging.getLogger(__name__)


class RequestOptions(TypedDict, total=False):
    """The keyword arguments of `generate` and `stream` (see `stream` for each)."""

    mode: PrefillMode | str
    recompute_ratio: float | None
    blend: BlendConfig | None
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: Sequence[str] | str | None
    seed: int | None
    template: PromptTemplate | None
    prefix: str | None
    suffix: str | None


class CacheBlendEngine:
    """One model, one chunk store, and the four ways to prefill a prompt made of chunks.

    `controller`: a ratio policy (e.g. `LoadingController`) that picks the blend ratio per request from the
    time its chunks take to load (paper §5.1), whenever the caller does not pin a ratio or a blend config.
    """

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
        self.config = config or EngineConfig()
        device, dtype = torch.device(self.config.device), torch_dtype(self.config.dtype)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {self.config.device!r} asked for, but no CUDA device is present; use 'cpu'")
        self.model = model.to(device=device, dtype=dtype).eval()
        self.tokenizer = tokenizer
        self.lm = LayerwiseModel(self.model)
        self.device, self.dtype = device, dtype
        check_blend(self.config.blend, self.lm.shape.num_layers, "blend.check_layers")
        store = (
            store
            if store is not None
            else build_store(
                memory_bytes=self.config.memory_budget_bytes,
                disk_dir=self.config.disk_dir,
                disk_bytes=self.config.disk_budget_bytes,
                redis_url=self.config.redis_url,
                redis_bytes=self.config.redis_budget_bytes,
                hmac_key=self.config.store_hmac_key,
                kv_codec=self.config.kv_codec,
                memory_codec=self.config.memory_codec,
            )
        )
        self.template = template or PromptTemplate()
        self.fingerprint = model_fingerprint(self.model)
        self.controller = controller
        if controller is not None:
            controller.check_model(self.fingerprint, self.config.dtype)
        self.eos_ids = eos_token_ids(self.model, tokenizer)
        limits = [self.lm.shape.max_positions, self.config.max_prompt_tokens, max_blend_length(self.model.config)]
        self.max_tokens = min(x for x in limits if x is not None)
        lead_in = self.config.lead_in
        lead_in_ids = encode(tokenizer, lead_in + self.config.chunk_separator) if lead_in is not None else ()
        self.chunks = ChunkCache(self.lm, store, self.fingerprint, self.dtype, lead_in_ids)
        self._prefiller = Prefiller(self.model, self.lm, self.chunks, pipelined=self.config.pipelined_loading)
        self._lock = threading.RLock()

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

    @property
    def store(self) -> ChunkStore:
        """The chunk store (a tier or a stack of tiers)."""
        return self.chunks.store

    @store.setter
    def store(self, store: ChunkStore) -> None:
        """Serve later requests from another store (after the request in flight, if any)."""
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
        if question is not None:
            if prefix is not None or suffix is not None:
                raise PromptError("give either a question (the template renders it) or prefix/suffix, not both")
            if not question.strip():
                raise PromptError("the question is empty")
            prefix, suffix = (template or self.template).render(self.tokenizer, question)
        elif suffix is None:
            raise PromptError("give a question, or a suffix (the text after the chunks)")
        return tokenize_parts(self.tokenizer, prefix or "", chunks, suffix, separator=self.config.chunk_separator)

    def check_length(self, prompt: TokenizedPrompt, max_new_tokens: int = 0) -> None:
        """PromptError when the prompt and its answer budget do not fit the model's context."""
        total = prompt.num_tokens + max_new_tokens
        if total > self.max_tokens:
            raise PromptError(
                f"prompt of {prompt.num_tokens} tokens + {max_new_tokens} new tokens exceeds the model's limit of "
                f"{self.max_tokens}; retrieve fewer or shorter chunks, or lower max_new_tokens"
            )

    def chunk_key(self, prefix_ids: Sequence[int], chunk_ids: Sequence[int]) -> str:
        """The store key of a chunk's KV when it follows `prefix_ids` (model fingerprint, dtype and tokens)."""
        return self.chunks.key(prefix_ids, chunk_ids)

    def prompt_keys(self, prompt: TokenizedPrompt, *, with_prefix: bool = True) -> list[str]:
        """The store keys this engine reads a prompt's KV from: the prefix's (if any, and `with_prefix`), then
        each chunk's in order (with a lead-in, every chunk but the first reads its entry cached after the
        lead-in). A request whose chunk lacks that entry reads the chunk's other entry if it is stored;
        `precompute` stores both."""
        return self.chunks.prompt_keys(prompt.prefix_ids, prompt.chunk_ids, with_prefix=with_prefix)

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
        with self._lock:
            return self.chunks.fill(prefix_ids, chunk_ids, show_progress=show_progress)

    def clear_store(self, tiers: Sequence[str] | None = None) -> None:
        """Drop the stored chunk KV: every tier, or only the named ones (`["memory"]` frees this process's
        memory and keeps disk and Redis, which other workers may share). Waits for a request in flight to
        finish first; the next request recomputes whatever it no longer finds.
        """
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
        token_scores: torch.Tensor | None = None,
    ) -> Prefill:
        """Build the prompt's KV cache in the given mode. Times exclude tokenization (see `generate`).

        `blend` replaces the engine's `BlendConfig` for this request (another rule); `recompute_ratio` changes
        only its ratio. The controller, if any, chooses the ratio only when neither is given.
        `token_scores` ([N] floats, higher = recompute first) rank the chunk tokens in place of the question's
        attention pass, for the rules that have one (selection "attention" or "attention|deviation"): your own
        relevance signal, or an oracle in a study. Their cost is not counted; the probe's is not spent.
        """
        mode = PrefillMode.parse(mode)
        check_ratio_arg(recompute_ratio)
        if mode is not PrefillMode.BLEND and recompute_ratio is not None:
            raise ConfigError(f"recompute_ratio applies to mode 'blend' only, got mode {mode.value!r}")
        pinned = recompute_ratio is not None or blend is not None
        blend = blend or self.config.blend
        if recompute_ratio is not None:
            blend = blend.with_ratio(recompute_ratio)
        check_blend(blend, self.lm.shape.num_layers, "blend.check_layers")
        self.check_length(prompt)
        if token_scores is not None:
            token_scores = check_token_scores(token_scores, prompt, mode, blend)
        policy = self.controller if mode is PrefillMode.BLEND and not pinned else None
        with self._lock:
            # A chunk read layer by layer can turn out damaged after the fusor has started; its tier has dropped
            # it by then, so trying again finds it in another tier or recomputes it. Each retry follows the
            # removal of one entry, so this ends.
            fresh: set[str] = set()  # chunks prefilled during this request: misses, even when found on a retry
            for attempt in range(len(prompt.chunk_ids) + 2):
                try:
                    return self._prefiller.run(prompt, mode, blend, fresh, policy, token_scores)
                except CorruptEntryError as exc:
                    logger.warning("prefill attempt %d read a damaged chunk (%s); trying again", attempt + 1, exc)
            return self._prefiller.run(prompt, mode, blend, fresh, policy, token_scores)

    def extend(self, prefill: Prefill, token_ids: Sequence[int]) -> torch.Tensor:
        """Feed tokens after a prefilled prompt in one forward (teacher forcing); -> logits [T, vocab] float32.

        Row t is the next-token distribution after `token_ids[t]`, so `prefill.logits` followed by rows 0..T-2
        score a continuation of T tokens. The prefill's cache grows by these tokens and `num_tokens` with it.
        """
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        if ids.ndim != 1 or ids.numel() == 0:
            raise ConfigError("extend needs a non-empty list of token ids")
        with self._lock:
            logits = self._prefiller.forward(ids, prefill.num_tokens, prefill.cache, all_logits=True)
        prefill.num_tokens += ids.numel()
        return logits

    # -- generation ---------------------------------------------------------------------------------------------

    def generate(
        self, chunks: Sequence[str] | TokenizedPrompt, question: str | None = None, **options: Unpack[RequestOptions]
    ) -> GenerationResult:
        """Answer a question over chunks (or a prebuilt prompt) and return the text with the request's metrics.

        Takes the keyword arguments of `stream`, and collects its stream.
        """
        return self.stream(chunks, question, **options).collect()

    def stream(
        self,
        chunks: Sequence[str] | TokenizedPrompt,
        question: str | None = None,
        *,
        mode: PrefillMode | str = PrefillMode.BLEND,
        recompute_ratio: float | None = None,
        blend: BlendConfig | None = None,
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
        """Yield the answer's text as it is produced; `.result` holds the `GenerationResult` at the end.

        `mode`: "blend" (default), "full", "prefix" or "reuse"; `blend` replaces the engine's `BlendConfig` for
        this request (e.g. `blend_rule("gradual", 0.15)`), `recompute_ratio` overrides the blend ratio;
        sampling: greedy at temperature 0, else `top_p` / `top_k` / `seed`; `stop`: strings that end the answer
        (None: none). A prompt is chunks + question (rendered by `template`), chunks + explicit `prefix` /
        `suffix`, or a prebuilt `TokenizedPrompt`. Every argument is checked here, before any compute.
        """
        t0 = time.perf_counter()
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k, stop, seed)
        check_ratio_arg(recompute_ratio)
        if isinstance(chunks, TokenizedPrompt):
            prompt = chunks
        else:
            check_encodable(chunks, question=question, prefix=prefix, suffix=suffix)
            prompt = self.build_prompt(chunks, question, template=template, prefix=prefix, suffix=suffix)
        self.check_length(prompt, params.max_new_tokens)
        mode = PrefillMode.parse(mode)
        if mode is not PrefillMode.BLEND and (recompute_ratio is not None or blend is not None):
            raise ConfigError(f"recompute_ratio and blend apply to mode 'blend' only, got mode {mode.value!r}")
        if blend is not None:
            if not isinstance(blend, BlendConfig):
                kind = type(blend).__name__
                raise ConfigError(f"blend must be a BlendConfig (e.g. blend_rule('gradual')), got {kind}")
            check_blend(blend, self.lm.shape.num_layers, "blend.check_layers")

        def prefill() -> Prefill:
            return self.prefill(prompt, mode, recompute_ratio=recompute_ratio, blend=blend)

        def step(token: int, pos: int, cache: Any) -> torch.Tensor:
            # The lock is taken per forward, never across a yield: a consumer may pause, or resume elsewhere.
            with self._lock:
                return self._prefiller.forward(torch.tensor([token]), pos, cache)

        return TextStream(decode(prefill, step, self.tokenizer, self.eos_ids, params, self.device, t0))
