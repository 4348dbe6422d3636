"""The engine's four ways to answer: `generate` and `stream` for threads, `agenerate` and `astream` for asyncio.

`GenerationMethods` is the part of `CacheBlendEngine` that turns a call into a checked `Request` and its tokenized
prompt, and hands both to the scheduler (`scheduler.py`), which serves every request in one queue.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from typing_extensions import Unpack

from ..request.prompt import TokenizedPrompt
from ..request.request import Request, RequestOptions, calling, check_prompt_parts
from .decoding import AsyncTextStream, GenerationResult, TextStream
from .scheduler import Scheduler


class GenerationMethods:
    """The engine's answering methods; `CacheBlendEngine` sets these attributes."""

    scheduler: Scheduler

    build_prompt: Callable[..., TokenizedPrompt]
    _check_open: Callable[[str], None]
    _check_request: Callable[[TokenizedPrompt, Request, str], None]

    def generate(
        self, chunks: Sequence[str] | TokenizedPrompt, question: str | None = None, **options: Unpack[RequestOptions]
    ) -> GenerationResult:
        """Answer a question over chunks (or a prebuilt prompt) and return the text with the request's metrics.

        Takes the keyword arguments of `stream`, and collects its stream.
        """
        prompt, request = self._request("generate", chunks, question, options)
        return self.scheduler.stream(prompt, request).collect()

    def stream(
        self, chunks: Sequence[str] | TokenizedPrompt, question: str | None = None, **options: Unpack[RequestOptions]
    ) -> TextStream:
        """Yield the answer's text as it is produced; `.result` holds the `GenerationResult` at the end.

        Keyword arguments: `RequestOptions` (all optional): the prefill `mode`, `recompute_ratio` or another
        `blend` rule; decoding (`max_new_tokens`, greedy at `temperature` 0, else `top_p` / `top_k` / `seed`;
        `stop` strings); the prompt: chunks + question (rendered by `template`), chunks + explicit `prefix` /
        `suffix`, or a prebuilt `TokenizedPrompt` in place of the chunks. Every argument is checked here, before
        any compute.
        """
        prompt, request = self._request("stream", chunks, question, options)
        return self.scheduler.stream(prompt, request)

    def _request(
        self, method: str, chunks: Sequence[str] | TokenizedPrompt, question: str | None, options: Mapping[str, Any]
    ) -> tuple[TokenizedPrompt, Request]:
        """The checked request of one `generate` / `stream` call and its tokenized prompt."""
        self._check_open(method)
        request = Request.from_options(method, options)
        prompt = check_prompt_parts(method, chunks, question, request)
        if prompt is None:
            with calling(method):
                prompt = self.build_prompt(chunks, question, template=request.template, prefix=request.prefix,
                                           suffix=request.suffix)  # fmt: skip
        self._check_request(prompt, request, method)
        return prompt, request

    async def agenerate(
        self, chunks: Sequence[str] | TokenizedPrompt, question: str | None = None, **options: Unpack[RequestOptions]
    ) -> GenerationResult:
        """`generate` for asyncio: awaits the answer without holding a thread; concurrent calls decode together."""
        prompt, request = self._request("agenerate", chunks, question, options)
        return await self.scheduler.astream(prompt, request).collect()

    def astream(
        self, chunks: Sequence[str] | TokenizedPrompt, question: str | None = None, **options: Unpack[RequestOptions]
    ) -> AsyncTextStream:
        """`stream` for asyncio (`async for delta in engine.astream(...)`); call it inside a running event loop."""
        prompt, request = self._request("astream", chunks, question, options)
        return self.scheduler.astream(prompt, request)
