"""CacheBlendLLM: LlamaIndex's LLM interface on a shared `CacheBlendEngine`.

A completion or chat call is one plain request to the engine with no chunks, i.e. a full prefill of the prompt:
a flat prompt string has no chunk boundaries to reuse. This is what the framework's own response modes
(compact, refine, tree_summarize, accumulate) call, so they run on the same model and decoding settings as
`BlendSynthesizer`, which reaches through this LLM to the engine and passes each retrieved node as a chunk.

Decoding settings are pydantic fields; the engine is a private attribute, shared, never copied or serialized.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from cacheblend_rag import CacheBlendEngine, EngineConfig, GenerationResult, PrefillMode
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.frameworks import (
    ENGINE_SETTINGS,
    ChatTurn,
    EngineFields,
    call_arguments,
    check_no_store_settings,
    has_chat_template,
    load_engine,
    metrics_metadata,
    non_text_error,
    render_chat,
    resolve_model_name,
    setting_aliases,
)
from llama_index.core.base.llms.generic_utils import completion_response_to_chat_response
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    TextBlock,
)
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr, SecretStr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.prompts import BasePromptTemplate

# Key of the request's metrics (`cacheblend_rag.frameworks.metrics_metadata`) in CompletionResponse.additional_kwargs
# and Response.metadata.
METRICS_KEY = "cacheblend_metrics"


def _turn_of(message: ChatMessage) -> ChatTurn:
    """A LlamaIndex message as a chat turn: text blocks only (an image or a file is refused, not dropped)."""
    parts = []
    for block in message.blocks:
        if not isinstance(block, TextBlock):
            raise non_text_error(block.block_type, message.role.value)
        parts.append(block.text)
    return ChatTurn(message.role.value, "".join(parts))


class ChatTemplate:
    """Renders chat messages with the tokenizer's chat template (`cacheblend_rag.frameworks.render_chat`),
    ending with the assistant turn's opening.

    A small callable object rather than a method of the LLM: the LLM's formatting fields then do not point back
    at the LLM (whose repr would recurse through them).
    """

    def __init__(self, tokenizer: Any, system_prompt: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt

    def __call__(self, messages: Sequence[ChatMessage]) -> str:
        # The framework's formatting functions return strings; the content marks stay with `render_chat`.
        return render_chat(self.tokenizer, [_turn_of(m) for m in messages]).text

    def user_turn(self, prompt: str) -> str:
        """A bare completion prompt as one user message (after the system prompt, if any)."""
        messages = [ChatMessage(role="system", content=self.system_prompt)] if self.system_prompt else []
        return self([*messages, ChatMessage(role="user", content=prompt)])

    def __repr__(self) -> str:
        return f"ChatTemplate(system_prompt={self.system_prompt!r})"


class CacheBlendLLM(EngineFields, CustomLLM):
    """A LlamaIndex LLM served in-process by a `CacheBlendEngine` (build the engine once and share it).

    Example:
        engine = CacheBlendEngine.from_pretrained()
        llm = CacheBlendLLM(engine=engine, max_new_tokens=128)
        print(llm.complete("Name three rivers in France."))

    Without `engine`, the engine of `model_name` (default: `$CACHEBLEND_RAG_MODEL`, else the default preset) is
    loaded on construction with the engine fields below (device, dtype, store tiers and budgets) and shared by
    every model object of the process with the same model and settings, LangChain's included
    (`cacheblend_rag.frameworks.load_engine`).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, hide_input_in_errors=True)

    model_name: str = Field(
        default="",
        description="Preset name or checkpoint path: what is loaded without `engine`, and the name reported in "
        "metadata (default: the engine's checkpoint name, or the default preset).",
    )
    max_new_tokens: int = Field(default=256, gt=0, description="Most tokens generated per call (alias: max_tokens).")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature; 0 decodes greedily.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (with temperature > 0).")
    top_k: int = Field(default=0, ge=0, description="Sample among the k likeliest tokens; 0 means no limit.")
    stop: list[str] = Field(default_factory=list, description="Strings that end generation when produced.")
    seed: int | None = Field(default=None, description="Seed for sampling, so sampled answers are repeatable.")
    context_window: int = Field(
        default=0,
        ge=0,
        description="Tokens of prompt plus output the engine accepts; taken from the engine when left at 0.",
    )
    detailed_metrics: bool = Field(
        default=False,
        description="Also put the per-layer detail of each request (recomputed_per_layer) in the metrics of a "
        "response; off: the totals only.",
    )
    is_chat_model: bool = Field(
        default=True,
        description=(
            "Format prompts as chat messages with the tokenizer's chat template (the default when the tokenizer "
            "has one); False sends prompts as plain text."
        ),
    )

    # device, dtype and the store of the engine loaded without `engine=` are `EngineFields`' (declared once for both
    # frameworks); an engine passed in has its own, so these are refused beside it.

    _engine: CacheBlendEngine = PrivateAttr()

    def __init__(self, engine: CacheBlendEngine | None = None, **kwargs: Any) -> None:
        kwargs = setting_aliases(kwargs)  # max_tokens= (LangChain's name) sets max_new_tokens
        settings = {name: kwargs.get(name) for name in ENGINE_SETTINGS}
        if isinstance(settings["redis_url"], SecretStr):
            settings["redis_url"] = settings["redis_url"].get_secret_value()
        if engine is None:
            engine = load_engine(kwargs.get("model_name") or None, **settings)
        elif any(value is not None for value in settings.values()):
            check_no_store_settings(**settings)
            raise ConfigError(
                "device and dtype are settings of an engine the LLM loads, but an engine was passed in, which has "
                "its own; build that engine with them, or drop engine= to let the LLM load one"
            )
        if not isinstance(engine, CacheBlendEngine):
            raise TypeError(f"engine must be a cacheblend_rag.CacheBlendEngine, got {type(engine).__name__}")
        has_template = has_chat_template(engine.tokenizer)
        if kwargs.get("is_chat_model") and not has_template:
            raise ValueError("is_chat_model=True needs a tokenizer with a chat template; this one has none")
        kwargs.setdefault("is_chat_model", has_template)
        kwargs["model_name"] = resolve_model_name(kwargs.get("model_name"), engine)
        if not kwargs.get("context_window"):
            kwargs["context_window"] = engine.max_tokens
        super().__init__(**kwargs)
        self._engine = engine
        # Chat models render messages (and bare completions, as one user turn) with the model's own chat
        # template, unless the caller supplied their own formatting functions.
        if self.is_chat_model:
            if kwargs.get("messages_to_prompt") is None:
                self.messages_to_prompt = ChatTemplate(engine.tokenizer)
            if kwargs.get("completion_to_prompt") is None:
                self.completion_to_prompt = ChatTemplate(engine.tokenizer, system_prompt=self.system_prompt).user_turn

    @classmethod
    def from_pretrained(
        cls, name_or_path: str | None = None, *, config: EngineConfig | None = None, **kwargs: Any
    ) -> CacheBlendLLM:
        """Build an engine (a preset or a local checkpoint) and wrap it; keyword arguments are the LLM's fields."""
        engine = CacheBlendEngine.from_pretrained(name_or_path, config=config or EngineConfig())
        return cls(engine=engine, **kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "CacheBlendLLM"

    @property
    def engine(self) -> CacheBlendEngine:
        """The shared engine, for precomputing chunks or calling it directly."""
        return self._engine

    @property
    def max_tokens(self) -> int:
        """Another name of `max_new_tokens` (LangChain's)."""
        return self.max_new_tokens

    @max_tokens.setter
    def max_tokens(self, value: int) -> None:
        self.max_new_tokens = value

    def metrics_of(self, result: GenerationResult) -> dict[str, Any]:
        """A request's metrics as responses carry them: compact unless `detailed_metrics`."""
        return metrics_metadata(result.metrics, detailed=self.detailed_metrics)

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=self.is_chat_model,
            model_name=self.model_name,
        )

    # -- prompt formatting ----------------------------------------------------------------------------------

    def format_prompt(self, prompt: BasePromptTemplate, **prompt_args: Any) -> str:
        """The exact text `predict(prompt, **prompt_args)` sends to the model (system prompt included).

        `BlendSynthesizer` renders its question-answering prompt through this, so blend mode sees the same
        text as the framework's modes with the same template.
        """
        if self.is_chat_model:
            assert self.messages_to_prompt is not None
            return self.messages_to_prompt(self._get_messages(prompt, **prompt_args))
        return self._get_prompt(prompt, **prompt_args)

    def engine_arguments(
        self, overrides: dict[str, Any], *, mode: PrefillMode | str = "full", recompute_ratio: float | None = None
    ) -> dict[str, Any]:
        """engine.generate() keyword arguments of one call: this LLM's decoding settings and the given `mode` and
        `recompute_ratio`, each overridden by the call's keyword arguments (`cacheblend_rag.frameworks.
        CALL_ARGUMENTS`; anything else raises TypeError)."""
        defaults = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop,
            "mode": mode,
            "recompute_ratio": recompute_ratio,
        }
        return call_arguments(defaults, overrides)

    # -- completion -----------------------------------------------------------------------------------------

    def _prompt_text(self, prompt: str, formatted: bool) -> str:
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"the prompt must be a non-empty string, got {prompt!r}")
        if formatted:
            return prompt
        assert self.completion_to_prompt is not None
        return self.completion_to_prompt(prompt)

    def _response(self, result: GenerationResult) -> CompletionResponse:
        return CompletionResponse(
            text=result.text,
            raw={
                "token_ids": result.token_ids,
                "finish_reason": result.finish_reason,
                "device": result.metrics.device,  # where and in what precision the answer was computed
                "dtype": result.metrics.dtype,
            },
            additional_kwargs={METRICS_KEY: self.metrics_of(result)},
        )

    def _last_response(self, result: GenerationResult | None) -> CompletionResponse:
        """A stream's last response: an empty delta that carries the metrics only."""
        assert result is not None
        final = self._response(result)
        final.delta = ""
        return final

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        text = self._prompt_text(prompt, formatted)
        # No chunks: the whole prompt is the suffix, so the engine runs a full prefill.
        result = self._engine.generate([], prefix="", suffix=text, **self.engine_arguments(kwargs))
        return self._response(result)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        text = self._prompt_text(prompt, formatted)
        # Arguments are checked here, before the first token is asked for.
        stream = self._engine.stream([], prefix="", suffix=text, **self.engine_arguments(kwargs))

        def gen() -> Iterator[CompletionResponse]:
            so_far = ""
            for delta in stream:
                so_far += delta
                yield CompletionResponse(text=so_far, delta=delta)
            yield self._last_response(stream.result)

        return gen()

    # Async calls go through the engine's scheduler: awaited without a thread, and decoded together with every
    # other request in flight (`aquery` x N, `asyncio.gather`).

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        text = self._prompt_text(prompt, formatted)
        result = await self._engine.agenerate([], prefix="", suffix=text, **self.engine_arguments(kwargs))
        return self._response(result)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        text = self._prompt_text(prompt, formatted)
        stream = self._engine.astream([], prefix="", suffix=text, **self.engine_arguments(kwargs))

        async def gen() -> AsyncIterator[CompletionResponse]:
            so_far = ""
            async for delta in stream:
                so_far += delta
                yield CompletionResponse(text=so_far, delta=delta)
            yield self._last_response(stream.result)

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        assert self.messages_to_prompt is not None
        response = await self.acomplete(self.messages_to_prompt(messages), formatted=True, **kwargs)
        return completion_response_to_chat_response(response)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        assert self.messages_to_prompt is not None
        responses = await self.astream_complete(self.messages_to_prompt(messages), formatted=True, **kwargs)

        async def gen() -> ChatResponseAsyncGen:
            async for response in responses:
                yield completion_response_to_chat_response(response)

        return gen()
