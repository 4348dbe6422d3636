"""BlendSynthesizer: each retrieved node is one cached chunk; answers equal the engine's for the same nodes.

The real fast test model where the answer matters; LlamaIndex's MockLLM / MockEmbedding where it does not.
"""

from __future__ import annotations

import asyncio

import pytest
from cacheblend_rag.errors import PromptError
from cacheblend_rag.frameworks import QuestionBeforeContextWarning
from llama_index.core import MockEmbedding, VectorStoreIndex
from llama_index.core.base.response.schema import AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.llms import MockLLM
from llama_index.core.prompts import PromptTemplate
from llama_index.core.prompts.chat_prompts import CHAT_TEXT_QA_PROMPT
from llama_index.core.response_synthesizers import (
    Accumulate,
    CompactAndRefine,
    Refine,
    TreeSummarize,
    get_response_synthesizer,
)
from llama_index.core.response_synthesizers import BaseSynthesizer as FrameworkSynthesizer
from llama_index.core.schema import Document, TextNode
from llamaindex_testing import as_nodes, shared_llm, tiny_llm

from llama_index.llms.cacheblend import METRICS_KEY, CacheBlendLLM
from llama_index.response_synthesizers.cacheblend import BlendSynthesizer, get_blend_query_engine


@pytest.fixture
def llm() -> CacheBlendLLM:
    return shared_llm()


MARK = "\x00context\x00"

QUESTION = "Which river flows through the city of Lyon?"
PASSAGES = (
    "Lyon is a city in France at the confluence of the Rhone and the Saone rivers.",
    "The Loire is the longest river in France and flows into the Atlantic Ocean.",
    "Marseille is a port city on the Mediterranean coast of France.",
)


def framework_qa_prompt(llm: CacheBlendLLM, question: str) -> tuple[str, str]:
    """LlamaIndex's chat QA prompt as the tokenizer renders it, split where the context goes (built here
    independently of the synthesizer)."""
    messages = CHAT_TEXT_QA_PROMPT.format_messages(context_str=MARK, query_str=question)
    turns = [{"role": m.role.value, "content": m.content} for m in messages]
    text = llm.engine.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    prefix, suffix = text.split(MARK)
    return prefix, suffix


@pytest.mark.real_model
def test_blend_answer_equals_engine_direct_answer_for_the_same_nodes(llm: CacheBlendLLM) -> None:
    response = BlendSynthesizer(llm=llm).synthesize(QUESTION, as_nodes(*PASSAGES))
    prefix, suffix = framework_qa_prompt(llm, QUESTION)
    direct = llm.engine.generate(list(PASSAGES), prefix=prefix, suffix=suffix, mode="blend", max_new_tokens=16)
    assert isinstance(response, Response)
    assert response.response == direct.text
    assert response.response.strip()
    metrics = response.metadata[METRICS_KEY]
    assert metrics["mode"] == "blend"
    assert metrics["prompt_tokens"] == direct.metrics.prompt_tokens
    assert metrics["chunks_hit"] + metrics["chunks_missed"] == len(PASSAGES)
    assert [n.node.get_content() for n in response.source_nodes] == list(PASSAGES)


@pytest.mark.real_model
def test_full_mode_answer_equals_engine_full_prefill(llm: CacheBlendLLM) -> None:
    response = BlendSynthesizer(llm=llm, mode="full").synthesize(QUESTION, as_nodes(*PASSAGES))
    prefix, suffix = framework_qa_prompt(llm, QUESTION)
    direct = llm.engine.generate(list(PASSAGES), prefix=prefix, suffix=suffix, mode="full", max_new_tokens=16)
    assert response.response == direct.text
    assert response.metadata[METRICS_KEY]["mode"] == "full"


