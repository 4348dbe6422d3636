"""`ChatCacheBlend`: a LangChain chat model answering in-process with CacheBlend.

Messages are rendered to text with the tokenizer's own chat template. A call that passes `chunks=[...]`
(the documents' chains do) must have the documents' placeholder in one message: the rendered text is split
there into prefix and suffix, and each chunk is prefilled from its cached KV, so documents that recur across
requests are computed once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from cacheblend_rag.errors import PromptError
from langchain_core.callbacks import CallbackManagerForLLMRun
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
    """A message's text; anything but text (images, audio, files, tool calls) is refused, not silently dropped."""
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
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise PromptError(
                f"ChatCacheBlend reads text only, got a {kind!r} content block in a {message.type} message; "
                "pass the content as text (the packaged models take no images, audio or files)"
            )
    return "".join(parts)


def _role_of(message: BaseMessage) -> str:
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        if message.tool_calls:
            raise PromptError("ChatCacheBlend has no tool calling; drop tool calls from the conversation")
        return "assistant"
    if isinstance(message, ChatMessage):
        return message.role
    if isinstance(message, ToolMessage):
        raise PromptError("ChatCacheBlend has no tool calling; drop tool messages from the conversation")
    raise PromptError(f"unsupported message type {type(message).__name__}; use System/Human/AI messages")


def render_messages(tokenizer: Any, messages: Sequence[BaseMessage]) -> str:
    """The prompt text of a conversation, ending with the start of the assistant's turn.

    With a chat template this is exactly the text the model was trained on; a tokenizer without one (base
    models) gets the conversation as "Role: text" lines.
    """
    if not messages:
        raise PromptError("no messages to answer; pass at least one message")
    turns = [{"role": _role_of(m), "content": _text_of(m)} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    lines = [f"{t['role'].capitalize()}: {t['content']}" for t in turns]
    return "\n".join(lines) + "\nAssistant:"


class ChatCacheBlend(CacheBlendParams, BaseChatModel):
    """Chat model on a CacheBlend engine (in-process, Hugging Face transformers).

    Example:
        ```python
        from langchain_cacheblend import ChatCacheBlend

        chat = ChatCacheBlend(model="smollm2-135m-instruct", max_tokens=64)
        chat.invoke("What is CacheBlend?")
        ```

    `response_metadata["cacheblend"]` holds the request's metrics (TTFT, chunks hit/missed, tokens
    recomputed); `usage_metadata` counts prompt and generated tokens, chunk tokens loaded from the cache as
    `cache_read`. Use `create_blend_documents_chain` to pass retrieved documents as separately cached chunks.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")
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
        result = stream.result
        info = self._generation_info(result, model_name)
        message = AIMessage(content=result.text, response_metadata=info, usage_metadata=usage_from(result))
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)], llm_output=info)

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
        # Usage, model name and metrics once, on the last chunk: merged chunks would add up repeated values.
        result = stream.result
        info = self._generation_info(result, model_name)
        last = AIMessageChunk(
            content="", response_metadata=info, usage_metadata=usage_from(result), chunk_position="last"
        )
        yield ChatGenerationChunk(message=last, generation_info=info)
