"""BlendSynthesizer: a LlamaIndex response synthesizer that answers with CacheBlend over the retrieved nodes.

The framework's modes pack node texts into one prompt string (compact) or call the LLM per node (refine,
accumulate, tree_summarize); either way each call is a fresh prefill. Here every retrieved node is its own chunk
of one engine request, so a node's KV cache is computed once, stored, and reused by every later query that
retrieves it, with ~15% of its tokens recomputed to restore cross-attention.

The prompt is the framework's question-answering template (`text_qa_template`, the one compact mode uses)
rendered by the LLM exactly as `llm.predict` would, then split where `{context_str}` goes: the text before the
nodes is the shared prefix of every chunk's cache key, the text after holds the question. A template that puts
the question before the context still answers (as a full prefill would) but reuses no chunk: a
`QuestionBeforeContextWarning` says so when the template is set, and `precompute` refuses it
(`cacheblend_rag.frameworks` states this policy for both framework packages).

`BaseSynthesizer.synthesize` is the template method: it sends the events and answers an empty retrieval with
the framework's usual empty response. This class writes only `get_response` / `aget_response`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Generator, Iterable, Sequence
from typing import Any

from cacheblend_rag import AsyncTextStream, GenerationResult, PrefillMode, TextStream
from cacheblend_rag.frameworks import (
    CONTEXT_PLACEHOLDER,
    check_context_prompt,
    document_chunks,
    question_free_prefix,
    split_at_context,
)
from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.callbacks import CallbackManager
from llama_index.core.llms import LLM
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.prompts.default_prompt_selectors import DEFAULT_TEXT_QA_PROMPT_SEL
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore
from llama_index.core.settings import Settings
from llama_index.core.types import RESPONSE_TEXT_TYPE

from llama_index.llms.cacheblend import METRICS_KEY, CacheBlendLLM


class BlendAnswer(str):
    """The answer text, carrying the engine's whole result (`.result`: token ids, finish reason, metrics)."""

    result: GenerationResult

    def __new__(cls, result: GenerationResult) -> BlendAnswer:
        answer = super().__new__(cls, result.text)
        answer.result = result
        return answer


class BlendTokenStream(Generator[str, None, None]):
    """Text deltas of one streamed answer: a real generator, so the framework wraps it in a StreamingResponse.

    When exhausted, `.result` holds the engine's result and `metadata[METRICS_KEY]` its metrics; the synthesizer
    points `metadata` at the StreamingResponse's own metadata, so the metrics appear there after the last token.
    """

    def __init__(self, stream: TextStream, metrics: Callable[[GenerationResult], dict[str, Any]]) -> None:
        self._stream = stream
        self._metrics = metrics  # the LLM's: compact unless its detailed_metrics
        self.metadata: dict[str, Any] = {}
        self.result: GenerationResult | None = None

    def send(self, value: None) -> str:
        try:
            return next(self._stream)
        except StopIteration:
            self._finish()
            raise

    def throw(self, typ: Any = None, val: Any = None, tb: Any = None) -> str:  # type: ignore[override]
        raise typ if val is None else val

    def _finish(self) -> None:
        if self.result is None and self._stream.result is not None:
            self.result = self._stream.result
            self.metadata[METRICS_KEY] = self._metrics(self.result)


class AsyncBlendTokenStream(AsyncGenerator[str, None]):
    """The async form of `BlendTokenStream`, over the engine's `astream`: awaited without a thread, and decoded
    together with every other request in flight."""

    def __init__(self, stream: AsyncTextStream, metrics: Callable[[GenerationResult], dict[str, Any]]) -> None:
        self._stream = stream
        self._metrics = metrics
        self.metadata: dict[str, Any] = {}
        self.result: GenerationResult | None = None

    async def asend(self, value: None) -> str:
        try:
            return await self._stream.__anext__()
        except StopAsyncIteration:
            if self.result is None and self._stream.result is not None:
                self.result = self._stream.result
                self.metadata[METRICS_KEY] = self._metrics(self.result)
            raise

    async def athrow(self, typ: Any = None, val: Any = None, tb: Any = None) -> str:  # type: ignore[override]
        raise typ if val is None else val

    async def aclose(self) -> None:
        await self._stream.aclose()


def node_text(node: BaseNode | NodeWithScore | str) -> str:
    """A node's text exactly as `BaseSynthesizer.synthesize` passes it on (so precomputed keys match)."""
    if isinstance(node, str):
        return node
    if isinstance(node, NodeWithScore):
        node = node.node
    return node.get_content(metadata_mode=MetadataMode.LLM)


