"""The models and chains on a tiny random model: each checked against the engine called directly.

The tiny tokenizer's chat template renders a user message as "user w3 <content> w4 " and ends with
"assistant w3 ", so the expected prefix and suffix around the documents are written out by hand here.
"""

from __future__ import annotations

import warnings

import pytest
from cacheblend_rag.errors import PromptError
from cacheblend_rag.frameworks import QuestionBeforeContextWarning
from langchain_core.documents import Document
from langchain_core.language_models import FakeListChatModel
from langchain_core.messages import HumanMessage
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate
from langchain_core.runnables import RunnableLambda

from langchain_cacheblend import (
    CONTEXT_PLACEHOLDER,
    BlendStuffDocumentsChain,
    CacheBlendLLM,
    CacheBlendMetricsHandler,
    ChatCacheBlend,
    build_rag_chain,
    create_blend_documents_chain,
    precompute_documents,
)
from langchain_cacheblend.chains import LenientScoreParser
from langchain_cacheblend.chat_models import render_messages

DOCS = [
    Document(page_content="w10 w11 w12 w13 w14 w15", metadata={"source": "a"}),
    Document(page_content="w20 w21 w22 w23", metadata={"source": "b"}),
    Document(page_content="w30 w31 w32 w33 w34", metadata={"source": "c"}),
]
PROMPT = ChatPromptTemplate.from_messages([("human", "w7 {context} w8 {input}")])


def test_chat_invoke_equals_engine_generate(engine):
    chat = ChatCacheBlend(engine=engine, max_tokens=5)
    message = chat.invoke("w5 w6")
    direct = engine.generate([], prefix="", suffix="user w3 w5 w6 w4 assistant w3 ", max_new_tokens=5)
    assert message.content == direct.text
    assert message.usage_metadata["output_tokens"] == 5
    assert message.usage_metadata["input_tokens"] == direct.metrics.prompt_tokens
    assert message.response_metadata["cacheblend"]["mode"] == "full"  # no chunks: a plain prefill
    served = message.response_metadata["cacheblend"]
    assert (served["device"], served["dtype"]) == (str(engine.device), engine.config.dtype)  # what served it


def test_stream_adds_up_to_invoke_with_metadata_once_on_the_last_chunk(engine):
    chat = ChatCacheBlend(engine=engine, max_tokens=6)
    chunks = list(chat.stream("w5 w6"))
    assert "".join(c.content for c in chunks) == chat.invoke("w5 w6").content
    assert chunks[-1].chunk_position == "last"
    assert [c.usage_metadata is not None for c in chunks].count(True) == 1
    assert chunks[-1].response_metadata["finish_reason"] == "length"
    assert chunks[-1].response_metadata["cacheblend"]["generated_tokens"] == 6


def test_max_tokens_per_call_overrides_the_default(engine):
    chat = ChatCacheBlend(engine=engine, max_tokens=8)
    assert chat.invoke("w5", max_tokens=3).usage_metadata["output_tokens"] == 3


def test_stop_sequence_cuts_the_answer_before_it(engine):
    chat = ChatCacheBlend(engine=engine, max_tokens=8)
    words = chat.invoke("w5 w6").content.split()
    assert len(words) >= 3
    stopped = chat.invoke("w5 w6", stop=[words[2]])
    assert words[2] not in stopped.content.split()
    assert stopped.response_metadata["finish_reason"] == "stop"
    assert ChatCacheBlend(engine=engine, max_tokens=8, stop=[words[2]]).invoke("w5 w6").content == stopped.content


