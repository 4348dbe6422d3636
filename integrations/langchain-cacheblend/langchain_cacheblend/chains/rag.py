"""One entry point for a retrieval chain over the same retriever and model with each way of using documents.

Strategies:
- "blend":      `create_blend_documents_chain`: one call, each document its own cached chunk (CacheBlend).
- "stuff":      LangChain's `create_stuff_documents_chain`: one call, the documents joined and prefilled whole.
- "map_reduce": langchain-classic's `MapReduceDocumentsChain` (`load_qa_chain(chain_type="map_reduce")`): one
                call per document, then one over the extracts.
- "map_rerank": langchain-classic's `MapRerankDocumentsChain`: one call per document that answers and scores
                itself; the best-scored answer wins. Its stock parser raises when a reply lacks "Score: N",
                which small local models often omit, so a lenient `RegexParser` scores such replies 0 instead.
Every chain takes {"input": question} and returns {"input", "context" (the retrieved documents), "answer"},
the shape of `create_retrieval_chain`.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Literal

from langchain_classic.chains import create_retrieval_chain
from langchain_classic.chains.combine_documents import create_stuff_documents_chain
from langchain_classic.chains.combine_documents.base import BaseCombineDocumentsChain
from langchain_classic.output_parsers.regex import RegexParser
from langchain_core.prompts import BasePromptTemplate, ChatPromptTemplate, PromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda

from ..chat_models import ChatCacheBlend
from ..llms import CacheBlendLLM
from .blend_documents import create_blend_documents_chain

Strategy = Literal["blend", "stuff", "map_reduce", "map_rerank"]
STRATEGIES: tuple[str, ...] = ("blend", "stuff", "map_reduce", "map_rerank")

# The question after the documents: the text before them is then the same for every question, so each
# document's cached KV is reused (see create_blend_documents_chain).
DEFAULT_QA_PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "You are a helpful assistant. Answer the question from the passages given."),
        ("human", "Passages:\n{context}\nQuestion: {input}\nAnswer briefly, from the passages above."),
    ]
)


class LenientScoreParser(RegexParser):
    """map_rerank's "answer + Score: N" parser, for replies of small models.

    The stock parser raises on a reply without "Score: N" and the whole chain fails; here such a reply scores
    0, which ranks it last, as the missing score means. Small models also echo the prompt's format
    ("Question: ...\nHelpful Answer: ...\nScore: ..."): the answer is what follows the last "Answer:", and an
    empty answer scores 0 whatever score it claims.
    """

    regex: str = r"(?s)(.*?)\n?\s*Score:\s*(\d+)"
    output_keys: list[str] = ["answer", "score"]

    def parse(self, text: str) -> dict[str, str]:
        match = re.search(self.regex, text)
        body, score = (match.group(1), match.group(2)) if match else (text, "0")
        answer = re.split(r"(?:Helpful Answer|Answer):", body)[-1].strip()
        return {"answer": answer, "score": score if answer else "0"}


def _classic_chain(
    llm: ChatCacheBlend | CacheBlendLLM,
    strategy: str,
    map_prompt: BasePromptTemplate | None,
    combine_prompt: BasePromptTemplate | None,
    rerank_prompt: BasePromptTemplate | None,
) -> BaseCombineDocumentsChain:
    from langchain_classic.chains import LLMChain
    from langchain_classic.chains.combine_documents.map_rerank import MapRerankDocumentsChain
    from langchain_classic.chains.question_answering import load_qa_chain
    from langchain_classic.chains.question_answering.map_rerank_prompt import PROMPT as MAP_RERANK_PROMPT

    if strategy == "map_reduce":
        kwargs: dict[str, Any] = {}
        if map_prompt is not None:
            kwargs["question_prompt"] = map_prompt
        if combine_prompt is not None:
            kwargs["combine_prompt"] = combine_prompt
        return load_qa_chain(llm, chain_type="map_reduce", **kwargs)
    template = rerank_prompt or MAP_RERANK_PROMPT
    prompt = PromptTemplate(
        template=template.template if isinstance(template, PromptTemplate) else str(template),
        input_variables=["context", "question"],
        output_parser=LenientScoreParser(),
    )
    return MapRerankDocumentsChain(
        llm_chain=LLMChain(llm=llm, prompt=prompt),
        document_variable_name="context",
        rank_key="score",
        answer_key="answer",
    )


def build_rag_chain(
    retriever: BaseRetriever,
    llm: ChatCacheBlend | CacheBlendLLM,
    strategy: Strategy = "blend",
    *,
    prompt: BasePromptTemplate | None = None,
    map_prompt: BasePromptTemplate | None = None,
    combine_prompt: BasePromptTemplate | None = None,
    rerank_prompt: PromptTemplate | None = None,
) -> Runnable[dict[str, Any], dict[str, Any]]:
    """A retrieval chain: {"input": question} -> {"input", "context", "answer"}.

    `prompt` (variables {context} and {input}) is used by "blend" and "stuff"; "map_reduce" takes
    `map_prompt` ({context}, {question}) and `combine_prompt` ({summaries}, {question}), "map_rerank"
    `rerank_prompt` ({context}, {question}, asking for "Score: N"); each defaults to langchain-classic's own.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    qa_prompt = prompt or DEFAULT_QA_PROMPT
    if strategy == "blend":
        return create_retrieval_chain(retriever, create_blend_documents_chain(llm, qa_prompt))
    if strategy == "stuff":
        return create_retrieval_chain(retriever, create_stuff_documents_chain(llm, qa_prompt))

    with warnings.catch_warnings():  # the classic chains are deprecated upstream; they are what is compared
        warnings.simplefilter("ignore", DeprecationWarning)
        chain = _classic_chain(llm, strategy, map_prompt, combine_prompt, rerank_prompt)

    def combine(inputs: dict[str, Any], config: RunnableConfig) -> str:
        out = chain.invoke({"input_documents": inputs["context"], "question": inputs["input"]}, config)
        return out[chain.output_key]

    return create_retrieval_chain(retriever, RunnableLambda(combine).with_config(run_name=f"{strategy}_chain"))
