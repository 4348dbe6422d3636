"""CacheBlendLLM: LlamaIndex's LLM interface gives exactly the engine's answer for the same prompt text."""

from __future__ import annotations

import asyncio

import pytest
from cacheblend_rag.errors import ConfigError, PromptError
from cacheblend_rag.frameworks import load_engine
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer
from llama_index.core.base.llms.base import BaseLLM
from llama_index.core.base.llms.types import ImageBlock, TextBlock
from llama_index.core.llms import ChatMessage, MessageRole
from llamaindex_testing import TEST_MODEL, shared_llm, tiny_llm

from llama_index.llms.cacheblend import METRICS_KEY, CacheBlendLLM


@pytest.fixture
def llm() -> CacheBlendLLM:
    return shared_llm()


PROMPT = "What is the capital of France?"


def chat_text(llm: CacheBlendLLM, messages: list[dict[str, str]]) -> str:
    return llm.engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.real_model
def test_metadata_comes_from_the_engine_and_settings(llm: CacheBlendLLM) -> None:
    meta = llm.metadata
    assert meta.context_window == llm.engine.max_tokens
    assert meta.num_output == llm.max_new_tokens == 16
    assert meta.is_chat_model  # SmolLM2's tokenizer has a chat template
    assert "smollm2" in meta.model_name


@pytest.mark.real_model
def test_complete_equals_engine_full_prefill_of_the_chat_turn(llm: CacheBlendLLM) -> None:
    response = llm.complete(PROMPT)
    direct = llm.engine.generate(
        [], prefix="", suffix=chat_text(llm, [{"role": "user", "content": PROMPT}]), max_new_tokens=16
    )
    assert response.text == direct.text
    assert response.text.strip()
    metrics = response.additional_kwargs[METRICS_KEY]
    assert metrics["mode"] == "full"
    assert metrics["prompt_tokens"] == direct.metrics.prompt_tokens
    assert response.raw["token_ids"] == direct.token_ids
    assert (response.raw["device"], response.raw["dtype"]) == (str(llm.engine.device), llm.engine.config.dtype)


@pytest.mark.real_model
def test_formatted_prompt_is_sent_as_is(llm: CacheBlendLLM) -> None:
    text = chat_text(llm, [{"role": "user", "content": PROMPT}])
    assert llm.complete(text, formatted=True).text == llm.complete(PROMPT).text


@pytest.mark.real_model
def test_stream_complete_yields_the_same_text_as_complete(llm: CacheBlendLLM) -> None:
    pieces = list(llm.stream_complete(PROMPT))
    assert "".join(p.delta or "" for p in pieces) == llm.complete(PROMPT).text
    assert pieces[-1].text == llm.complete(PROMPT).text
    assert pieces[-1].additional_kwargs[METRICS_KEY]["generated_tokens"] > 0


