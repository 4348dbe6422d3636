"""Where the documents go in a framework's prompt, chat messages, and retrieved documents as chunks."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine.request.marked_text import PromptText, render_chat_text
from ..engine.request.request import check_encodable
from ..errors import PromptError

# Stands for the documents in a rendered prompt. NUL bytes keep it from ever occurring in real text.
CONTEXT_PLACEHOLDER = "\x00<cacheblend:documents>\x00"

# Two stand-ins for the question (and any other variable): a prefix that differs between them depends on it.
_STAND_INS = ("\x01cacheblend:first\x01", "\x01cacheblend:second\x01")


class QuestionBeforeContextWarning(UserWarning):
    """The text before the documents depends on the question: requests run, but no chunk KV is reused."""


def split_at_context(text: str | PromptText) -> tuple[str | PromptText, str | PromptText]:
    """(prefix, suffix) of a prompt rendered with `CONTEXT_PLACEHOLDER` where the documents go."""
    parts = text.split(CONTEXT_PLACEHOLDER)
    if len(parts) != 2:
        raise PromptError(
            f"the rendered prompt must hold the documents' placeholder exactly once, found it {len(parts) - 1} "
            "times; the prompt template needs its context variable ({context} or {context_str}) once, and no "
            f"message or question may contain the reserved placeholder {CONTEXT_PLACEHOLDER!r}"
        )
    return parts[0], parts[1]


def _prefixes(render: Callable[[str], str]) -> tuple[str, str]:
    first, second = (split_at_context(render(stand_in))[0] for stand_in in _STAND_INS)
    return first, second


def check_context_prompt(render: Callable[[str], str], *, question: str = "the question") -> bool:
    """Check a prompt template where it is set; True when the text before the documents is question-free.

    `render(value)` renders the template with `CONTEXT_PLACEHOLDER` for the documents and `value` for every
    other variable. Raises PromptError when the documents' place is missing or repeated; warns with
    `QuestionBeforeContextWarning` when the text before them depends on `question` (the request still runs).
    """
    first, second = _prefixes(render)
    if first == second:
        return True
    warnings.warn(
        f"the prompt's text before the documents depends on {question}: every question then has its own prefix, "
        "computes its documents' KV anew and reuses none (the request runs, it is just not faster). Put the "
        "question after the documents.",
        QuestionBeforeContextWarning,
        stacklevel=3,
    )
    return False


def question_free_prefix(render: Callable[[str], str], *, question: str = "the question") -> str:
    """The text before the documents for precomputing their KV; PromptError when it depends on `question`,
    since KV computed for one stand-in question would be read by no request."""
    first, second = _prefixes(render)
    if first != second:
        raise PromptError(
            f"cannot precompute documents for this prompt: the text before them depends on {question}, so "
            "each question needs its own chunk KV; put the question after the documents"
        )
    return first


# -- chat ------------------------------------------------------------------------------------------------------

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTurn:
    role: str  # one of ROLES
    content: str  # text only

    def __post_init__(self) -> None:
        if self.role in ("tool", "function"):
            raise PromptError(f"no tool calling: drop {self.role} messages (and tool calls) from the conversation")
        if self.role not in ROLES:
            raise PromptError(f"unsupported message role {self.role!r}; use one of {', '.join(ROLES)}")


def non_text_error(kind: str, role: str) -> PromptError:
    """The error for a message part that is not text (an image, audio, a file, a tool call)."""
    return PromptError(
        f"the models read text only, got a {kind!r} content block in a {role} message; pass the content as text"
    )


def has_chat_template(tokenizer: Any) -> bool:
    """Whether a Hugging Face tokenizer carries a chat template (instruct models do, base models do not)."""
    return bool(tokenizer.chat_template)


def render_chat(tokenizer: Any, turns: Sequence[ChatTurn]) -> PromptText:
    """The prompt text of a conversation, ending where the assistant's answer starts (`.text` is the string).

    With a chat template this is the text the model was trained on; without one the turns become
    "Role: text" lines followed by "Assistant:". Each message's content is marked as content: a control-token
    string in it stays text when the engine tokenizes the prompt.
    """
    if not turns:
        raise PromptError("no messages to answer; pass at least one message")
    check_encodable((), **{f"{t.role} message {i}": t.content for i, t in enumerate(turns)})
    if has_chat_template(tokenizer):
        return render_chat_text(tokenizer, [{"role": t.role, "content": t.content} for t in turns])
    text = PromptText()
    for t in turns:
        text = text + f"{t.role.capitalize()}: " + PromptText.content(t.content) + "\n"
    return text + "Assistant:"


def document_chunks(texts: Sequence[object]) -> list[str]:
    """The chunks of a request's retrieved documents: each document's text, in order, without the blank ones.

    A splitter or a retriever may return an empty document; it has no KV worth caching and nothing to read, so it is
    left out (both frameworks do the same). A document whose text is not a string is a PromptError naming it.
    """
    if isinstance(texts, (str, bytes)):
        raise PromptError("documents must be a list of texts, got a single string; wrap it: [text]")
    out = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise PromptError(f"document {i}'s text must be a string, got {type(text).__name__}")
        if text.strip():
            out.append(text)
    return out
