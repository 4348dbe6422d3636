"""What the LLM and the chat model share: the engine they run on, sampling settings, and per-request metadata.

Scope: resolving the engine (given, or loaded once per process by name), splitting a rendered prompt at the
documents' placeholder into prefix / suffix, turning per-call kwargs into `engine.stream` arguments, and
turning a request's `RequestMetrics` into LangChain usage metadata and generation info. The framework-free
parts (placeholder, split, per-call arguments, model name, shared engines) are `cacheblend_rag.frameworks`'s,
shared with the LlamaIndex package.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, ClassVar, Literal

from cacheblend_rag import CacheBlendEngine, GenerationResult, TextStream
from cacheblend_rag.errors import PromptError
from cacheblend_rag.frameworks import (
    CONTEXT_PLACEHOLDER,
    AsyncTextStream,
    EngineFields,
    PromptText,
    call_arguments,
    check_no_store_settings,
    engine_config,
    load_engine,
    metrics_metadata,
    resolve_model_name,
    setting_aliases,
    split_at_context,
)
from langchain_core.language_models import LangSmithParams
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from pydantic import ConfigDict, Field, model_validator

__all__ = ["CONTEXT_PLACEHOLDER", "CacheBlendParams", "load_engine", "split_prompt", "usage_from"]

# LangChain's own keyword arguments of a call, besides the engine's (`cacheblend_rag.frameworks.CALL_ARGUMENTS`):
# the documents (the chains pass them), a per-call model, and the flag LangChain sets on streaming calls.
_FRAMEWORK_KWARGS = ("chunks", "model", "stream")


def split_prompt(
    text: str | PromptText, chunks: Sequence[str] | None
) -> tuple[str | PromptText, list[str], str | PromptText]:
    """-> (prefix, chunks, suffix) of a rendered prompt: split at the placeholder when chunks are given.

    Without chunks the whole text is the suffix (a plain full prefill of the prompt).
    """
    if chunks is None:
        if CONTEXT_PLACEHOLDER in text:
            raise PromptError(
                "the prompt holds the documents' placeholder but no chunks were passed; call the model with "
                "chunks=[...] (the documents' texts), or use create_blend_documents_chain, which does it"
            )
        return "", [], text
    if isinstance(chunks, str):
        raise PromptError("chunks must be a list of strings, got a single string; wrap it: chunks=[text]")
    prefix, suffix = split_at_context(text)
    return prefix, list(chunks), suffix


def usage_from(result: GenerationResult) -> UsageMetadata:
    """LangChain usage metadata of one request; chunk tokens loaded from the KV cache count as cache reads."""
    m = result.metrics
    return UsageMetadata(
        input_tokens=m.prompt_tokens,
        output_tokens=m.generated_tokens,
        total_tokens=m.prompt_tokens + m.generated_tokens,
        input_token_details=InputTokenDetails(cache_read=m.reused_tokens),
    )


class CacheBlendParams(EngineFields):
    """Settings shared by `CacheBlendLLM` and `ChatCacheBlend`. Per call, each may be overridden by a kwarg."""

    # The engine is a plain object; unknown settings are errors, not silently ignored. (Each model class sets
    # this again: LangChain's base classes come later in the bases and their config would win.)
    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid", hide_input_in_errors=True)
    _ls_model_type: ClassVar[Literal["chat", "llm"]]  # how LangSmith traces label the model

    model: str | None = Field(
        default=None,
        description="Preset name or local checkpoint path (None: $CACHEBLEND_RAG_MODEL, else the default preset). "
        "Loaded on first use and shared by every model object of the process with the same model and engine "
        "settings (device, dtype, store).",
    )
    engine: CacheBlendEngine | None = Field(
        default=None,
        exclude=True,
        description="An engine built by the caller; takes precedence over `model` for loading.",
    )
    # device, dtype and the store of a loaded engine are `EngineFields`' (declared once for both frameworks); an
    # engine passed as `engine=` has its own, so store settings are refused beside it.
    mode: Literal["blend", "full", "prefix", "reuse"] = Field(
        default="blend", description="How a prompt with chunks is prefilled; 'full' is the reference."
    )
    recompute_ratio: float | None = Field(
        default=None, description="Share of chunk tokens recomputed in blend mode (None: the engine's, 0.15)."
    )
    # The engine's name, as in LlamaIndex's CacheBlendLLM; LangChain's standard `max_tokens` is accepted for it,
    # when the model is built, per call, and as an attribute.
    max_new_tokens: int = Field(default=256, ge=1, description="Most tokens to generate (alias: max_tokens).")
    temperature: float = Field(default=0.0, ge=0.0, description="0 decodes greedily.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 turns top-k off.")
    seed: int | None = Field(default=None, description="Seed of the sampler when temperature > 0.")
    stop: list[str] | None = Field(default=None, description="Generation ends before the first of these strings.")
    streaming: bool = Field(default=False, description="Generate through the streaming path even on invoke.")
    timeout: float | None = Field(
        default=None,
        gt=0,
        description="Seconds a call may take; a longer one raises TimeoutError, its prefill stopped at the next layer.",
    )
    max_retries: int = Field(
        default=0,
        ge=0,
        description="Accepted so code written for hosted models runs unchanged. Local generation fails only "
        "deterministically (bad input, out of memory), so calls are never retried.",
    )
    detailed_metrics: bool = Field(
        default=False,
        description="Also put the per-layer detail of each request (recomputed_per_layer) in the response "
        "metadata's 'cacheblend' entry; off: the totals only.",
    )

    @model_validator(mode="before")
    @classmethod
    def _max_tokens_alias(cls, data: Any) -> Any:
        """`max_tokens=` (LangChain's standard name) sets `max_new_tokens`."""
        return setting_aliases(data) if isinstance(data, dict) else data

    @property
    def max_tokens(self) -> int:
        """LangChain's standard name of `max_new_tokens`."""
        return self.max_new_tokens

    @max_tokens.setter
    def max_tokens(self, value: int) -> None:
        self.max_new_tokens = value

    @model_validator(mode="after")
    def _check_engine_settings(self) -> CacheBlendParams:
        """Bad store or call settings fail here, where the model is built, not at its first call."""
        if self.engine is not None:
            check_no_store_settings(**self.engine_settings())
        else:
            engine_config(**self.engine_settings())
        call_arguments(self._defaults(), {}, framework=_FRAMEWORK_KWARGS)
        return self

    @property
    def lc_secrets(self) -> dict[str, str]:
        """What LangChain's serialization writes as a reference to an environment variable, never as its value."""
        return {"redis_url": "CACHEBLEND_REDIS_URL"}

    @property
    def model_name(self) -> str:
        """The name reported in metadata and traces: `model`, else the engine's checkpoint name."""
        return resolve_model_name(self.model, self.engine)

    def get_engine(self, model: str | None = None) -> CacheBlendEngine:
        """The engine for a call: the given one, or the shared one of `model` (a per-call override) or `self.model`."""
        if model is not None and model != self.model_name:
            return load_engine(model, **self.engine_settings())
        if self.engine is not None:
            return self.engine
        return load_engine(self.model, **self.engine_settings())

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of `text` by the model's own tokenizer (LangChain's default is GPT-2's)."""
        return list(self.get_engine().tokenizer.encode(text, add_special_tokens=False))

    def _defaults(self) -> dict[str, Any]:
        """This model's settings under the engine's names (`cacheblend_rag.frameworks.CALL_ARGUMENTS`)."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop,
            "mode": self.mode,
            "recompute_ratio": self.recompute_ratio,
        }

    def _call_arguments(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The engine arguments of a call: this model's settings, overridden by the call's `stop` and kwargs."""
        overrides = kwargs if stop is None else {**kwargs, "stop": stop}
        return call_arguments(self._defaults(), overrides, framework=_FRAMEWORK_KWARGS)

    def _stream_request(
        self, text: str | PromptText, stop: list[str] | None, kwargs: dict[str, Any]
    ) -> tuple[Iterator[str], Any, str]:
        """Start one request on a rendered prompt. -> (text deltas with the timeout enforced, the engine's
        stream (its `.result` is set once the deltas are exhausted), the model name used)."""
        arguments = self._call_arguments(stop, kwargs)
        engine = self.get_engine(kwargs.get("model"))
        prefix, chunks, suffix = split_prompt(text, kwargs.get("chunks"))
        stream = engine.stream(chunks, prefix=prefix, suffix=suffix, **arguments)
        return self._with_timeout(stream), stream, kwargs.get("model") or self.model_name

    async def _astream_request(
        self, text: str | PromptText | None, stop: list[str] | None, kwargs: dict[str, Any], render: Any = None
    ) -> tuple[AsyncIterator[str], AsyncTextStream, str]:
        """`_stream_request` for asyncio: the engine's scheduler serves the request among all others in flight, and
        the deltas are awaited without a thread. `render(tokenizer)` builds the prompt text when `text` is None.
        Loading an engine the first time runs on a worker thread, so the event loop never stalls on it."""
        arguments = self._call_arguments(stop, kwargs)
        engine = await asyncio.to_thread(self.get_engine, kwargs.get("model"))
        prompt = render(engine.tokenizer) if text is None else text
        prefix, chunks, suffix = split_prompt(prompt, kwargs.get("chunks"))
        stream = engine.astream(chunks, prefix=prefix, suffix=suffix, **arguments)
        return self._with_async_timeout(stream), stream, kwargs.get("model") or self.model_name

    async def _with_async_timeout(self, deltas: AsyncTextStream) -> AsyncIterator[str]:
        """The deltas, ending in TimeoutError once `timeout` seconds have passed, even in the middle of the prefill:
        the wait for the next delta is cancelled, which cancels the request (its prefill stops at the next layer)."""
        if self.timeout is None:
            async for delta in deltas:
                yield delta
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while True:
            try:
                delta = await asyncio.wait_for(deltas.__anext__(), max(0.0, deadline - loop.time()))
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise self._timeout_error() from None
            yield delta

    def _timeout_error(self) -> TimeoutError:
        return TimeoutError(
            f"generation ran past timeout={self.timeout}s; raise timeout, lower max_new_tokens, or retrieve fewer "
            "documents"
        )

    def _with_timeout(self, deltas: TextStream) -> Iterator[str]:
        """The deltas, ending in TimeoutError once `timeout` seconds have passed, even in the middle of the prefill:
        a timer closes the stream then, which cancels the request (its prefill stops at the next layer)."""
        if self.timeout is None:
            yield from deltas
            return
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            deltas.close()

        timer = threading.Timer(self.timeout, expire)
        timer.daemon = True
        timer.start()
        try:
            yield from deltas
        finally:
            timer.cancel()
        if expired.is_set():
            raise self._timeout_error()

    def _generation_info(self, result: GenerationResult, model_name: str) -> dict[str, Any]:
        """What a response carries besides its text: the model, why it ended, and the request's blend metrics."""
        metrics = metrics_metadata(result.metrics, detailed=self.detailed_metrics)
        return {"model_name": model_name, "finish_reason": result.finish_reason, "cacheblend": metrics}

    def _call_params(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The settings of a call, for traces (LangSmith params) and caching keys."""
        return {
            "model": kwargs.get("model") or self.model_name,
            "mode": kwargs.get("mode", self.mode),
            "recompute_ratio": kwargs.get("recompute_ratio", self.recompute_ratio),
            "max_new_tokens": kwargs.get("max_new_tokens", kwargs.get("max_tokens", self.max_new_tokens)),
            "temperature": kwargs.get("temperature", self.temperature),
            "top_p": kwargs.get("top_p", self.top_p),
            "top_k": kwargs.get("top_k", self.top_k),
            "stop": self.stop if stop is None else stop,
        }

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._call_params(None, {})

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = self._call_params(stop, kwargs)
        ls = LangSmithParams(
            ls_provider="cacheblend",
            ls_model_name=params["model"],
            ls_model_type=self._ls_model_type,
            ls_temperature=params["temperature"],
            ls_max_tokens=params["max_new_tokens"],
        )
        if params["stop"]:
            ls["ls_stop"] = params["stop"]
        return ls
