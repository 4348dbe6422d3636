"""Streaming through the documents chains on the tiny model: token by token, sync and async, adding up to invoke.

The tiny model never stops early (EOS muted), so an answer of `max_tokens` tokens arrives as `max_tokens` text
pieces plus the empty last piece that carries the request's metadata.
"""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda

from langchain_cacheblend import BlendStuffDocumentsChain, CacheBlendLLM, ChatCacheBlend, build_rag_chain
from langchain_cacheblend.chains import STRATEGIES

DOCS = [Document(page_content="w10 w11 w12 w13"), Document(page_content="w20 w21 w22")]
PROMPT = ChatPromptTemplate.from_messages([("human", "w7 {context} w8 {input}")])
TOKENS = 4


def answer_pieces(outputs: list[dict]) -> list[str]:
    return [out["answer"] for out in outputs if "answer" in out]


# (map_reduce's stock completion prompts, long few-shot texts, do not fit the tiny model's 512 positions)
@pytest.mark.parametrize(
    ("model_class", "strategy"),
    [(ChatCacheBlend, "blend"), (ChatCacheBlend, "stuff"), (ChatCacheBlend, "map_reduce"), (CacheBlendLLM, "blend")],
)
def test_strategies_stream_the_answer_token_by_token_and_add_up_to_invoke(engine, model_class, strategy):
    llm = model_class(engine=engine, max_tokens=TOKENS)
    chain = build_rag_chain(RunnableLambda(lambda question: DOCS), llm, strategy, prompt=PROMPT)
    pieces = answer_pieces(list(chain.stream({"input": "w9"})))
    assert len([p for p in pieces if p]) == TOKENS
    assert "".join(pieces) == chain.invoke({"input": "w9"})["answer"]


async def test_blend_strategy_streams_token_by_token_async(engine):
    chain = build_rag_chain(RunnableLambda(lambda question: DOCS), ChatCacheBlend(engine=engine, max_tokens=TOKENS))
    pieces = answer_pieces([out async for out in chain.astream({"input": "w9"})])
    assert len([p for p in pieces if p]) == TOKENS
    assert "".join(pieces) == (await chain.ainvoke({"input": "w9"}))["answer"]


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_every_strategy_emits_chat_model_stream_events_per_token(engine, strategy):
    chat = ChatCacheBlend(engine=engine, max_tokens=TOKENS)
    chain = build_rag_chain(RunnableLambda(lambda question: DOCS), chat, strategy, prompt=PROMPT)
    events = [e async for e in chain.astream_events({"input": "w9"}, version="v2")]
    tokens = [e for e in events if e["event"] == "on_chat_model_stream" and e["data"]["chunk"].content]
    calls = {"blend": 1, "stuff": 1, "map_reduce": len(DOCS) + 1, "map_rerank": len(DOCS)}[strategy]
    assert len(tokens) == TOKENS * calls


async def test_classic_blend_chain_streams_tokens_as_events(engine):
    """A classic chain's `stream` gives its output dict whole (as LangChain's StuffDocumentsChain does); its
    model's tokens still arrive one by one as chat model stream events."""
    chat = ChatCacheBlend(engine=engine, max_tokens=TOKENS)
    chain = BlendStuffDocumentsChain(llm=chat, prompt=PROMPT)
    inputs = {"input_documents": DOCS, "input": "w9"}
    events = [e async for e in chain.astream_events(inputs, version="v2")]
    tokens = [e["data"]["chunk"].content for e in events if e["event"] == "on_chat_model_stream"]
    assert len([t for t in tokens if t]) == TOKENS
    assert "".join(tokens) == chain.invoke(inputs)["output_text"]


async def test_abatch_and_gather_decode_together_and_answer_as_serial_calls(engine):
    questions = [f"w{30 + i} w{40 + i}" for i in range(6)]
    chat = ChatCacheBlend(engine=engine, max_tokens=5)
    llm = CacheBlendLLM(engine=engine, max_tokens=5)
    serial_chat = [chat.invoke(q).content for q in questions]
    serial_llm = [llm.invoke(q) for q in questions]
    batched = [m.content for m in await chat.abatch(questions)]
    gathered = [m.content for m in await asyncio.gather(*(chat.ainvoke(q) for q in questions))]
    llm_batched = await llm.abatch(questions)
    assert batched == gathered == serial_chat
    assert llm_batched == serial_llm
    assert engine.scheduler.largest_batch > 1  # the calls really overlapped in the engine


async def test_concurrent_astreams_add_up_to_their_invoke(engine):
    chat = ChatCacheBlend(engine=engine, max_tokens=TOKENS)
    questions = [f"w{50 + i}" for i in range(4)]

    async def streamed(q: str) -> str:
        return "".join([chunk.content async for chunk in chat.astream(q)])

    assert await asyncio.gather(*(streamed(q) for q in questions)) == [chat.invoke(q).content for q in questions]