def test_chunks_map_to_cached_entries_and_hit_on_reuse(engine):
    chat = ChatCacheBlend(engine=engine, max_tokens=2)
    text = f"w7 {CONTEXT_PLACEHOLDER} w8 w9"
    chunks = [d.page_content for d in DOCS]
    first = chat.invoke(text, chunks=chunks).response_metadata["cacheblend"]
    assert (first["chunks_hit"], first["chunks_missed"]) == (0, 3)
    again = chat.invoke(text, chunks=chunks[::-1]).response_metadata["cacheblend"]
    assert (again["chunks_hit"], again["chunks_missed"]) == (3, 0)  # any order: a chunk's KV is position-free
    assert (
        chat.invoke(text, chunks=chunks).usage_metadata["input_token_details"]["cache_read"] == again["reused_tokens"]
    )


def test_prompt_and_chunks_must_come_together(engine):
    chat = ChatCacheBlend(engine=engine, max_tokens=2)
    with pytest.raises(PromptError, match="placeholder"):
        chat.invoke("w7 w8", chunks=["w10"])
    with pytest.raises(PromptError, match="no chunks"):
        chat.invoke(f"w7 {CONTEXT_PLACEHOLDER} w8")
    with pytest.raises(PromptError, match="single string"):
        chat.invoke(f"w7 {CONTEXT_PLACEHOLDER} w8", chunks="w10")


def test_unknown_settings_are_errors(engine):
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'.*'temperature'"):
        ChatCacheBlend(engine=engine).invoke("w5", temprature=0.5)
    with pytest.raises(ValueError, match="no_such_setting"):
        ChatCacheBlend(engine=engine, no_such_setting=3)


def _metrics(model, **kwargs):
    """The 'cacheblend' metadata of one call on "w5", for the chat model and the LLM alike."""
    if isinstance(model, ChatCacheBlend):
        return model.invoke("w5", **kwargs).response_metadata["cacheblend"]
    return model.generate(["w5"], **kwargs).generations[0][0].generation_info["cacheblend"]


@pytest.mark.parametrize("model_class", [ChatCacheBlend, CacheBlendLLM])
def test_max_new_tokens_is_the_setting_and_max_tokens_its_alias(engine, model_class):
    # One name in both integrations (the engine's); LangChain's standard max_tokens keeps working everywhere.
    model = model_class(engine=engine, max_new_tokens=3)
    assert model.max_new_tokens == model.max_tokens == 3 and model._get_ls_params()["ls_max_tokens"] == 3
    assert _metrics(model)["generated_tokens"] == 3
    alias = model_class(engine=engine, max_tokens=4)
    assert alias.max_new_tokens == 4 and "max_tokens" not in alias.model_dump()
    alias.max_tokens = 2
    assert alias.max_new_tokens == 2 and _metrics(alias)["generated_tokens"] == 2
    assert _metrics(alias, max_new_tokens=1)["generated_tokens"] == _metrics(alias, max_tokens=1)["generated_tokens"]
    with pytest.raises(ValueError, match="max_tokens and max_new_tokens set the same thing"):
        model_class(engine=engine, max_tokens=4, max_new_tokens=5)


def test_response_metadata_is_compact_unless_detailed_metrics(engine):
    layers = engine.lm.shape.num_layers
    compact = ChatCacheBlend(engine=engine, max_new_tokens=2).invoke("w5").response_metadata["cacheblend"]
    assert "recomputed_per_layer" not in compact
    assert {"recomputed_tokens", "compute_share", "ttft_s", "chunks_hit"} <= set(compact)
    chat = ChatCacheBlend(engine=engine, max_new_tokens=2, detailed_metrics=True)
    assert len(chat.invoke("w5").response_metadata["cacheblend"]["recomputed_per_layer"]) == layers
    streamed = list(chat.stream("w5"))[-1].response_metadata["cacheblend"]
    assert len(streamed["recomputed_per_layer"]) == layers
    assert "recomputed_per_layer" not in _metrics(CacheBlendLLM(engine=engine, max_new_tokens=2))
    detailed = _metrics(CacheBlendLLM(engine=engine, max_new_tokens=2, detailed_metrics=True))
    assert len(detailed["recomputed_per_layer"]) == layers