@pytest.mark.real_model
def test_chat_renders_messages_with_the_chat_template(llm: CacheBlendLLM) -> None:
    messages = [
        ChatMessage(role=MessageRole.SYSTEM, content="Answer in one word."),
        ChatMessage(role=MessageRole.USER, content=PROMPT),
    ]
    response = llm.chat(messages)
    expected = chat_text(
        llm, [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": PROMPT}]
    )
    assert response.message.content == llm.engine.generate([], prefix="", suffix=expected, max_new_tokens=16).text
    assert response.message.role == MessageRole.ASSISTANT
    assert METRICS_KEY in response.message.additional_kwargs
    assert "".join(r.delta or "" for r in llm.stream_chat(messages)) == response.message.content


@pytest.mark.real_model
def test_async_calls_match_sync_calls(llm: CacheBlendLLM) -> None:
    async def run() -> tuple[str, str, str]:
        completion = await llm.acomplete(PROMPT)
        streamed = "".join([r.delta or "" async for r in await llm.astream_complete(PROMPT)])
        chat = await llm.achat([ChatMessage(role=MessageRole.USER, content=PROMPT)])
        return completion.text, streamed, chat.message.content or ""

    completion, streamed, chat = asyncio.run(run())
    expected = llm.complete(PROMPT).text
    assert completion == streamed == chat == expected


@pytest.mark.real_model
def test_per_call_settings_override_fields(llm: CacheBlendLLM) -> None:
    response = llm.complete(PROMPT, max_new_tokens=2)
    assert response.additional_kwargs[METRICS_KEY]["generated_tokens"] <= 2
    assert response.raw["finish_reason"] in ("length", "stop")
    # LangChain's (and OpenAI's) name for the answer budget is accepted too: both packages take the same arguments
    assert llm.complete(PROMPT, max_tokens=1).additional_kwargs[METRICS_KEY]["generated_tokens"] == 1


@pytest.mark.real_model
def test_bad_input_is_refused_with_a_clear_error(llm: CacheBlendLLM) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_token'.*'max_new_tokens'"):
        llm.complete(PROMPT, max_token=3)
    with pytest.raises(TypeError, match="pass one of them"):
        llm.complete(PROMPT, max_tokens=3, max_new_tokens=3)
    with pytest.raises(ValueError, match="non-empty string"):
        llm.complete("   ")
    with pytest.raises(TypeError, match="CacheBlendEngine"):
        CacheBlendLLM(engine="qwen")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        CacheBlendLLM(engine=llm.engine, temperature=-1.0)


def test_llm_class_is_a_llamaindex_llm() -> None:
    names_of_base_classes = [b.__name__ for b in CacheBlendLLM.__mro__]
    assert BaseLLM.__name__ in names_of_base_classes


def test_chat_accepts_text_turns_and_refuses_tools_and_images() -> None:
    llm = tiny_llm()
    turns = [ChatMessage(role="system", content="w1"), ChatMessage(role="user", content="w2 w3")]
    assert llm.chat(turns).message.content is not None
    with pytest.raises(PromptError, match="no tool calling"):
        llm.chat([*turns, ChatMessage(role=MessageRole.TOOL, content="w4")])
    image = ChatMessage(role="user", blocks=[TextBlock(text="w5"), ImageBlock(url="https://example.com/x.png")])
    with pytest.raises(PromptError, match="text only"):
        llm.chat([image])


@pytest.mark.real_model
def test_without_an_engine_the_process_wide_engine_of_the_model_is_used() -> None:
    llm = CacheBlendLLM(model_name=TEST_MODEL, max_new_tokens=2)
    assert llm.engine is load_engine(TEST_MODEL)  # the engine LangChain's models of this name share too
    assert llm.metadata.model_name == TEST_MODEL


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama").save_pretrained(folder)
    make_tiny_tokenizer(chat_template=True).save_pretrained(folder)
    return str(folder)


def test_store_settings_reach_the_loaded_engine_and_only_equal_ones_share_it(checkpoint, tmp_path) -> None:
    llm = CacheBlendLLM(model_name=checkpoint, disk_dir=str(tmp_path / "a"), memory_budget_bytes=2**20)
    store = llm.engine.config.store
    assert (store.disk_dir, store.memory_budget_bytes) == (str(tmp_path / "a"), 2**20)
    same = CacheBlendLLM(model_name=checkpoint, disk_dir=str(tmp_path / "a"), memory_budget_bytes=2**20)
    assert same.engine is llm.engine
    assert CacheBlendLLM(model_name=checkpoint, disk_dir=str(tmp_path / "b")).engine is not llm.engine
    assert CacheBlendLLM(model_name=checkpoint, redis_budget_bytes=2**29).engine is not llm.engine
    with pytest.raises(ConfigError, match="redis_url must start with redis://"):
        CacheBlendLLM(model_name=checkpoint, redis_url="localhost:6379")


def test_engine_settings_beside_an_engine_passed_in_are_refused() -> None:
    engine = tiny_llm().engine
    with pytest.raises(ConfigError, match="disk_dir set the store of an engine the model loads"):
        CacheBlendLLM(engine=engine, disk_dir="/tmp/kv")
    with pytest.raises(ConfigError, match="device and dtype are settings of an engine the LLM loads"):
        CacheBlendLLM(engine=engine, dtype="bfloat16")


def test_concurrent_async_calls_decode_together_and_match_sync_calls() -> None:
    llm = tiny_llm()
    prompts = [f"w{10 + i} w{20 + i}" for i in range(6)]
    expected = [llm.complete(p, max_new_tokens=5).text for p in prompts]

    async def run() -> tuple[list[str], list[str]]:
        done = await asyncio.gather(*(llm.acomplete(p, max_new_tokens=5) for p in prompts))

        async def streamed(p: str) -> str:
            return "".join([r.delta or "" async for r in await llm.astream_complete(p, max_new_tokens=5)])

        return [r.text for r in done], list(await asyncio.gather(*(streamed(p) for p in prompts)))

    completed, streamed = asyncio.run(run())
    assert completed == streamed == expected
    assert llm.engine.scheduler.largest_batch > 1


def test_a_redis_password_never_shows_in_repr_dumps_or_errors() -> None:
    from pydantic import SecretStr

    url = "redis://:S3CRETPW@127.0.0.1:6399/0"
    llm = CacheBlendLLM.model_construct(model_name="x", redis_url=SecretStr(url))
    assert "S3CRETPW" not in repr(llm) + str(llm.model_dump()) + llm.model_dump_json()
    with pytest.raises(ConfigError) as caught:
        CacheBlendLLM(model_name="smollm2-135m-instruct", redis_url="http://:S3CRETPW@host/0")
    assert "S3CRETPW" not in str(caught.value)


def test_max_new_tokens_is_the_setting_and_max_tokens_its_alias() -> None:
    # One name in both integrations (the engine's); LangChain's max_tokens is accepted for it.
    engine = tiny_llm().engine
    llm = CacheBlendLLM(engine=engine, max_tokens=3)
    assert llm.max_new_tokens == llm.max_tokens == llm.metadata.num_output == 3
    assert "max_tokens" not in llm.model_dump()
    assert llm.complete("w5").additional_kwargs[METRICS_KEY]["generated_tokens"] == 3
    llm.max_tokens = 2
    assert llm.max_new_tokens == 2 and llm.complete("w5").additional_kwargs[METRICS_KEY]["generated_tokens"] == 2
    with pytest.raises(ValueError, match="max_tokens and max_new_tokens set the same thing"):
        CacheBlendLLM(engine=engine, max_tokens=3, max_new_tokens=4)


def test_metrics_are_compact_unless_detailed_metrics() -> None:
    llm = tiny_llm()
    layers = llm.engine.lm.shape.num_layers
    compact = llm.complete("w5").additional_kwargs[METRICS_KEY]
    assert "recomputed_per_layer" not in compact
    assert {"recomputed_tokens", "compute_share", "ttft_s", "chunks_hit"} <= set(compact)
    assert "recomputed_per_layer" not in list(llm.stream_complete("w5"))[-1].additional_kwargs[METRICS_KEY]
    detailed = CacheBlendLLM(engine=llm.engine, max_new_tokens=2, detailed_metrics=True)
    assert len(detailed.complete("w5").additional_kwargs[METRICS_KEY]["recomputed_per_layer"]) == layers
    last = list(detailed.stream_complete("w5"))[-1]
    assert len(last.additional_kwargs[METRICS_KEY]["recomputed_per_layer"]) == layers
