"""Token ids of the chunk texts that requests bring again: a retrieved chunk is tokenized once, not per request.

A RAG request passes its chunks as text (a retriever's documents), and most of them came in earlier requests too: a
passage many questions retrieve is tokenized for each of them. With a BPE tokenizer that costs about 2-3 us a token
on a CPU (the default model's: 7 ms for six 512-token chunks, 20 ms for fifteen), which is as long as the whole blend
is meant to take on a GPU at those lengths, and it is paid before the prefill starts. A chunk is tokenized alone
(`prompt.tokenize_chunks`), so its ids depend only on its text, the separator after it and the tokenizer: the ids
kept here are exactly what tokenizing it again would give.

`TokenCache` keeps the ids of recently tokenized chunk texts for one tokenizer, the least recently used dropped once
they hold more than `max_tokens` tokens in all (about 40 bytes a token: ~40 MB at the default budget). It is safe to
use from several threads, and from a forked child (`after_fork_in_child`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_TOKENS = 1 << 20  # ~2,000 chunks of 512 tokens

Encode = Callable[[str], tuple[int, ...]]  # a chunk's text with its separator -> its token ids


@dataclass(frozen=True)
class TokenCacheStats:
    """What a `TokenCache` holds and has done."""

    chunks: int  # chunk texts held
    tokens: int  # their tokens in all
    hits: int  # chunks whose ids were found
    misses: int  # chunks tokenized


class TokenCache:
    """Chunk text and separator -> token ids, for the one `tokenizer` it was made for (see the module docstring)."""

    def __init__(self, tokenizer: Any, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0 (0: keep nothing), got {max_tokens!r}")
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self._ids: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
        self._tokens = 0
        self._hits = self._misses = 0
        self._lock = threading.Lock()

    def chunk_ids(self, text: str, separator: str, encode: Encode) -> tuple[int, ...]:
        """The ids of chunk `text` followed by `separator`: kept ones, or `encode(text + separator)`, kept then."""
        key = (text, separator)
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
                self._hits += 1
                return ids
            self._misses += 1
        ids = encode(text + separator)  # outside the lock: other threads' hits need not wait for it
        if len(ids) > self.max_tokens:
            return ids
        with self._lock:
            if key not in self._ids:  # another thread may have tokenized it meanwhile
                self._ids[key] = ids
                self._tokens += len(ids)
                while self._tokens > self.max_tokens:
                    _, dropped = self._ids.popitem(last=False)
                    self._tokens -= len(dropped)
        return ids

    @property
    def stats(self) -> TokenCacheStats:
        with self._lock:
            return TokenCacheStats(len(self._ids), self._tokens, self._hits, self._misses)

    def clear(self) -> None:
        """Drop every chunk's ids (the counts stay)."""
        with self._lock:
            self._ids.clear()
            self._tokens = 0

    def after_fork_in_child(self) -> None:
        """A fresh lock: another thread may have held this one when the process forked (the ids stay valid)."""
        self._lock = threading.Lock()
