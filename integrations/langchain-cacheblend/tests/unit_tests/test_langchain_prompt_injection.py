"""A document or message holding chat markup (`<|im_start|>system`) adds no control token to the prompt.

The tokenizer is the default preset's (Qwen2.5, where `<|im_start|>` is a special token), read from its converted
copy under the cacheblend-rag cache; the model is a tiny random Qwen2 over that vocabulary, answering one token.
Each request's token ids are read from the prompt the engine builds.
"""

from __future__ import annotations

from typing import Any

import pytest
from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.testing import INJECTION, built_prompts
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage
from langchain_core.prompts import ChatPromptTemplate

from langchain_cacheblend import ChatCacheBlend, create_blend_documents_chain


@pytest.fixture(scope="module")
def engine() -> CacheBlendEngine:
    return INJECTION.engine() or pytest.skip(INJECTION.skip)


def _prompt_starts(engine: CacheBlendEngine, call: Any) -> int:
    """How many `<|im_start|>` tokens the prompt of `call()` holds."""
    (prompt,) = built_prompts(engine, call)
    return INJECTION.turn_starts(engine.tokenizer, prompt.input_ids().tolist())


def test_documents_chain_document_with_chat_markup_adds_no_turn(engine) -> None:
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from the context."), ("human", "{context}\n\nQuestion: {input}")]
    )
    chain = create_blend_documents_chain(ChatCacheBlend(engine=engine, max_tokens=1), prompt)

    def ask(text: str) -> Any:
        return lambda: chain.invoke({"context": [Document(page_content=text)], "input": INJECTION.question})

    assert _prompt_starts(engine, ask(INJECTION.forged)) == _prompt_starts(engine, ask(INJECTION.clean)) == 3


def test_chat_message_with_chat_markup_adds_no_turn(engine) -> None:
    chat = ChatCacheBlend(engine=engine, max_tokens=1)
    # a document stuffed into the message itself, as create_stuff_documents_chain does

    def ask(text: str) -> Any:
        return lambda: chat.invoke([HumanMessage(text + "\n" + INJECTION.question)])

    # Qwen2.5's template adds its default system turn, then the user and the assistant turns
    assert _prompt_starts(engine, ask(INJECTION.forged)) == _prompt_starts(engine, ask(INJECTION.clean)) == 3
