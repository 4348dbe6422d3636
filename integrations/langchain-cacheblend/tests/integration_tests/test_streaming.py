"""The blend documents chain inside `create_retrieval_chain` streams a real model's answer token by token.

SmolLM2-135M answers in several tokens; each must reach the caller as its own piece (sync, async and as
chat model stream events), and the pieces must add up to what `invoke` returns.
"""

from __future__ import annotations

import pytest
from langchain_classic.chains import create_retrieval_chain
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda

from langchain_cacheblend import ChatCacheBlend, create_blend_documents_chain

pytestmark = pytest.mark.real_model

DOCS = [
    Document(page_content="Zorbania is a kingdom in the northern mountains. Its capital is Quillton."),
    Document(page_content="Quillton was founded in 1204 on the river Vess by King Arvel."),
]
PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer from the passages."), ("human", "Passages:\n{context}\nQuestion: {input}")]
)
QUESTION = {"input": "Who founded Quillton, and when?"}


@pytest.fixture(scope="module")
def rag(fast_engine):
    chat = ChatCacheBlend(engine=fast_engine, max_tokens=12)
    return create_retrieval_chain(RunnableLambda(lambda question: DOCS), create_blend_documents_chain(chat, PROMPT))


def answer_pieces(outputs: list[dict]) -> list[str]:
    return [out["answer"] for out in outputs if "answer" in out]


def test_blend_chain_in_a_retrieval_chain_streams_the_answer_in_pieces(rag):
    # Warm first: a cold request answers with a full prefill (the engine's miss policy), a warm one blends, and
    # the two may word the answer differently; streaming and invoking must agree on the same warm request.
    rag.invoke(QUESTION)
    pieces = answer_pieces(list(rag.stream(QUESTION)))
    assert len([p for p in pieces if p]) > 1
    assert "".join(pieces) == rag.invoke(QUESTION)["answer"]


async def test_blend_chain_in_a_retrieval_chain_streams_the_answer_in_pieces_async(rag):
    pieces = answer_pieces([out async for out in rag.astream(QUESTION)])
    assert len([p for p in pieces if p]) > 1
    assert "".join(pieces) == (await rag.ainvoke(QUESTION))["answer"]


async def test_astream_events_emit_a_chat_model_stream_event_per_token(rag):
    events = [e async for e in rag.astream_events(QUESTION, version="v2")]
    tokens = [e["data"]["chunk"].content for e in events if e["event"] == "on_chat_model_stream"]
    answers = [
        e["data"]["chunk"].get("answer") for e in events if e["event"] == "on_chain_stream" and not e["parent_ids"]
    ]
    answers = [a for a in answers if a]
    assert len([t for t in tokens if t]) > 1
    assert len(answers) > 1  # the chain's own output streams too, not only its model's
    assert "".join(tokens) == "".join(answers) == rag.invoke(QUESTION)["answer"]