@pytest.mark.real_model
def test_second_query_over_overlapping_nodes_hits_the_chunk_cache(llm: CacheBlendLLM) -> None:
    # Texts no other test uses, so the counts start from an empty cache for them.
    a, b, c, d = (
        f"Fact {name}: the overlap test's {name} note says the number is {i * 7}." for i, name in enumerate("ABCD")
    )
    synthesizer = BlendSynthesizer(llm=llm)
    first = synthesizer.synthesize("What number does note B give?", as_nodes(a, b, c)).metadata[METRICS_KEY]
    assert (first["chunks_hit"], first["chunks_missed"]) == (0, 3)
    second = synthesizer.synthesize("What number does note D give?", as_nodes(c, b, d)).metadata[METRICS_KEY]
    assert (second["chunks_hit"], second["chunks_missed"]) == (2, 1)  # b and c, at other positions, reused
    assert second["reused_tokens"] > 0


@pytest.mark.real_model
def test_precompute_makes_the_first_query_a_full_hit(llm: CacheBlendLLM) -> None:
    nodes = as_nodes("Precomputed passage one: the bridge opened in 1894.", "Precomputed passage two: it is red.")
    synthesizer = BlendSynthesizer(llm=llm)
    assert synthesizer.precompute(nodes) == (0, 2)
    metrics = synthesizer.synthesize("When did the bridge open?", nodes).metadata[METRICS_KEY]
    assert (metrics["chunks_hit"], metrics["chunks_missed"]) == (2, 0)


@pytest.mark.real_model
def test_streaming_yields_the_same_text_as_non_streaming(llm: CacheBlendLLM) -> None:
    nodes = as_nodes(*PASSAGES)
    expected = BlendSynthesizer(llm=llm).synthesize(QUESTION, nodes).response
    streamed = BlendSynthesizer(llm=llm, streaming=True).synthesize(QUESTION, nodes)
    assert isinstance(streamed, StreamingResponse)
    pieces = list(streamed.response_gen)
    assert len(pieces) > 1
    assert "".join(pieces) == expected
    assert streamed.metadata[METRICS_KEY]["generated_tokens"] > 0  # filled in after the last token


@pytest.mark.real_model
def test_async_synthesis_matches_sync(llm: CacheBlendLLM) -> None:
    nodes = as_nodes(*PASSAGES)
    expected = BlendSynthesizer(llm=llm).synthesize(QUESTION, nodes).response

    async def run() -> tuple[Response, AsyncStreamingResponse, str]:
        plain = await BlendSynthesizer(llm=llm).asynthesize(QUESTION, nodes)
        stream = await BlendSynthesizer(llm=llm, streaming=True).asynthesize(QUESTION, nodes)
        text = "".join([t async for t in stream.async_response_gen()])
        return plain, stream, text

    plain, stream, text = asyncio.run(run())
    assert plain.response == text == expected
    assert plain.metadata[METRICS_KEY]["chunks_missed"] == 0
    assert stream.metadata[METRICS_KEY]["chunks_hit"] == len(PASSAGES)


@pytest.mark.real_model
def test_query_engine_in_one_line(llm: CacheBlendLLM) -> None:
    docs = [Document(text=t) for t in PASSAGES]
    index = VectorStoreIndex.from_documents(docs, embed_model=MockEmbedding(embed_dim=8))
    query_engine = index.as_query_engine(llm=llm, response_synthesizer=BlendSynthesizer(llm=llm), similarity_top_k=3)
    response = query_engine.query(QUESTION)
    assert len(response.source_nodes) == 3
    retrieved = [n.node.get_content() for n in response.source_nodes]
    prefix, suffix = framework_qa_prompt(llm, QUESTION)
    assert response.response == llm.engine.generate(retrieved, prefix=prefix, suffix=suffix, max_new_tokens=16).text
    assert get_blend_query_engine(index, "blend", llm=llm, similarity_top_k=3).query(QUESTION).response == str(response)


def test_a_query_engine_built_with_precompute_answers_its_first_query_from_stored_kv(llm: CacheBlendLLM) -> None:
    texts = ("Precompute check one: the ferry leaves at nine.", "Precompute check two: the pier is blue.",
             "Precompute check three: tickets cost four euros.")  # fmt: skip
    index = VectorStoreIndex.from_documents([Document(text=t) for t in texts], embed_model=MockEmbedding(embed_dim=8))
    query_engine = get_blend_query_engine(index, llm=llm, similarity_top_k=3, precompute=True)
    metrics = query_engine.query("When does the ferry leave?").metadata[METRICS_KEY]
    assert (metrics["chunks_hit"], metrics["chunks_missed"]) == (3, 0)
    with pytest.raises(ValueError, match="precompute=True stores chunk KV for the blend modes"):
        get_blend_query_engine(index, "compact", llm=llm, precompute=True)


