"""One entry point for a retrieval chain over the same retriever and model with each way of using documents.

Strategies:
- "blend":      `create_blend_documents_chain`: one call, each document its own cached chunk (CacheBlend).
- "stuff":      LangChain's `create_stuff_documents_chain`: one call, the documents joined and prefilled whole.
- "map_reduce": what langchain-classic's `load_qa_chain(chain_type="map_reduce")` does, with its prompts: one
                call per document (a batch), then one over the extracts joined by blank lines. Written as LCEL
                so the final answer streams; the classic chain's collapse step (only reached when the extracts
                pass 3000 tokens) is not repeated: such extracts are refused by the model's length limit.
- "map_rerank": langchain-classic's `MapRerankDocumentsChain`: one call per document that answers and scores
                itself; the best-scored answer wins. Its stock parser raises when a reply lacks "Score: N",
                which small local models often omit, so a lenient `RegexParser` scores such replies 0 instead.
Every chain takes {"input": question} and returns {"input", "context" (the retrieved documents), "answer"},
the shape of `create_retrieval_chain`. "blend", "stuff" and "map_reduce" stream their answer token by token
(`stream`, `astream`, `astream_events`); "map_rerank" knows its answer only once every document is scored, so it
streams it whole (its calls' tokens still show as chat model stream events in `astream_events`).
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Literal

from langchain_classic.chains import create_retrieval_chain
from langchain_classic.chains.combine_documents import create_stuff_documents_chain
from langchain_classic.output_parsers.regex import RegexParser
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import BasePromptTemplate, ChatPromptTemplate, PromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda, RunnableParallel

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


def _map_reduce_chain(
    llm: ChatCacheBlend | CacheBlendLLM,
    map_prompt: BasePromptTemplate | None,
    combine_prompt: BasePromptTemplate | None,
) -> Runnable[dict[str, Any], str]:
    """{"context": documents, "input": question} -> the answer over the documents' extracts (streams)."""
    from langchain_classic.chains.question_answering import map_reduce_prompt

    question_prompt = map_prompt or map_reduce_prompt.QUESTION_PROMPT_SELECTOR.get_prompt(llm)
    extract = question_prompt | llm | StrOutputParser()

    def summaries(inputs: dict[str, Any], config: RunnableConfig) -> str:
        requests = [{"context": doc.page_content, "question": inputs["input"]} for doc in inputs["context"]]
        return "\n\n".join(extract.batch(requests, config))

    reduce_prompt = combine_prompt or map_reduce_prompt.COMBINE_PROMPT_SELECTOR.get_prompt(llm)
    combine_inputs = RunnableParallel(
        summaries=RunnableLambda(summaries, name="map"), question=RunnableLambda(lambda inputs: inputs["input"])
    )
    return (combine_inputs | reduce_prompt | llm | StrOutputParser()).with_config(run_name="map_reduce_chain")


def _map_rerank_chain(llm: ChatCacheBlend | CacheBlendLLM, rerank_prompt: BasePromptTemplate | None) -> Runnable:
    """{"context": documents, "input": question} -> the best-scored document's answer."""
    from langchain_classic.chains import LLMChain
    from langchain_classic.chains.combine_documents.map_rerank import MapRerankDocumentsChain
    from langchain_classic.chains.question_answering.map_rerank_prompt import PROMPT as MAP_RERANK_PROMPT

    template = rerank_prompt or MAP_RERANK_PROMPT
    prompt = PromptTemplate(
        template=template.template if isinstance(template, PromptTemplate) else str(template),
        input_variables=["context", "question"],
        output_parser=LenientScoreParser(),
    )
    with warnings.catch_warnings():  # the classic chains are deprecated upstream; this one is what is compared
        warnings.simplefilter("ignore", DeprecationWarning)
        chain = MapRerankDocumentsChain(
            llm_chain=LLMChain(llm=llm, prompt=prompt),
            document_variable_name="context",
            rank_key="score",
            answer_key="answer",
        )

    def combine(inputs: dict[str, Any], config: RunnableConfig) -> str:
        out = chain.invoke({"input_documents": inputs["context"], "question": inputs["input"]}, config)
        return out[chain.output_key]

    return RunnableLambda(combine).with_config(run_name="map_rerank_chain")


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
    if strategy == "map_reduce":
        return create_retrieval_chain(retriever, _map_reduce_chain(llm, map_prompt, combine_prompt))
    return create_retrieval_chain(retriever, _map_rerank_chain(llm, rerank_prompt))
