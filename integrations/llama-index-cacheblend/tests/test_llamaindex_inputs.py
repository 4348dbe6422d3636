"""Inputs the framework passes that the engine refuses: the LlamaIndex package treats them as the LangChain one
does, through the one check both share (`cacheblend_rag.frameworks`)."""

from __future__ import annotations

import pytest
from cacheblend_rag.errors import ConfigError, PromptError
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.schema import NodeWithScore, TextNode
from llamaindex_testing import as_nodes, tiny_llm

from llama_index.response_synthesizers.cacheblend import BlendSynthesizer

TEXTS = ("w10 w11 w12 w13 w14 w15", "w20 w21 w22 w23")


def test_an_empty_retrieved_node_is_left_out_and_the_synthesizer_answers() -> None:
    llm = tiny_llm()
    synthesizer = BlendSynthesizer(llm=llm)
    with_blank = synthesizer.synthesize("w9", as_nodes(TEXTS[0], " \n", TEXTS[1], ""))
    assert with_blank.response == synthesizer.synthesize("w9", as_nodes(*TEXTS)).response


def test_a_node_whose_text_is_not_a_string_is_a_prompt_error_naming_it() -> None:
    node = NodeWithScore(node=TextNode.model_construct(text=123), score=1.0)
    with pytest.raises(PromptError, match="document 1's text must be a string, got int"):
        BlendSynthesizer(llm=tiny_llm()).synthesize("w9", [as_nodes(TEXTS[0])[0], node])


def test_a_lone_surrogate_in_a_chat_message_is_a_prompt_error_naming_the_message() -> None:
    with pytest.raises(PromptError, match=r"user message 0 holds '\\ud800'"):
        tiny_llm().chat([ChatMessage(role="user", content="w5 \ud800")])


def test_a_stop_that_is_not_text_is_the_engines_config_error() -> None:
    with pytest.raises(ConfigError, match="stop must be a string, a list of strings or None, got int"):
        tiny_llm().complete("w5", stop=5)
