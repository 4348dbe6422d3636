"""Inputs the framework passes that the engine refuses: the LangChain package treats them as the LlamaIndex one
does, through the one check both share (`cacheblend_rag.frameworks`)."""

from __future__ import annotations

import pytest
from cacheblend_rag.errors import ConfigError, PromptError
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from pydantic import ValidationError

from langchain_cacheblend import CacheBlendLLM, ChatCacheBlend, create_blend_documents_chain, precompute_documents

DOCS = [
    Document(page_content="w10 w11 w12 w13 w14 w15", metadata={"source": "a"}),
    Document(page_content="w20 w21 w22 w23", metadata={"source": "b"}),
]
PROMPT = ChatPromptTemplate.from_messages([("human", "w7 {context} w8 {input}")])


def test_an_empty_retrieved_document_is_left_out_and_the_chain_answers(engine):
    chain = create_blend_documents_chain(ChatCacheBlend(engine=engine, max_tokens=4), PROMPT)
    blank = [DOCS[0], Document(page_content="  \n"), DOCS[1], Document(page_content="")]
    assert chain.invoke({"context": blank, "input": "w9"}) == chain.invoke({"context": DOCS, "input": "w9"})
    assert sum(precompute_documents(ChatCacheBlend(engine=engine), PROMPT, blank)) == 2  # the two with text


def test_a_lone_surrogate_in_a_chat_message_is_a_prompt_error_naming_the_message(engine):
    with pytest.raises(PromptError, match=r"user message 0 holds '\\ud800'"):
        ChatCacheBlend(engine=engine, max_tokens=2).invoke("w5 \ud800")


@pytest.mark.parametrize("model_class", [ChatCacheBlend, CacheBlendLLM])
def test_a_stop_that_is_not_text_is_the_engines_config_error(engine, model_class):
    with pytest.raises(ConfigError, match="stop must be a string, a list of strings or None, got int"):
        model_class(engine=engine, max_tokens=2).invoke("w5", stop=5)


@pytest.mark.parametrize("ratio", [2.0, float("nan"), -0.1])
def test_an_out_of_range_ratio_is_refused_where_the_model_is_built(engine, ratio):
    with pytest.raises(ValidationError, match=r"recompute_ratio must be in \[0, 1\]"):
        ChatCacheBlend(engine=engine, recompute_ratio=ratio)