class BlendSynthesizer(BaseSynthesizer):
    """Answer from the retrieved nodes with CacheBlend: each node is one cached chunk of a single engine request.

    Args:
        llm: the `CacheBlendLLM` whose engine and decoding settings to use (default: `Settings.llm`).
        text_qa_template: the question-answering prompt, with `{context_str}` before `{query_str}`
            (default: LlamaIndex's, the one compact mode uses).
        mode: the engine's prefill mode: "blend" (CacheBlend), or "full", "prefix", "reuse" to compare.
        recompute_ratio: share of chunk tokens blend recomputes (default: the engine's, 0.15).
        streaming: return a StreamingResponse whose metadata gets the metrics after the last token.
    """

    def __init__(
        self,
        llm: LLM | None = None,
        *,
        text_qa_template: BasePromptTemplate | None = None,
        mode: PrefillMode | str = PrefillMode.BLEND,
        recompute_ratio: float | None = None,
        callback_manager: CallbackManager | None = None,
        streaming: bool = False,
        empty_response: str | None = None,
    ) -> None:
        llm = llm if llm is not None else Settings.llm
        if not isinstance(llm, CacheBlendLLM):
            raise TypeError(
                f"BlendSynthesizer needs a CacheBlendLLM (it passes nodes as chunks to its engine), got "
                f"{type(llm).__name__}; the framework's modes work with any LLM: get_response_synthesizer(...)"
            )
        self._mode = PrefillMode.parse(mode)
        if recompute_ratio is not None:
            if self._mode is not PrefillMode.BLEND:
                raise ValueError(f"recompute_ratio applies to mode 'blend' only, got mode {self._mode.value!r}")
            llm.engine.config.blend.with_ratio(recompute_ratio)  # validates the value now, not at the first query
        self._recompute_ratio = recompute_ratio
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming, empty_response=empty_response)
        self._blend_llm: CacheBlendLLM = llm
        self._text_qa_template = self._checked_template(text_qa_template or DEFAULT_TEXT_QA_PROMPT_SEL)

    # -- prompts --------------------------------------------------------------------------------------------

    def _get_prompts(self) -> PromptDictType:
        return {"text_qa_template": self._text_qa_template}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        if "text_qa_template" in prompts:
            self._text_qa_template = self._checked_template(prompts["text_qa_template"])

    def _renderer(self, template: BasePromptTemplate) -> Callable[[str], str]:
        """query -> the template's text as the LLM sends it, with the nodes' placeholder for `{context_str}`."""

        def render(query_str: str) -> str:
            return self._blend_llm.format_prompt(template, context_str=CONTEXT_PLACEHOLDER, query_str=query_str)

        return render

    def _checked_template(self, template: BasePromptTemplate) -> BasePromptTemplate:
        check_context_prompt(self._renderer(template), question="{query_str}")
        return template

    def prompt_parts(self, query_str: str) -> tuple[str, str]:
        """(text before the nodes, text after them) of the prompt for `query_str`."""
        return split_at_context(self._renderer(self._text_qa_template)(query_str))

    # -- chunk KV -------------------------------------------------------------------------------------------

    def precompute(self, nodes: Iterable[BaseNode | NodeWithScore | str]) -> tuple[int, int]:
        """Compute and store the KV of these nodes ahead of queries (e.g. all of an index's nodes, offline).

        Returns (already cached, newly computed). Later queries that retrieve them find them in the store.
        PromptError when the template puts the question before the context: no query would read this KV.
        """
        texts = document_chunks([node_text(n) for n in nodes])
        prefix = question_free_prefix(self._renderer(self._text_qa_template), question="{query_str}")
        return self._blend_llm.engine.precompute(texts, prefix=prefix)

    # -- answers --------------------------------------------------------------------------------------------

    def _request(self, query_str: str, text_chunks: Sequence[str], response_kwargs: dict[str, Any]) -> dict[str, Any]:
        """engine.generate/stream keyword arguments for one query, or {} when no chunk has text."""
        if isinstance(text_chunks, str):
            raise TypeError("text_chunks must be a sequence of strings, got a single string; wrap it: [text]")
        chunks = document_chunks(text_chunks)  # blank nodes carry nothing to reuse or read
        if not chunks:
            return {}
        prefix, suffix = self.prompt_parts(query_str)
        arguments = self._blend_llm.engine_arguments(
            response_kwargs, mode=self._mode, recompute_ratio=self._recompute_ratio
        )
        return {"chunks": chunks, "prefix": prefix, "suffix": suffix, **arguments}

    def get_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any) -> RESPONSE_TEXT_TYPE:
        request = self._request(query_str, text_chunks, response_kwargs)
        engine = self._blend_llm.engine
        if not request:
            return self._empty_response_generator() if self._streaming else self._empty_response
        if self._streaming:
            return BlendTokenStream(engine.stream(**request), self._blend_llm.metrics_of)
        return BlendAnswer(engine.generate(**request))

    async def aget_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        request = self._request(query_str, text_chunks, response_kwargs)
        engine = self._blend_llm.engine
        if not request:
            return self._empty_response_agenerator() if self._streaming else self._empty_response
        if self._streaming:
            # astream() checks its arguments and tokenizes before returning: cheap enough for the event loop
            return AsyncBlendTokenStream(engine.astream(**request), self._blend_llm.metrics_of)
        return BlendAnswer(await engine.agenerate(**request))

    def _prepare_response_output(
        self, response_str: RESPONSE_TEXT_TYPE | None, source_nodes: list[NodeWithScore]
    ) -> RESPONSE_TYPE:
        """The framework's Response, with the engine's request metrics in its metadata under METRICS_KEY."""
        response = super()._prepare_response_output(response_str, source_nodes)
        if response.metadata is None:
            response.metadata = {}
        if isinstance(response_str, BlendAnswer):
            response.metadata[METRICS_KEY] = self._blend_llm.metrics_of(response_str.result)
        elif isinstance(response_str, BlendTokenStream | AsyncBlendTokenStream):
            response_str.metadata = response.metadata  # filled in when the stream ends
        return response
