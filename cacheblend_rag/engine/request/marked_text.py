"""Prompt text that knows which parts are the chat template's markup and which are content.

A chat template writes control tokens (`<|im_start|>`, `<|eot_id|>`) around each message. Tokenizing the rendered
text as one string would also turn a control-token string *inside* a message, a question or a retrieved document
into that control token, so a document could open a forged system turn. Here text is a sequence of segments:
markup, whose special-token strings are special tokens, and content, whose special-token strings stay text
(`split_special_tokens=True`). The text is cut only at the markup's special tokens, as the tokenizer itself cuts
at them, so a prompt whose content holds no special-token string gets the same ids as the joined text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import PromptError

# Every internal marker starts with this; a question or message containing it is refused by name.
RESERVED_PREFIX = "\x00<cacheblend-rag:"
_CONTENT_PREFIX = RESERVED_PREFIX + "content:"
_CONTENT_MARK = _CONTENT_PREFIX + "{}>\x00"


def check_unreserved(text: str, where: str) -> None:
    """PromptError when `text` holds one of cacheblend-rag's internal markers (they start with NUL + a tag)."""
    if RESERVED_PREFIX in text:
        raise PromptError(
            f"{where} contains the reserved marker {RESERVED_PREFIX!r}, which cacheblend-rag uses internally to "
            "find where the chunks and messages go in a rendered prompt; remove it from the text"
        )


@dataclass(frozen=True)
class PromptText:
    """Text as (piece, is_content) segments: content pieces never yield special tokens, markup pieces may."""

    segments: tuple[tuple[str, bool], ...] = ()

    @classmethod
    def markup(cls, text: str) -> PromptText:
        return cls(((text, False),) if text else ())

    @classmethod
    def content(cls, text: str) -> PromptText:
        return cls(((text, True),) if text else ())

    @property
    def text(self) -> str:
        return "".join(piece for piece, _ in self.segments)

    def __str__(self) -> str:
        return self.text

    def __bool__(self) -> bool:
        return any(piece for piece, _ in self.segments)

    def __contains__(self, marker: str) -> bool:
        return marker in self.text

    def __add__(self, other: PromptText | str) -> PromptText:
        return PromptText(self.segments + as_prompt_text(other).segments)

    def __radd__(self, other: str) -> PromptText:
        return as_prompt_text(other) + self

    def split(self, marker: str) -> list[PromptText]:
        """The parts between occurrences of `marker` (a marker must lie within one segment)."""
        parts: list[PromptText] = []
        current: list[tuple[str, bool]] = []
        for piece, is_content in self.segments:
            for i, sub in enumerate(piece.split(marker)):
                if i > 0:
                    parts.append(PromptText(tuple(current)))
                    current = []
                if sub:
                    current.append((sub, is_content))
        parts.append(PromptText(tuple(current)))
        return parts


def as_prompt_text(text: PromptText | str) -> PromptText:
    """A plain string is markup: the caller wrote it, special-token strings included (e.g. a rendered template)."""
    return text if isinstance(text, PromptText) else PromptText.markup(text)


def _encode_plain(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)) if text else []


def encode_text(tokenizer: Any, text: PromptText | str) -> tuple[int, ...]:
    """Token ids of `text`: special-token strings become special tokens in markup only, never in content."""
    specials = {t.content: (i, t) for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    pattern = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))) if specials else None
    ids: list[int] = []
    pending, strip_next = "", False  # text since the last special token; whether that token eats the spaces after it

    def flush(drop_trailing_space: bool) -> None:
        nonlocal pending
        piece = pending.lstrip() if strip_next else pending
        ids.extend(_encode_plain(tokenizer, piece.rstrip() if drop_trailing_space else piece))
        pending = ""

    for piece, is_content in as_prompt_text(text).segments:
        if is_content or pattern is None:
            pending += piece
            continue
        pos = 0
        for match in pattern.finditer(piece):
            token_id, token = specials[match.group()]
            pending += piece[pos : match.start()]
            flush(drop_trailing_space=token.lstrip)
            ids.append(token_id)
            strip_next, pos = token.rstrip, match.end()
        pending += piece[pos:]
    flush(drop_trailing_space=False)
    return tuple(ids)


def render_chat_text(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> PromptText:
    """The chat template's text for `messages` (dicts with "role" and "content") up to the assistant's turn, each
    message's content kept as content. PromptError when the template rewrites content beyond trimming its ends."""
    stand_ins, cores = [], []
    for i, message in enumerate(messages):
        content = message["content"]
        if _CONTENT_PREFIX in content:
            raise PromptError(f"message {i} contains the reserved marker {RESERVED_PREFIX!r}; remove it from the text")
        # Leading/trailing whitespace stays around the stand-in, so a template that trims content trims it there.
        core = content.strip()
        lead = content[: len(content) - len(content.lstrip())] if core else content
        trail = content[len(content.rstrip()) :] if core else ""
        stand_ins.append({**message, "content": lead + _CONTENT_MARK.format(i) + trail})
        cores.append(core)
    rendered = tokenizer.apply_chat_template(stand_ins, tokenize=False, add_generation_prompt=True)
    segments: list[tuple[str, bool]] = []
    pos = 0
    for i, core in enumerate(cores):
        mark = _CONTENT_MARK.format(i)
        at = rendered.find(mark, pos)
        if at < 0 or rendered.count(mark) != 1:
            raise PromptError(
                f"the chat template drops, repeats or reorders message {i}, so its markup cannot be told apart from "
                "the messages' content; use a template that writes each message once, in order"
            )
        segments += [(rendered[pos:at], False), (core, True)]
        pos = at + len(mark)
    segments.append((rendered[pos:], False))
    text = PromptText(tuple((piece, kind) for piece, kind in segments if piece))
    plain = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    if text.text != plain:
        raise PromptError(
            "the chat template rewrites message content beyond trimming whitespace, so its markup cannot be told "
            "apart from the content; pass the content as the template would write it"
        )
    return text
