"""CacheBlendLLM: LlamaIndex's LLM interface gives exactly the engine's answer for the same prompt text."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.llms import ChatMessage, MessageRole
from llamaindex_testing import shared_llm

from llama_index.llms.cacheblend import METRICS_KEY, CacheBlendLLM


@pytest.fixture
def llm() -> CacheBlendLLM:
    return shared_llm()


pytestmark = pytest.mark.real_model

PROMPT = "What is the capital of France?"


def chat_text(llm: CacheBlendLLM, messages: list[dict[str, str]]) -> str:
    return llm.engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_metadata_comes_from_the_engine_and_settings(llm: CacheBlendLLM) -> None:
    meta = llm.metadata
    assert meta.context_window == llm.engine.max_tokens
    assert meta.num_output == llm.max_new_tokens == 16
    assert meta.is_chat_model  # SmolLM2's tokenizer has a chat template
    assert "smollm2" in meta.model_name


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


def test_formatted_prompt_is_sent_as_is(llm: CacheBlendLLM) -> None:
    text = chat_text(llm, [{"role": "user", "content": PROMPT}])
    assert llm.complete(text, formatted=True).text == llm.complete(PROMPT).text


def test_stream_complete_yields_the_same_text_as_complete(llm: CacheBlendLLM) -> None:
    pieces = list(llm.stream_complete(PROMPT))
    assert "".join(p.delta or "" for p in pieces) == llm.complete(PROMPT).text
    assert pieces[-1].text == llm.complete(PROMPT).text
    assert pieces[-1].additional_kwargs[METRICS_KEY]["generated_tokens"] > 0


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


def test_async_calls_match_sync_calls(llm: CacheBlendLLM) -> None:
    async def run() -> tuple[str, str, str]:
        completion = await llm.acomplete(PROMPT)
        streamed = "".join([r.delta or "" async for r in await llm.astream_complete(PROMPT)])
        chat = await llm.achat([ChatMessage(role=MessageRole.USER, content=PROMPT)])
        return completion.text, streamed, chat.message.content or ""

    completion, streamed, chat = asyncio.run(run())
    expected = llm.complete(PROMPT).text
    assert completion == streamed == chat == expected


def test_per_call_settings_override_fields(llm: CacheBlendLLM) -> None:
    response = llm.complete(PROMPT, max_new_tokens=2)
    assert response.additional_kwargs[METRICS_KEY]["generated_tokens"] <= 2
    assert response.raw["finish_reason"] in ("length", "stop")


def test_bad_input_is_refused_with_a_clear_error(llm: CacheBlendLLM) -> None:
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['max_tokens'\\]"):
        llm.complete(PROMPT, max_tokens=3)
    with pytest.raises(ValueError, match="non-empty string"):
        llm.complete("   ")
    with pytest.raises(TypeError, match="CacheBlendEngine"):
        CacheBlendLLM(engine="qwen")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        CacheBlendLLM(engine=llm.engine, temperature=-1.0)
