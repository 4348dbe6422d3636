"""LangChain's standard unit tests for `ChatCacheBlend` (construction and parameters; no model is loaded)."""

from __future__ import annotations

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_tests.unit_tests import ChatModelUnitTests
from langchain_tests.unit_tests.chat_models import TEST_PYDANTIC_MODELS

from langchain_cacheblend import ChatCacheBlend

NO_TOOLS = "ChatCacheBlend has no tool calling: bind_tools is not implemented (the packaged models have no tool format)"


class TestChatCacheBlendUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return ChatCacheBlend

    @property
    def chat_model_params(self) -> dict:
        return {"model": "smollm2-135m-instruct"}

    @property
    def standard_chat_model_params(self) -> dict:
        # The model runs in-process: there is no API key to pass, and an unknown setting is an error.
        params = super().standard_chat_model_params
        params.pop("api_key")
        return params

    # Claimed so that the tool tests run and show the gap, instead of skipping silently.
    @property
    def has_tool_calling(self) -> bool:
        return True

    @pytest.mark.xfail(reason=NO_TOOLS, raises=NotImplementedError, strict=True)
    def test_bind_tool_pydantic(self, model, my_adder_tool) -> None:
        super().test_bind_tool_pydantic(model, my_adder_tool)

    @pytest.mark.parametrize("schema", TEST_PYDANTIC_MODELS)
    @pytest.mark.xfail(reason="no structured output: " + NO_TOOLS, raises=NotImplementedError, strict=True)
    def test_with_structured_output(self, model, schema) -> None:
        super().test_with_structured_output(model, schema)
