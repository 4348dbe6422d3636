"""Prompts as parts: a shared prefix, a list of chunks, and a suffix (the question), each tokenized on its own.

The chunks stay separate all the way down, so each maps to one cached KV entry; nothing is searched for in a
token stream afterwards. Every prefill mode uses the same token ids, so their outputs are comparable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import PromptError

_CHUNKS_MARK = "\x00<cacheblend-rag:chunks>\x00"


@dataclass(frozen=True)
class PromptTemplate:
    """How a request (chunks + question) becomes a prompt.

    With a tokenizer that has a chat template, `system` is the system message and the user message is
    `instruction`, then the chunks, then `question_template`; the assistant turn follows. Without a chat
    template the same texts are joined plainly.
    """

    system: str | None = "You are a helpful assistant. Answer the user's question from the passages given."
    instruction: str = "Read the passages below, then answer the question.\n\nPassages:\n"
    question_template: str = "\nQuestion: {question}\nAnswer based on the passages above."
    use_chat_template: bool = True

    def render(self, tokenizer: Any, question: str) -> tuple[str, str]:
        """-> (prefix text before the chunks, suffix text after them)."""
        if "{question}" not in self.question_template:
            raise PromptError(f"question_template must contain '{{question}}', got {self.question_template!r}")
        tail = self.question_template.format(question=question)
        if self.use_chat_template and getattr(tokenizer, "chat_template", None):
            messages = []
            if self.system is not None:
                messages.append({"role": "system", "content": self.system})
            messages.append({"role": "user", "content": self.instruction + _CHUNKS_MARK + tail})
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            if text.count(_CHUNKS_MARK) != 1:
                raise PromptError("the chat template altered the user message; set use_chat_template=False")
            prefix, suffix = text.split(_CHUNKS_MARK)
            return prefix, suffix
        head = f"{self.system}\n\n" if self.system else ""
        return head + self.instruction, tail + "\n"


# The prompt of CacheBlend's research code for the QA benchmarks (MuSiQue, 2WikiMQA): short answers.
QA_SHORT_TEMPLATE = PromptTemplate(
    system="You are a helpful assistant.",
    instruction=(
        "You will be asked a question after reading several passages. Please directly answer the question "
        "based on the given passages. Do NOT repeat the question. The answer should be within 5 words.\n"
        "Passages:\n"
    ),
    question_template=(
        "\n\nAnswer the question directly based on the given passages. Do NOT repeat the question. "
        "The answer should be within 5 words.\nQuestion: {question}\nAnswer:"
    ),
)


@dataclass(frozen=True)
class TokenizedPrompt:
    """Token ids of the prompt's parts. The prompt is prefix + chunks (in order) + suffix."""

    prefix_ids: tuple[int, ...]
    chunk_ids: tuple[tuple[int, ...], ...]
    suffix_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.suffix_ids:
            raise PromptError(
                "the prompt needs text after the chunks (the question or the assistant turn): the last token "
                "must be computed to produce the first answer token"
            )
        for i, ids in enumerate(self.chunk_ids):
            if not ids:
                raise PromptError(f"chunk {i} has no tokens; drop empty chunks before the request")

    @property
    def num_tokens(self) -> int:
        return len(self.prefix_ids) + sum(len(c) for c in self.chunk_ids) + len(self.suffix_ids)

    @property
    def chunk_spans(self) -> list[tuple[int, int]]:
        """[start, end) token offsets of each chunk in the full prompt."""
        spans, start = [], len(self.prefix_ids)
        for ids in self.chunk_ids:
            spans.append((start, start + len(ids)))
            start += len(ids)
        return spans

    def input_ids(self) -> torch.Tensor:
        """[N] int64"""
        ids = list(self.prefix_ids)
        for c in self.chunk_ids:
            ids.extend(c)
        ids.extend(self.suffix_ids)
        return torch.tensor(ids, dtype=torch.long)


def encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def tokenize_prefix(tokenizer: Any, prefix: str) -> tuple[int, ...]:
    ids = encode(tokenizer, prefix) if prefix else ()
    bos = getattr(tokenizer, "bos_token_id", None)
    if getattr(tokenizer, "add_bos_token", False) and bos is not None and ids[:1] != (bos,):
        ids = (bos, *ids)  # models trained with BOS expect it first, as their own encode adds it
    return ids


def tokenize_chunks(tokenizer: Any, chunks: Sequence[str], separator: str = "\n\n") -> tuple[tuple[int, ...], ...]:
    """Each chunk is tokenized as `text + separator`; a non-string or blank chunk is an error."""
    if isinstance(chunks, str):
        raise PromptError("chunks must be a list of strings, got a single string; wrap it: [text]")
    for i, c in enumerate(chunks):
        if not isinstance(c, str):
            raise PromptError(f"chunk {i} must be a string, got {type(c).__name__}")
        if not c.strip():
            raise PromptError(f"chunk {i} is empty or whitespace; drop it before the request")
    return tuple(encode(tokenizer, c + separator) for c in chunks)


def tokenize_parts(
    tokenizer: Any, prefix: str, chunks: Sequence[str], suffix: str, *, separator: str = "\n\n"
) -> TokenizedPrompt:
    """Tokenize each part on its own."""
    return TokenizedPrompt(
        prefix_ids=tokenize_prefix(tokenizer, prefix),
        chunk_ids=tokenize_chunks(tokenizer, chunks, separator),
        suffix_ids=encode(tokenizer, suffix),
    )
