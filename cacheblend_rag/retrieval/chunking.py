"""Splitting documents into chunks of at most N tokens of the LLM's tokenizer.

Scope: `Document` -> `Chunk` only. Every chunk is a verbatim slice of its document (outer whitespace
trimmed), cut at paragraph boundaries where possible, then at sentence ends, then at word boundaries (or,
for a single huge "word", anywhere). Pieces are packed greedily up to the token budget.

Chunk KV is cached by the chunk's exact text, so this module must be deterministic: the same documents,
tokenizer and settings always give byte-identical chunks. Nothing here depends on dict/set order,
randomness or the platform.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.retrieval.documents import Document

logger = logging.getLogger(__name__)

MIN_CHUNK_TOKENS = 16

# A blank line (possibly holding spaces or tabs) separates paragraphs.
_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n")
# A sentence ends after . ! ? (plus closing quotes/brackets) followed by whitespace, or after CJK
# full stops, which are not followed by a space. Abbreviations ("e.g. this") split too early; that is
# harmless because packing joins adjacent pieces back into the same verbatim slice.
_SENTENCE_END = re.compile(r"[.!?]+[\"'\u201d\u2019)\]]*(?=\s|$)|[\u3002\uff01\uff1f]+")
_WORD = re.compile(r"\S+")


class Tokenizer(Protocol):
    """What chunking needs from a tokenizer; any Hugging Face tokenizer fits."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class Chunk:
    """A piece of a document small enough to be one cached KV block."""

    text: str  # verbatim slice of the document; never empty or whitespace-only
    source: str  # the document's source (file path relative to the loaded folder)
    index: int  # position of this chunk within its document, from 0
    token_count: int  # len(tokenizer.encode(text, add_special_tokens=False))
    metadata: Mapping[str, object] = field(default_factory=dict, hash=False)  # the document's metadata


class _Span(NamedTuple):
    start: int  # inclusive character offset into the document text
    end: int  # exclusive


def _validate(chunk_tokens: int, overlap_tokens: int, tokenizer: object) -> None:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < MIN_CHUNK_TOKENS:
        raise ConfigError(
            f"chunk_tokens must be an integer >= {MIN_CHUNK_TOKENS}, got {chunk_tokens!r}; "
            "use e.g. 512 (the paper's chunk size)"
        )
    if isinstance(overlap_tokens, bool) or not isinstance(overlap_tokens, int):
        raise ConfigError(f"overlap_tokens must be an integer, got {overlap_tokens!r}; use 0 for no overlap")
    if not 0 <= overlap_tokens < chunk_tokens:
        raise ConfigError(
            f"overlap_tokens must be in [0, chunk_tokens) = [0, {chunk_tokens}), got {overlap_tokens}; "
            f"use 0 for no overlap or a value below {chunk_tokens}"
        )
    if not callable(getattr(tokenizer, "encode", None)):
        raise ConfigError(
            f"tokenizer must have encode(text, add_special_tokens=False) -> list[int], got "
            f"{type(tokenizer).__name__}; pass the LLM's Hugging Face tokenizer"
        )


def _trim(text: str, start: int, end: int) -> _Span | None:
    """The span without its leading/trailing whitespace, or None when nothing else is left."""
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return _Span(start, end) if start < end else None


def _cut(text: str, span: _Span, cuts: Iterable[int]) -> list[_Span]:
    """Split `span` at the given offsets, trimming whitespace and dropping empty pieces."""
    pieces: list[_Span] = []
    start = span.start
    for cut in [*cuts, span.end]:
        piece = _trim(text, start, cut)
        if piece is not None:
            pieces.append(piece)
        start = cut
    return pieces