def test_empty_retrieval_gives_the_frameworks_empty_response(llm: CacheBlendLLM) -> None:
    usual = get_response_synthesizer(llm=MockLLM(), response_mode="compact").synthesize(QUESTION, [])
    response = BlendSynthesizer(llm=llm).synthesize(QUESTION, [])
    assert isinstance(response, Response)
    assert response.response == usual.response == "Empty Response"
    streamed = BlendSynthesizer(llm=llm, streaming=True).synthesize(QUESTION, [])
    assert "".join(streamed.response_gen) == "Empty Response"
    # Through a query engine whose retriever finds nothing.
    empty_index = VectorStoreIndex(nodes=[], embed_model=MockEmbedding(embed_dim=8))
    assert str(get_blend_query_engine(empty_index, llm=llm).query(QUESTION)) == "Empty Response"
    # Nodes with no text are dropped; none left is an empty retrieval too.
    assert BlendSynthesizer(llm=llm).get_response(QUESTION, ["  ", ""]) == "Empty Response"


def test_empty_async_retrieval_gives_the_frameworks_empty_response(llm: CacheBlendLLM) -> None:
    response = asyncio.run(BlendSynthesizer(llm=llm).asynthesize(QUESTION, []))
    assert response.response == "Empty Response"


@pytest.mark.parametrize(
    ("mode", "synthesizer_type"),
    [("compact", CompactAndRefine), ("refine", Refine), ("tree_summarize", TreeSummarize), ("accumulate", Accumulate)],
)
def test_framework_modes_run_on_the_same_llm(mode: str, synthesizer_type: type) -> None:
    llm = MockLLM(max_tokens=8)
    index = VectorStoreIndex.from_documents(
        [Document(text=t) for t in PASSAGES], embed_model=MockEmbedding(embed_dim=8)
    )
    query_engine = get_blend_query_engine(index, mode, llm=llm, similarity_top_k=3)
    synthesizer = query_engine._response_synthesizer  # type: ignore[attr-defined]
    assert isinstance(synthesizer, synthesizer_type)
    assert synthesizer._llm is llm
    response = query_engine.query(QUESTION)
    assert str(response).strip() and len(response.source_nodes) == 3


@pytest.mark.real_model
def test_framework_compact_mode_runs_on_the_cacheblend_llm(llm: CacheBlendLLM) -> None:
    index = VectorStoreIndex.from_documents(
        [Document(text=t) for t in PASSAGES], embed_model=MockEmbedding(embed_dim=8)
    )
    response = get_blend_query_engine(index, "compact", llm=llm, similarity_top_k=3).query(QUESTION)
    assert str(response).strip()
    assert METRICS_KEY not in (response.metadata or {})  # the framework's response carries no engine metrics


def test_synthesizer_class_is_a_llamaindex_synthesizer() -> None:
    names_of_base_classes = [b.__name__ for b in BlendSynthesizer.__mro__]
    assert FrameworkSynthesizer.__name__ in names_of_base_classes


def test_question_before_the_context_warns_answers_and_reuses_nothing() -> None:
    """The policy both framework packages share (cacheblend_rag.frameworks): such a template is accepted with a
    QuestionBeforeContextWarning, every query answers but computes its chunks anew, and precomputing is refused."""
    llm = tiny_llm()
    question_first = PromptTemplate("w1 {query_str} w2 {context_str} w3")
    with pytest.warns(QuestionBeforeContextWarning, match="Put the question after the documents"):
        synthesizer = BlendSynthesizer(llm=llm, text_qa_template=question_first)
    nodes = as_nodes("w10 w11 w12", "w13 w14 w15")
    first = synthesizer.synthesize("w20", nodes).metadata[METRICS_KEY]
    second = synthesizer.synthesize("w21", nodes).metadata[METRICS_KEY]
    assert first["chunks_missed"] == second["chunks_missed"] == 2 and second["chunks_hit"] == 0
    with pytest.raises(PromptError, match="cannot precompute"):
        synthesizer.precompute(nodes)
    with pytest.warns(QuestionBeforeContextWarning):
        BlendSynthesizer(llm=llm).update_prompts({"text_qa_template": PromptTemplate("{query_str} {context_str}")})


