"""Documents chains that pass each document to the model as its own chunk, so each maps to its cached KV.

`create_stuff_documents_chain` joins the documents into one string; here the prompt is rendered with the
documents' placeholder in place of `{context}` and the formatted documents travel beside it as `chunks=`.
The model splits the rendered prompt at the placeholder. When the text before the documents depends on the
question, the chain still answers (as a full prefill would) but no chunk is ever reused: a
`QuestionBeforeContextWarning` says so when the chain is built, and `precompute_documents` refuses such a prompt
(`cacheblend_rag.frameworks` states this policy for both framework packages).

`create_blend_documents_chain` is the LCEL form (drop-in for `create_retrieval_chain`);
`BlendStuffDocumentsChain` is the classic `BaseCombineDocumentsChain` form (for `RetrievalQA` and friends),
and returns the request's metrics beside the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cacheblend_rag.frameworks import CONTEXT_PLACEHOLDER, check_context_prompt, document_chunks, question_free_prefix
from langchain_classic.chains.combine_documents.base import BaseCombineDocumentsChain
from langchain_core.callbacks import Callbacks
from langchain_core.documents import Document
from langchain_core.output_parsers import BaseOutputParser, StrOutputParser
from langchain_core.prompt_values import PromptValue
from langchain_core.prompts import BasePromptTemplate, PromptTemplate, format_document
from langchain_core.runnables import Runnable, RunnableLambda
from pydantic import ConfigDict, Field, model_validator

from .._common import CacheBlendParams
from ..chat_models import ChatCacheBlend, render_messages
from ..llms import CacheBlendLLM

DEFAULT_DOCUMENT_PROMPT = PromptTemplate.from_template("{page_content}")
METRICS_KEY = "cacheblend_metrics"


def _check_model(llm: Any) -> ChatCacheBlend | CacheBlendLLM:
    if not isinstance(llm, CacheBlendParams):
        raise TypeError(
            f"the blend documents chain needs a ChatCacheBlend or CacheBlendLLM, got {type(llm).__name__}; "
            "other models cannot load cached chunk KV, use create_stuff_documents_chain for them"
        )
    return llm  # type: ignore[return-value]


def _check_prompt(prompt: BasePromptTemplate, document_variable_name: str) -> None:
    """The prompt must take the documents once; warn when the text before them depends on another variable."""
    if document_variable_name not in prompt.input_variables:
        raise ValueError(
            f"the prompt must take the documents as {{{document_variable_name}}}, but its variables are "
            f"{prompt.input_variables}; add {{{document_variable_name}}} to it or set document_variable_name"
        )
    others = [v for v in prompt.input_variables if v != document_variable_name]
    check_context_prompt(_renderer(prompt, document_variable_name, _as_string), question=f"{others}")


def _as_string(value: PromptValue) -> str:
    return value.to_string()


def _renderer(
    prompt: BasePromptTemplate, document_variable_name: str, to_text: Callable[[PromptValue], str]
) -> Callable[[str], str]:
    """value -> the prompt's text (by `to_text`) with the documents' placeholder, `value` for every other variable."""
    others = [v for v in prompt.input_variables if v != document_variable_name]

    def render(value: str) -> str:
        return to_text(prompt.invoke({**{v: value for v in others}, document_variable_name: CONTEXT_PLACEHOLDER}))

    return render


def render_documents_prompt(
    prompt: BasePromptTemplate,
    documents: Sequence[Document],
    inputs: dict[str, Any],
    *,
    document_prompt: BasePromptTemplate | None = None,
    document_variable_name: str = "context",
) -> tuple[PromptValue, list[str]]:
    """-> (the prompt rendered with the documents' placeholder, the formatted documents: the chunks)."""
    doc_prompt = document_prompt or DEFAULT_DOCUMENT_PROMPT
    chunks = document_chunks([format_document(doc, doc_prompt) for doc in documents])
    values = {k: v for k, v in inputs.items() if k in prompt.input_variables and k != document_variable_name}
    value = prompt.invoke({**values, document_variable_name: CONTEXT_PLACEHOLDER})
    return value, chunks


def documents_prefix(
    llm: ChatCacheBlend | CacheBlendLLM, prompt: BasePromptTemplate, document_variable_name: str
) -> str:
    """The text before the documents, as the model sees it (the cache key's prefix). PromptError when it depends
    on the question or another variable: no request would read KV precomputed for it."""
    _check_model(llm)
    others = [v for v in prompt.input_variables if v != document_variable_name]
    to_text: Callable[[PromptValue], str] = _as_string
    if isinstance(llm, ChatCacheBlend):
        tokenizer = llm.get_engine().tokenizer
        to_text = lambda value: render_messages(tokenizer, value.to_messages())  # noqa: E731
    render = _renderer(prompt, document_variable_name, to_text)
    return question_free_prefix(render, question=f"{others}")


def precompute_documents(
    llm: ChatCacheBlend | CacheBlendLLM,
    prompt: BasePromptTemplate,
    documents: Sequence[Document],
    *,
    document_prompt: BasePromptTemplate | None = None,
    document_variable_name: str = "context",
) -> tuple[int, int]:
    """Compute each document's chunk KV ahead of the questions (e.g. right after indexing).

    Returns (already cached, newly computed). Later requests with this prompt find these chunks in the store.
    """
    doc_prompt = document_prompt or DEFAULT_DOCUMENT_PROMPT
    prefix = documents_prefix(llm, prompt, document_variable_name)
    chunks = document_chunks([format_document(doc, doc_prompt) for doc in documents])
    return llm.get_engine().precompute(chunks, prefix=prefix)


def create_blend_documents_chain(
    llm: ChatCacheBlend | CacheBlendLLM,
    prompt: BasePromptTemplate,
    *,
    output_parser: BaseOutputParser | None = None,
    document_prompt: BasePromptTemplate | None = None,
    document_variable_name: str = "context",
    mode: str | None = None,
    recompute_ratio: float | None = None,
) -> Runnable[dict[str, Any], Any]:
    """Like `create_stuff_documents_chain`, but each document reaches the model as its own cached chunk.

    The input is a dict with the documents under `document_variable_name` ("context") and the prompt's
    other variables; the output is the parsed answer (a string by default). Drop-in for
    `create_retrieval_chain(retriever, ...)`. The answer's message (before the parser) carries the request's
    metrics in `response_metadata["cacheblend"]`; a `CacheBlendMetricsHandler` callback collects them.
    """
    model = _check_model(llm)
    _check_prompt(prompt, document_variable_name)
    parser = output_parser or StrOutputParser()
    call_kwargs = {k: v for k, v in {"mode": mode, "recompute_ratio": recompute_ratio}.items() if v is not None}
    doc_prompt = document_prompt or DEFAULT_DOCUMENT_PROMPT

    def with_placeholder(inputs: dict[str, Any]) -> dict[str, Any]:
        values = {k: v for k, v in inputs.items() if k in prompt.input_variables and k != document_variable_name}
        return {**values, document_variable_name: CONTEXT_PLACEHOLDER}

    # dict -> the prompt rendered with the documents' placeholder (what the model splits the prompt at)
    placeholder_prompt = RunnableLambda(with_placeholder, name="documents_placeholder") | prompt

    def bind_documents(inputs: dict[str, Any]) -> Runnable[dict[str, Any], Any]:
        """The request for these documents: the prompt, then the model bound to the documents as its chunks.

        Returned as a runnable, LangChain runs it with the same input and call: `invoke` invokes the model,
        `stream` / `astream` / `astream_events` stream it token by token, as `create_stuff_documents_chain` does.
        """
        if document_variable_name not in inputs:
            raise KeyError(
                f"the chain's input needs the documents under {document_variable_name!r}, got keys {sorted(inputs)}"
            )
        chunks = document_chunks([format_document(doc, doc_prompt) for doc in inputs[document_variable_name]])
        return placeholder_prompt | model.bind(chunks=chunks, **call_kwargs)

    return (RunnableLambda(bind_documents, name="blend_documents") | parser).with_config(
        run_name="blend_documents_chain"
    )


class BlendStuffDocumentsChain(BaseCombineDocumentsChain):
    """Classic combine-documents chain: each document is its own cached chunk; metrics come back too.

    Example:
        ```python
        chain = BlendStuffDocumentsChain(llm=ChatCacheBlend(), prompt=prompt)
        out = chain.invoke({"input_documents": docs, "input": "Who wrote it?"})
        out["output_text"], out["cacheblend_metrics"]["chunks_hit"]
        ```
    """

    llm: ChatCacheBlend | CacheBlendLLM
    prompt: BasePromptTemplate
    document_prompt: BasePromptTemplate = Field(default_factory=lambda: DEFAULT_DOCUMENT_PROMPT)
    document_variable_name: str = "context"
    mode: str | None = None
    recompute_ratio: float | None = None

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    @model_validator(mode="after")
    def _validate_prompt(self) -> BlendStuffDocumentsChain:
        _check_prompt(self.prompt, self.document_variable_name)
        return self

    @property
    def input_keys(self) -> list[str]:
        extra = [k for k in self.prompt.input_variables if k != self.document_variable_name]
        return [self.input_key, *extra]

    @property
    def output_keys(self) -> list[str]:
        return [self.output_key, METRICS_KEY]

    @property
    def _chain_type(self) -> str:
        return "blend_stuff_documents_chain"

    def _request(self, docs: list[Document], kwargs: dict[str, Any]) -> tuple[PromptValue, dict[str, Any]]:
        value, chunks = render_documents_prompt(
            self.prompt,
            docs,
            kwargs,
            document_prompt=self.document_prompt,
            document_variable_name=self.document_variable_name,
        )
        call = {"chunks": chunks}
        if self.mode is not None:
            call["mode"] = self.mode
        if self.recompute_ratio is not None:
            call["recompute_ratio"] = self.recompute_ratio
        return value, call

    @staticmethod
    def _unpack(result: Any) -> tuple[str, dict]:
        generation = result.generations[0][0]
        info = generation.generation_info or {}
        return generation.text, {METRICS_KEY: info.get("cacheblend", {})}

    def combine_docs(self, docs: list[Document], callbacks: Callbacks = None, **kwargs: Any) -> tuple[str, dict]:
        """-> (answer, {"cacheblend_metrics": the request's RequestMetrics as a dict})."""
        value, call = self._request(docs, kwargs)
        return self._unpack(self.llm.generate_prompt([value], callbacks=callbacks, **call))

    async def acombine_docs(self, docs: list[Document], callbacks: Callbacks = None, **kwargs: Any) -> tuple[str, dict]:
        value, call = self._request(docs, kwargs)
        return self._unpack(await self.llm.agenerate_prompt([value], callbacks=callbacks, **call))

    def precompute(self, docs: Sequence[Document]) -> tuple[int, int]:
        """Compute the documents' chunk KV ahead of the questions. -> (already cached, newly computed)."""
        return precompute_documents(
            self.llm,
            self.prompt,
            docs,
            document_prompt=self.document_prompt,
            document_variable_name=self.document_variable_name,
        )
