"""`CacheBlendLLM`: a LangChain text-completion model answering in-process with CacheBlend.

The prompt string goes to the model as is (no chat template). A call that passes `chunks=[...]` must have the
documents' placeholder in the prompt: the text before it is the prefix, the text after it the suffix, and
each chunk is prefilled from its cached KV.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict

from .._common import CacheBlendParams, usage_from


class CacheBlendLLM(CacheBlendParams, BaseLLM):
    """Completion model on a CacheBlend engine (in-process, Hugging Face transformers).

    Example:
        ```python
        from langchain_cacheblend import CacheBlendLLM

        llm = CacheBlendLLM(model="smollm2-135m-instruct", max_new_tokens=32, stop=["\\n\\n"])
        llm.invoke("The capital of France is")
        ```

    Each generation's `generation_info` holds the model name, the finish reason, the request's blend metrics
    (`"cacheblend"`) and its token usage (`"usage"`); `llm_output["token_usage"]` sums the usage of a batch.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid", hide_input_in_errors=True)
    _ls_model_type = "llm"

    @property
    def _llm_type(self) -> str:
        return "cacheblend"

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        # Every prompt is queued before the first is read, so the engine decodes them together.
        started = [self._stream_request(prompt, stop, kwargs) for prompt in prompts]
        results = []
        for deltas, stream, model_name in started:
            for delta in deltas:
                if run_manager is not None:
                    run_manager.on_llm_new_token(delta)
            results.append((stream.result, model_name))
        return self._llm_result(results)

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        """Awaited without a thread; the prompts, and concurrent calls, decode together."""

        async def one(prompt: str):
            deltas, stream, model_name = await self._astream_request(prompt, stop, kwargs)
            async for delta in deltas:
                if run_manager is not None:
                    await run_manager.on_llm_new_token(delta)
            return stream.result, model_name

        return self._llm_result(await asyncio.gather(*(one(p) for p in prompts)))

    def _llm_result(self, results) -> LLMResult:
        generations: list[list[Generation]] = []
        totals = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
        model_name = self.model_name
        for result, model_name in results:
            usage = usage_from(result)
            for key in totals:
                totals[key] += usage[key]
            info = {**self._generation_info(result, model_name), "usage": dict(usage)}
            generations.append([Generation(text=result.text, generation_info=info)])
        return LLMResult(generations=generations, llm_output={"token_usage": totals, "model_name": model_name})

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        deltas, stream, model_name = self._stream_request(prompt, stop, kwargs)
        for delta in deltas:
            chunk = GenerationChunk(text=delta)
            if run_manager is not None:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield self._last_chunk(stream.result, model_name)

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        deltas, stream, model_name = await self._astream_request(prompt, stop, kwargs)
        async for delta in deltas:
            chunk = GenerationChunk(text=delta)
            if run_manager is not None:
                await run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield self._last_chunk(stream.result, model_name)

    def _last_chunk(self, result, model_name: str) -> GenerationChunk:
        info = {**self._generation_info(result, model_name), "usage": dict(usage_from(result))}
        return GenerationChunk(text="", generation_info=info)
