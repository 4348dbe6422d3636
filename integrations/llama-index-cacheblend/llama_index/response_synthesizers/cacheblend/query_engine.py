"""One line from an index to a query engine answering in any mode: CacheBlend's or the framework's own.

`response_mode` is either an engine prefill mode ("blend", or "full", "prefix", "reuse" to compare), served by
`BlendSynthesizer`, or one of LlamaIndex's `ResponseMode`s ("compact", "refine", "tree_summarize",
"accumulate", ...), served by `get_response_synthesizer` on the same LLM, so every mode can be compared on the
same retriever, model and decoding settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cacheblend_rag import PrefillMode
from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.indices.base import BaseIndex
from llama_index.core.llms import LLM
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.response_synthesizers import BaseSynthesizer, ResponseMode, get_response_synthesizer
from llama_index.core.settings import Settings

from llama_index.response_synthesizers.cacheblend.base import BlendSynthesizer

ENGINE_MODES = tuple(m.value for m in PrefillMode)
FRAMEWORK_MODES = tuple(m.value for m in ResponseMode)


def get_blend_synthesizer(
    response_mode: str = "blend",
    *,
    llm: LLM | None = None,
    streaming: bool = False,
    text_qa_template: BasePromptTemplate | None = None,
    recompute_ratio: float | None = None,
    synthesizer_kwargs: Mapping[str, Any] | None = None,
) -> BaseSynthesizer:
    """A response synthesizer for `response_mode` (see the module docstring) on `llm` (default: Settings.llm).

    `synthesizer_kwargs` go to `get_response_synthesizer` (e.g. `refine_template`) for the framework's modes.
    """
    llm = llm if llm is not None else Settings.llm
    if response_mode in ENGINE_MODES:
        if synthesizer_kwargs:
            raise ValueError(f"synthesizer_kwargs apply to the framework's modes, not to {response_mode!r}")
        return BlendSynthesizer(
            llm=llm,
            mode=response_mode,
            text_qa_template=text_qa_template,
            recompute_ratio=recompute_ratio,
            streaming=streaming,
        )
    if response_mode not in FRAMEWORK_MODES:
        raise ValueError(
            f"unknown response_mode {response_mode!r}; CacheBlend's: {list(ENGINE_MODES)}, "
            f"LlamaIndex's: {list(FRAMEWORK_MODES)}"
        )
    if recompute_ratio is not None:
        raise ValueError(f"recompute_ratio applies to response_mode 'blend' only, got {response_mode!r}")
    return get_response_synthesizer(
        llm=llm,
        response_mode=ResponseMode(response_mode),
        streaming=streaming,
        text_qa_template=text_qa_template,
        **dict(synthesizer_kwargs or {}),
    )


def get_blend_query_engine(
    index: BaseIndex,
    response_mode: str = "blend",
    *,
    llm: LLM | None = None,
    streaming: bool = False,
    text_qa_template: BasePromptTemplate | None = None,
    recompute_ratio: float | None = None,
    synthesizer_kwargs: Mapping[str, Any] | None = None,
    precompute: bool = False,
    **kwargs: Any,
) -> BaseQueryEngine:
    """`index.as_query_engine(...)` answering in `response_mode`; other keyword arguments (e.g.
    `similarity_top_k`) go to `as_query_engine` and the retriever.

    With `precompute` (a blend mode only), the KV of every node in the index's docstore is computed and stored
    first (`BlendSynthesizer.precompute`), so the first queries read their nodes' KV instead of prefilling them.

    Example:
        query_engine = get_blend_query_engine(index, "blend", llm=llm, similarity_top_k=6, precompute=True)
        print(query_engine.query("Who wrote it?"))
    """
    llm = llm if llm is not None else Settings.llm
    synthesizer = get_blend_synthesizer(
        response_mode,
        llm=llm,
        streaming=streaming,
        text_qa_template=text_qa_template,
        recompute_ratio=recompute_ratio,
        synthesizer_kwargs=synthesizer_kwargs,
    )
    if precompute:
        if not isinstance(synthesizer, BlendSynthesizer):
            raise ValueError(
                f"precompute=True stores chunk KV for the blend modes {sorted(ENGINE_MODES)}, not for "
                f"{response_mode!r}, which reads none; drop precompute or use response_mode='blend'"
            )
        synthesizer.precompute(index.docstore.docs.values())
    return index.as_query_engine(llm=llm, response_synthesizer=synthesizer, **kwargs)