def test_blend_needs_a_cacheblend_llm() -> None:
    with pytest.raises(TypeError, match="needs a CacheBlendLLM.*got MockLLM"):
        BlendSynthesizer(llm=MockLLM())


def test_bad_settings_are_refused_with_a_clear_error(llm: CacheBlendLLM) -> None:
    with pytest.raises(ValueError, match="exactly once"):
        BlendSynthesizer(llm=llm, text_qa_template=PromptTemplate("Answer {query_str}:"))
    with pytest.raises(ValueError, match="recompute_ratio must be in"):
        BlendSynthesizer(llm=llm, recompute_ratio=1.5)
    with pytest.raises(ValueError, match="'blend' only"):
        BlendSynthesizer(llm=llm, mode="full", recompute_ratio=0.2)
    with pytest.raises(ValueError, match="unknown response_mode 'blnd'"):
        get_blend_query_engine(VectorStoreIndex(nodes=[], embed_model=MockEmbedding(embed_dim=8)), "blnd", llm=llm)
    synthesizer = BlendSynthesizer(llm=llm)
    with pytest.raises(TypeError, match="single string"):
        synthesizer.get_response(QUESTION, "one text")  # type: ignore[arg-type]


@pytest.mark.real_model
def test_custom_template_is_used_for_the_prompt(llm: CacheBlendLLM) -> None:
    template = PromptTemplate("Passages:\n{context_str}\nQuestion: {query_str}\nShort answer:")
    synthesizer = BlendSynthesizer(llm=llm, text_qa_template=template)
    assert synthesizer.get_prompts()["text_qa_template"].get_template() == template.template
    prefix, suffix = synthesizer.prompt_parts(QUESTION)
    assert prefix.endswith("Passages:\n") and f"Question: {QUESTION}\nShort answer:" in suffix
    node = TextNode(text="Zurich lies on Lake Zurich.", metadata={"source": "atlas"})
    response = synthesizer.synthesize("Which lake?", as_nodes(node.get_content(metadata_mode="llm")))
    assert response.metadata[METRICS_KEY]["chunks_missed"] + response.metadata[METRICS_KEY]["chunks_hit"] == 1


def test_plain_text_llm_gets_the_frameworks_plain_prompt(llm: CacheBlendLLM) -> None:
    plain = CacheBlendLLM(engine=llm.engine, is_chat_model=False, max_new_tokens=4)
    prefix, suffix = BlendSynthesizer(llm=plain).prompt_parts(QUESTION)
    assert prefix == "Context information is below.\n---------------------\n"  # LlamaIndex's DEFAULT_TEXT_QA_PROMPT
    assert suffix.endswith(f"Query: {QUESTION}\nAnswer: ")
    assert "<|im_start|>" not in prefix + suffix


@pytest.mark.parametrize("streaming", [False, True])
def test_response_metrics_follow_the_llms_detailed_metrics(streaming: bool) -> None:
    llm = tiny_llm()
    detailed = CacheBlendLLM(engine=llm.engine, max_new_tokens=2, detailed_metrics=True)
    nodes = as_nodes("w10 w11 w12", "w13 w14 w15")

    def metrics(model: CacheBlendLLM) -> dict:
        response = BlendSynthesizer(llm=model, streaming=streaming).synthesize("w20", nodes)
        if streaming:
            list(response.response_gen)  # the metrics arrive after the last token
        return response.metadata[METRICS_KEY]

    assert "recomputed_per_layer" not in metrics(llm) and metrics(llm)["recomputed_tokens"] > 0
    assert len(metrics(detailed)["recomputed_per_layer"]) == llm.engine.lm.shape.num_layers