class _Splitter:
    """Splits one document; holds the text, the tokenizer and the budget so helpers stay short."""

    def __init__(self, text: str, tokenizer: Tokenizer, chunk_tokens: int, overlap_tokens: int) -> None:
        self.text = text
        self.tokenizer = tokenizer
        self.limit = chunk_tokens
        self.overlap = overlap_tokens

    def count(self, start: int, end: int) -> int:
        # Always measure the exact slice: BPE token counts are not additive across a join, so summing the
        # counts of pieces could overshoot the budget.
        return len(self.tokenizer.encode(self.text[start:end], add_special_tokens=False))

    def chunks(self, advance: Callable[[int], object]) -> list[tuple[_Span, int]]:
        """(span, token count) of each chunk of the document, in order; `advance(n)` after each n characters."""
        whole = _trim(self.text, 0, len(self.text))
        if whole is None:
            return []
        pieces: list[_Span] = []
        paragraphs = _cut(self.text, whole, (m.start() for m in _PARAGRAPH_BREAK.finditer(self.text, *whole)))
        done = 0
        for paragraph in paragraphs:
            pieces.extend(self._fit(paragraph))
            advance(paragraph.end - done)
            done = paragraph.end
        packed = self._pack(pieces)
        advance(len(self.text) - done)
        return packed

    def _fit(self, paragraph: _Span) -> list[_Span]:
        """Pieces of a paragraph that each fit the budget on their own."""
        if self.count(*paragraph) <= self.limit:
            return [paragraph]
        pieces: list[_Span] = []
        sentence_ends = (m.end() for m in _SENTENCE_END.finditer(self.text, *paragraph))
        for sentence in _cut(self.text, paragraph, sentence_ends):
            if self.count(*sentence) <= self.limit:
                pieces.append(sentence)
            else:
                pieces.extend(self._hard_split(sentence))
        return pieces

    def _longest_fit(self, start: int, ends: Sequence[int]) -> int | None:
        """The largest end in the ascending `ends` such that text[start:end] fits, by binary search."""
        lo, hi, best = 0, len(ends) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            if self.count(start, ends[mid]) <= self.limit:
                best, lo = ends[mid], mid + 1
            else:
                hi = mid - 1
        return best

    def _hard_split(self, span: _Span) -> list[_Span]:
        """Token windows over a sentence too long for one chunk, cut between words where possible."""
        windows: list[_Span] = []
        start = span.start
        # Every non-space word costs at least one token with real tokenizers, so no window can hold more
        # than `limit` words; the extra slack only guards against tokenizers that drop characters.
        max_words = 4 * self.limit + 1
        while True:
            # Measure windows from their first non-space character, so the count is the chunk's own.
            rest = _trim(self.text, start, span.end)
            if rest is None:
                break
            start = rest.start
            words = itertools.islice(_WORD.finditer(self.text, start, span.end), max_words)
            word_ends = [m.end() for m in words]
            end = self._longest_fit(start, word_ends)
            if end is None:
                # The first word alone is too long (a URL, base64, text without spaces): cut inside it.
                # A token is rarely longer than 16 characters, which bounds the search.
                char_ends = range(start + 1, min(word_ends[0], start + 16 * self.limit) + 1)
                end = self._longest_fit(start, char_ends) or start + 1  # always make progress
            windows.append(_Span(start, end))
            start = end
        return windows

    def _pack(self, pieces: list[_Span]) -> list[tuple[_Span, int]]:
        """Greedily join consecutive pieces while the joined slice fits the budget."""
        packed: list[tuple[_Span, int]] = []
        current: list[_Span] = []
        current_count = 0
        for piece in pieces:
            if current:
                joined = self.count(current[0].start, piece.end)
                if joined <= self.limit:
                    current.append(piece)
                    current_count = joined
                    continue
                packed.append((_Span(current[0].start, current[-1].end), current_count))
                current = self._overlap_tail(current, piece)
            current.append(piece)
            current_count = self.count(current[0].start, piece.end)
        if current:
            packed.append((_Span(current[0].start, current[-1].end), current_count))
        return packed

    def _overlap_tail(self, previous: list[_Span], following: _Span) -> list[_Span]:
        """The last whole pieces of the previous chunk to repeat at the start of the next one.

        Overlap is made of whole pieces (sentences, usually) totalling at most `overlap_tokens`, and only
        as much as still leaves room for `following`; a piece larger than the overlap is not repeated.
        """
        if self.overlap == 0:
            return []
        tail: list[_Span] = []
        for piece in reversed(previous):
            if self.count(piece.start, previous[-1].end) > self.overlap:
                break
            if self.count(piece.start, following.end) > self.limit:
                break
            tail.insert(0, piece)
        return tail


def split_documents(
    documents: Iterable[Document],
    tokenizer: Tokenizer,
    *,
    chunk_tokens: int = 512,
    overlap_tokens: int = 0,
    show_progress: bool = False,
) -> list[Chunk]:
    """Split documents into chunks of at most `chunk_tokens` tokens of `tokenizer`.

    `tokenizer` is anything with `encode(text, add_special_tokens=False) -> list[int]` (the LLM's Hugging
    Face tokenizer, so sizes are in the tokens the KV cache will hold). `overlap_tokens` repeats up to
    that many tokens of whole trailing pieces of a chunk at the start of the next one.

    Chunks come out in document order, then position order; documents with no text give no chunks.
    `show_progress` shows a progress bar over the documents' characters on stderr.
    """
    from tqdm.auto import tqdm

    _validate(chunk_tokens, overlap_tokens, tokenizer)
    if isinstance(documents, (str, Document)):
        raise ConfigError(
            f"documents must be a list of Document, got a single {type(documents).__name__}; "
            "wrap it in a list, or use load_documents(path) to read files"
        )
    documents = list(documents)
    for document in documents:
        if not isinstance(document, Document):
            raise ConfigError(
                f"documents must hold Document values, got {type(document).__name__}; "
                "build them with Document(text=..., source=...) or load_documents(path)"
            )

    chunks: list[Chunk] = []
    total = sum(len(d.text) for d in documents)
    with tqdm(total=total, desc="Chunking", unit="char", unit_scale=True, disable=not show_progress) as bar:
        for document in documents:
            bar.set_postfix_str(document.source[-40:], refresh=False)
            chunks.extend(_split_one(document, tokenizer, chunk_tokens, overlap_tokens, bar.update))
    return chunks


def _split_one(
    document: Document, tokenizer: Tokenizer, chunk_tokens: int, overlap_tokens: int, advance: Callable[[int], object]
) -> list[Chunk]:
    chunks: list[Chunk] = []
    splitter = _Splitter(document.text, tokenizer, chunk_tokens, overlap_tokens)
    index = 0
    for span, token_count in splitter.chunks(advance):
        if token_count == 0:
            # Text the tokenizer maps to nothing cannot be a KV block; the engine would reject it.
            logger.debug("dropping a chunk of %s that encodes to no tokens", document.source)
            continue
        text = document.text[span.start : span.end]
        chunks.append(Chunk(text, document.source, index, token_count, document.metadata))
        index += 1
    return chunks