def test_non_text_content_is_refused(engine):
    image = HumanMessage(content=[{"type": "image", "url": "https://example.com/x.png"}])
    with pytest.raises(PromptError, match="text only"):
        ChatCacheBlend(engine=engine).invoke([image])


def test_timeout_stops_a_long_generation(engine):
    with pytest.raises(TimeoutError, match="timeout"):
        ChatCacheBlend(engine=engine, max_tokens=50, timeout=1e-9).invoke("w5")


def test_llm_reports_usage_and_metrics(engine):
    llm = CacheBlendLLM(engine=engine, max_tokens=4)
    result = llm.generate(["w5 w6", "w7"])
    assert result.llm_output["token_usage"]["output_tokens"] == 8
    info = result.generations[0][0].generation_info
    assert info["usage"]["output_tokens"] == 4 and info["cacheblend"]["generated_tokens"] == 4
    direct = engine.generate([], prefix="", suffix="w5 w6", max_new_tokens=4)
    assert result.generations[0][0].text == direct.text
    assert "".join(llm.stream("w5 w6")) == direct.text


def test_llm_takes_chunks_at_the_placeholder(engine):
    llm = CacheBlendLLM(engine=engine, max_tokens=3)
    chunks = [d.page_content for d in DOCS]
    text = llm.invoke(f"w7 {CONTEXT_PLACEHOLDER} w8", chunks=chunks)
    assert text == engine.generate(chunks, prefix="w7 ", suffix=" w8", max_new_tokens=3).text


def test_messages_without_chat_template_become_role_lines(engine_without_chat_template):
    tok = engine_without_chat_template.tokenizer
    assert render_messages(tok, [HumanMessage("w5")]).text == "User: w5\nAssistant:"


def test_blend_documents_chain_equals_engine_with_documents_as_chunks(engine):
    chat = ChatCacheBlend(engine=engine, max_tokens=4)
    chain = create_blend_documents_chain(chat, PROMPT)
    answer = chain.invoke({"context": DOCS, "input": "w9"})
    direct = engine.generate(
        [d.page_content for d in DOCS], prefix="user w3 w7 ", suffix=" w8 w9 w4 assistant w3 ", max_new_tokens=4
    )
    assert answer == direct.text


def test_blend_documents_chain_formats_documents_with_the_document_prompt(engine):
    chat = ChatCacheBlend(engine=engine, max_tokens=3)
    doc_prompt = PromptTemplate.from_template("w40 {page_content}")
    chain = create_blend_documents_chain(chat, PROMPT, document_prompt=doc_prompt)
    chunks = [f"w40 {d.page_content}" for d in DOCS]
    direct = engine.generate(chunks, prefix="user w3 w7 ", suffix=" w8 w9 w4 assistant w3 ", max_new_tokens=3)
    assert chain.invoke({"context": DOCS, "input": "w9"}) == direct.text


def test_blend_documents_chain_drops_into_create_retrieval_chain(engine):
    from langchain_classic.chains import create_retrieval_chain

    retriever = RunnableLambda(lambda question: DOCS)
    chat = ChatCacheBlend(engine=engine, max_tokens=3)
    out = create_retrieval_chain(retriever, create_blend_documents_chain(chat, PROMPT)).invoke({"input": "w9"})
    assert out["context"] == DOCS
    assert out["answer"] == create_blend_documents_chain(chat, PROMPT).invoke({"context": DOCS, "input": "w9"})


def test_classic_blend_chain_returns_answer_and_metrics(engine):
    chat = ChatCacheBlend(engine=engine, max_tokens=3)
    chain = BlendStuffDocumentsChain(llm=chat, prompt=PROMPT)
    assert chain.precompute(DOCS) == (0, 3)
    out = chain.invoke({"input_documents": DOCS, "input": "w9"})
    assert out["output_text"] == create_blend_documents_chain(chat, PROMPT).invoke({"context": DOCS, "input": "w9"})
    assert out["cacheblend_metrics"]["chunks_hit"] == 3


