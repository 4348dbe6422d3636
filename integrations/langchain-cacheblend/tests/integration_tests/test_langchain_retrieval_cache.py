"""A retrieval chain over FAISS + the packaged all-MiniLM-L6-v2 on the fast test model.

The second question retrieves documents the first one already used: their chunk KV must come from the cache,
and the chain's answer must equal what the engine gives when called directly with the same chunks.
"""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate

from langchain_cacheblend import (
    CacheBlendMetricsHandler,
    ChatCacheBlend,
    build_faiss_index,
    build_rag_chain,
    load_faiss_index,
    packaged_embeddings,
    save_faiss_index,
)
from langchain_cacheblend.chains import STRATEGIES

DOCS = [
    Document(
        page_content="Zorbania is a kingdom in the northern mountains. Its capital is Quillton.",
        metadata={"name": "geo"},
    ),
    Document(
        page_content="Quillton was founded in 1204 on the river Vess by King Arvel.", metadata={"name": "history"}
    ),
    Document(page_content="Zorbania exports wool, copper and a blue cheese called vessa.", metadata={"name": "trade"}),
    Document(
        page_content="Ice rowing is the national sport of Zorbania, played on frozen lakes.", metadata={"name": "sport"}
    ),
]
PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Answer the question from the passages, in a few words."),
        ("human", "Passages:\n{context}\nQuestion: {input}"),
    ]
)


@pytest.fixture(scope="module")
def store():
    return build_faiss_index(DOCS, embeddings=packaged_embeddings())


def test_second_question_hits_the_chunk_cache_and_equals_the_engine(fast_engine, store):
    from cacheblend_rag import MemoryStore

    fast_engine.store = MemoryStore()  # an empty cache, so the first question's misses are its own
    chat = ChatCacheBlend(engine=fast_engine, max_tokens=16)
    chain = build_rag_chain(store.as_retriever(search_kwargs={"k": 2}), chat, "blend", prompt=PROMPT)
    handler = CacheBlendMetricsHandler()

    first = chain.invoke({"input": "What is the capital of Zorbania?"}, {"callbacks": [handler]})
    second = chain.invoke({"input": "When was the capital of Zorbania founded?"}, {"callbacks": [handler]})
    first_ids = {d.metadata["name"] for d in first["context"]}
    second_ids = {d.metadata["name"] for d in second["context"]}
    shared = first_ids & second_ids
    assert shared, f"the questions should retrieve overlapping documents, got {first_ids} and {second_ids}"

    m1, m2 = handler.calls[0].metrics, handler.calls[1].metrics
    assert (m1["chunks_hit"], m1["chunks_missed"]) == (0, 2)
    assert m2["chunks_hit"] == len(shared) and m2["chunks_missed"] == 2 - len(shared)
    assert m2["hits_by_tier"] == {"memory": len(shared)}

    # The engine directly: the prompt rendered by the tokenizer's chat template, split around the documents.
    mark = "@@DOCS@@"
    messages = PROMPT.invoke({"context": mark, "input": second["input"]}).to_messages()
    turns = [{"role": {"system": "system", "human": "user"}[m.type], "content": m.content} for m in messages]
    text = fast_engine.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    prefix, suffix = text.split(mark)
    direct = fast_engine.generate(
        [d.page_content for d in second["context"]], prefix=prefix, suffix=suffix, max_new_tokens=16
    )
    assert second["answer"] == direct.text
    assert direct.metrics.chunks_hit == 2


def test_saved_index_of_packaged_embeddings_retrieves_the_same(store, tmp_path):
    save_faiss_index(store, tmp_path)
    loaded = load_faiss_index(tmp_path)
    question = "What does Zorbania export?"
    assert [d.id for d in loaded.similarity_search(question, k=2)] == [
        d.id for d in store.similarity_search(question, k=2)
    ]
    assert loaded.similarity_search(question, k=1)[0].metadata["name"] == "trade"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_strategy_answers_over_the_same_retriever(fast_engine, store, strategy):
    chat = ChatCacheBlend(engine=fast_engine, max_tokens=8)
    chain = build_rag_chain(store.as_retriever(search_kwargs={"k": 2}), chat, strategy, prompt=PROMPT)
    out = chain.invoke({"input": "What is the capital of Zorbania?"})
    assert out["context"][0].metadata["name"] == "geo"
    assert isinstance(out["answer"], str) and out["answer"].strip()
