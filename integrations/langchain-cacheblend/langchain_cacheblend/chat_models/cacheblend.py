"""`ChatCacheBlend`: a LangChain chat model answering in-process with CacheBlend.

Messages are rendered to text with the tokenizer's own chat template. A call that passes `chunks=[...]`
(the documents' chains do) must have the documents' placeholder in one message: the rendered text is split
there into prefix and suffix, and each chunk is prefilled from its cached KV, so documents that recur across
requests are computed once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from cacheblend_rag.errors import PromptError
from cacheblend_rag.frameworks import ChatTurn, PromptText, non_text_error, render_chat
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict

from .._common import CacheBlendParams, usage_from


def _text_of(message: BaseMessage) -> str:
    """A message's text; anything but text (images, audio, files) is refused, not silently dropped."""
    content = message.content
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        else:
            raise non_text_error(block.get("type") if isinstance(block, dict) else type(block).__name__, message.type)
    return "".join(parts)


def _turn_of(message: BaseMessage) -> ChatTurn:
    if isinstance(message, SystemMessage):
        role = "system"
    elif isinstance(message, HumanMessage):
        role = "user"
    elif isinstance(message, AIMessage):
        role = "tool" if message.tool_calls else "assistant"  # a tool call is refused as a tool message is
    elif isinstance(message, ChatMessage):
        role = message.role
    elif isinstance(message, ToolMessage):
        role = "tool"
    else:
        raise PromptError(f"unsupported message type {type(message).__name__}; use System/Human/AI messages")
    return ChatTurn(role, _text_of(message))


def render_messages(tokenizer: Any, messages: Sequence[BaseMessage]) -> PromptText:
    """The prompt text of a conversation, ending with the start of the assistant's turn
    (`cacheblend_rag.frameworks.render_chat`: the tokenizer's chat template, or "Role: text" lines)."""
    return render_chat(tokenizer, [_turn_of(m) for m in messages])


class ChatCacheBlend(CacheBlendParams, BaseChatModel):
    """Chat model on a CacheBlend engine (in-process, Hugging Face transformers).

    Example:
        ```python
        from langchain_cacheblend import ChatCacheBlend

        chat = ChatCacheBlend(model="smollm2-135m-instruct", max_new_tokens=64)
        chat.invoke("What is CacheBlend?")
        ```

    `response_metadata["cacheblend"]` holds the request's metrics (TTFT, chunks hit/missed, tokens
    recomputed); `usage_metadata` counts prompt and generated tokens, chunk tokens loaded from the cache as
    `cache_read`. Use `create_blend_documents_chain` to pass retrieved documents as separately cached chunks.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid", hide_input_in_errors=True)
    _ls_model_type = "chat"

    @property
    def _llm_type(self) -> str:
        return "cacheblend-chat"

    def _start(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]):
        engine = self.get_engine(kwargs.get("model"))
        return self._stream_request(render_messages(engine.tokenizer, messages), stop, kwargs)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        deltas, stream, model_name = self._start(messages, stop, kwargs)
        for delta in deltas:
            if run_manager is not None:
                run_manager.on_llm_new_token(delta)
        return self._chat_result(stream.result, model_name)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """Awaited without a thread; concurrent calls (`abatch`, `asyncio.gather`) decode together."""
        deltas, stream, model_name = await self._astream_request(None, stop, kwargs, self._renderer(messages))
        async for delta in deltas:
            if run_manager is not None:
                await run_manager.on_llm_new_token(delta)
        return self._chat_result(stream.result, model_name)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        deltas, stream, model_name = self._start(messages, stop, kwargs)
        for delta in deltas:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager is not None:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield self._last_chunk(stream.result, model_name)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        deltas, stream, model_name = await self._astream_request(None, stop, kwargs, self._renderer(messages))
        async for delta in deltas:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager is not None:
                await run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield self._last_chunk(stream.result, model_name)

    @staticmethod
    def _renderer(messages: list[BaseMessage]):
        return lambda tokenizer: render_messages(tokenizer, messages)

    def _chat_result(self, result, model_name: str) -> ChatResult:
        info = self._generation_info(result, model_name)
        message = AIMessage(content=result.text, response_metadata=info, usage_metadata=usage_from(result))
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)], llm_output=info)

    def _last_chunk(self, result, model_name: str) -> ChatGenerationChunk:
        """Usage, model name and metrics once, on the last chunk: merged chunks would add up repeated values."""
        info = self._generation_info(result, model_name)
        last = AIMessageChunk(
            content="", response_metadata=info, usage_metadata=usage_from(result), chunk_position="last"
        )
        return ChatGenerationChunk(message=last, generation_info=info)
