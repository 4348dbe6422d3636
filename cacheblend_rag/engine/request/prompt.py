"""Prompts as parts: a shared prefix, a list of chunks, and a suffix (the question), each tokenized on its own.

The chunks stay separate all the way down, so each maps to one cached KV entry; nothing is searched for in a
token stream afterwards. Every prefill mode uses the same token ids, so their outputs are comparable.
Chunks and questions are untrusted text: a control-token string in them (`<|im_start|>system`) stays text, and
only the chat template's own markup yields control tokens (`prompt_text.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import PromptError
from .marked_text import PromptText, as_prompt_text, check_unreserved, encode_text, render_chat_text
from .token_cache import TokenCache

_CHUNKS_MARK = "\x00<cacheblend-rag:chunks>\x00"
_QUESTION_MARK = "\x00<cacheblend-rag:question>\x00"


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
        """-> (prefix text before the chunks, suffix text after them), as plain strings."""
        prefix, suffix = self.render_parts(tokenizer, question)
        return prefix.text, suffix.text

    def render_parts(self, tokenizer: Any, question: str) -> tuple[PromptText, PromptText]:
        """-> (prefix, suffix) with the chat template's markup apart from the content (the messages, the question),
        whose special-token strings stay text when tokenized."""
        if "{question}" not in self.question_template:
            raise PromptError(f"question_template must contain '{{question}}', got {self.question_template!r}")
        check_unreserved(question, "the question")
        if self.use_chat_template and getattr(tokenizer, "chat_template", None):
            messages = []
            if self.system is not None:
                messages.append({"role": "system", "content": self.system})
            tail = self.question_template.format(question=question)
            messages.append({"role": "user", "content": self.instruction + _CHUNKS_MARK + tail})
            parts = render_chat_text(tokenizer, messages).split(_CHUNKS_MARK)
            if len(parts) != 2:
                raise PromptError("the chat template altered the user message; set use_chat_template=False")
            return parts[0], parts[1]
        head = f"{self.system}\n\n" if self.system else ""
        pieces = self.question_template.format(question=_QUESTION_MARK).split(_QUESTION_MARK)
        suffix = PromptText.markup(pieces[0])
        for piece in pieces[1:]:
            suffix = suffix + PromptText.content(question) + PromptText.markup(piece)
        return PromptText.markup(head + self.instruction), suffix + "\n"


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


def encode(tokenizer: Any, text: str | PromptText) -> tuple[int, ...]:
    """Token ids of markup (a plain string) or of a `PromptText` (special-token strings in its content stay text)."""
    return encode_text(tokenizer, text)


def tokenize_prefix(tokenizer: Any, prefix: str | PromptText) -> tuple[int, ...]:
    ids = encode(tokenizer, prefix) if prefix else ()
    bos = getattr(tokenizer, "bos_token_id", None)
    if getattr(tokenizer, "add_bos_token", False) and bos is not None and ids[:1] != (bos,):
        ids = (bos, *ids)  # models trained with BOS expect it first, as their own encode adds it
    return ids


def tokenize_chunks(
    tokenizer: Any, chunks: Sequence[str], separator: str = "\n\n", cache: TokenCache | None = None
) -> tuple[tuple[int, ...], ...]:
    """Each chunk is tokenized as `text + separator`, as content (a special-token string in it stays text); a
    non-string or blank chunk is an error. With `cache` (made for this tokenizer), a chunk tokenized before is not
    tokenized again."""
    if isinstance(chunks, str):
        raise PromptError("chunks must be a list of strings, got a single string; wrap it: [text]")
    for i, c in enumerate(chunks):
        if not isinstance(c, str):
            raise PromptError(f"chunk {i} must be a string, got {type(c).__name__}")
        if not c.strip():
            raise PromptError(f"chunk {i} is empty or whitespace; drop it before the request")

    def encode_chunk(text: str) -> tuple[int, ...]:
        return encode(tokenizer, PromptText.content(text))

    if cache is None:
        return tuple(encode_chunk(c + separator) for c in chunks)
    if cache.tokenizer is not tokenizer:
        raise ValueError("the token cache was made for another tokenizer; give each tokenizer its own TokenCache")
    return tuple(cache.chunk_ids(c, separator, encode_chunk) for c in chunks)


def tokenize_parts(
    tokenizer: Any,
    prefix: str | PromptText,
    chunks: Sequence[str],
    suffix: str | PromptText,
    *,
    separator: str = "\n\n",
    cache: TokenCache | None = None,
) -> TokenizedPrompt:
    """Tokenize each part on its own. A plain-string prefix or suffix is markup (its special-token strings are
    special tokens: it may be a rendered template); pass a `PromptText` to mark user content in it. `cache`: see
    `tokenize_chunks`."""
    return TokenizedPrompt(
        prefix_ids=tokenize_prefix(tokenizer, as_prompt_text(prefix)),
        chunk_ids=tokenize_chunks(tokenizer, chunks, separator, cache),
        suffix_ids=encode(tokenizer, suffix),
    )


def tokenize_request(
    tokenizer: Any,
    template: PromptTemplate,
    chunks: Sequence[str],
    question: str | None,
    prefix: str | PromptText | None,
    suffix: str | PromptText | None,
    separator: str,
    cache: TokenCache | None = None,
) -> TokenizedPrompt:
    """A request's prompt: chunks with either a question (rendered by `template`) or an explicit prefix/suffix;
    `cache`: see `tokenize_chunks`."""
    if question is not None:
        if prefix is not None or suffix is not None:
            raise PromptError("give either a question (the template renders it) or prefix/suffix, not both")
        if not question.strip():
            raise PromptError("the question is empty")
        prefix, suffix = template.render_parts(tokenizer, question)
    elif suffix is None:
        raise PromptError("give a question, or a suffix (the text after the chunks)")
    return tokenize_parts(tokenizer, prefix or "", chunks, suffix, separator=separator, cache=cache)