def test_precompute_uses_the_prefix_requests_use(engine):
    chat = ChatCacheBlend(engine=engine, max_tokens=2)
    assert precompute_documents(chat, PROMPT, DOCS) == (0, 3)
    handler = CacheBlendMetricsHandler()
    create_blend_documents_chain(chat, PROMPT).invoke({"context": DOCS, "input": "w9"}, {"callbacks": [handler]})
    assert [c.metrics["chunks_hit"] for c in handler.calls] == [3]


def test_question_before_the_documents_warns_answers_and_reuses_nothing(engine):
    """The policy both framework packages share (cacheblend_rag.frameworks): such a prompt is accepted with a
    QuestionBeforeContextWarning, every question answers but computes its chunks anew, and precomputing is refused."""
    chat = ChatCacheBlend(engine=engine, max_tokens=2)
    late = ChatPromptTemplate.from_messages([("human", "w7 {input} w8 {context}")])
    with pytest.warns(QuestionBeforeContextWarning, match="Put the question after the documents"):
        chain = create_blend_documents_chain(chat, late)
    handler = CacheBlendMetricsHandler()
    for question in ("w20", "w21"):
        chain.invoke({"context": DOCS, "input": question}, {"callbacks": [handler]})
    assert [(c.metrics["chunks_hit"], c.metrics["chunks_missed"]) for c in handler.calls] == [(0, 3), (0, 3)]
    with pytest.raises(PromptError, match="cannot precompute"):
        precompute_documents(chat, late, DOCS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        create_blend_documents_chain(chat, PROMPT)


def test_chain_needs_the_documents_variable_and_a_cacheblend_model(engine):
    with pytest.raises(ValueError, match="context"):
        create_blend_documents_chain(ChatCacheBlend(engine=engine), ChatPromptTemplate.from_template("{input}"))
    with pytest.raises(TypeError, match="create_stuff_documents_chain"):
        create_blend_documents_chain(FakeListChatModel(responses=["x"]), PROMPT)


def test_lenient_score_parser_ranks_a_reply_without_score_last():
    parser = LenientScoreParser()
    assert parser.parse("Helpful Answer: Exeter College\nScore: 80") == {"answer": "Exeter College", "score": "80"}
    assert parser.parse("I think it is Oxford.") == {"answer": "I think it is Oxford.", "score": "0"}
    echoed = "Question: Where?\nHelpful Answer: southern maryland\nScore: 1"
    assert parser.parse(echoed) == {"answer": "southern maryland", "score": "1"}
    assert parser.parse("Helpful Answer:\nScore: 100") == {"answer": "", "score": "0"}


@pytest.mark.parametrize("strategy", ["blend", "stuff", "map_reduce", "map_rerank"])
def test_every_strategy_answers_through_one_entry_point(engine, strategy):
    chat = ChatCacheBlend(engine=engine, max_tokens=3)
    handler = CacheBlendMetricsHandler()
    chain = build_rag_chain(RunnableLambda(lambda q: DOCS), chat, strategy, prompt=PROMPT)
    out = chain.invoke({"input": "w9"}, {"callbacks": [handler]})
    assert isinstance(out["answer"], str) and out["context"] == DOCS
    expected_calls = {"blend": 1, "stuff": 1, "map_reduce": len(DOCS) + 1, "map_rerank": len(DOCS)}[strategy]
    assert len(handler.calls) == expected_calls
    chunked = [c.metrics["chunks_hit"] + c.metrics["chunks_missed"] for c in handler.calls]
    assert chunked == ([len(DOCS)] if strategy == "blend" else [0] * expected_calls)


def test_unknown_strategy_is_an_error(engine):
    with pytest.raises(ValueError, match="strategy must be one of"):
        build_rag_chain(RunnableLambda(lambda q: DOCS), ChatCacheBlend(engine=engine), "refine")
