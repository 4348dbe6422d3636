"""A corpus's chunk KV ahead of requests: `precompute`, with or without context, and recorded contexts.

`CorpusMethods` is the part of `CacheBlendEngine` that takes a corpus (a retriever's chunks) rather than a
request: it stores every chunk's KV before any request needs it, isolated, after each chunk's nearest neighbours
(`chunk_context`), or from full prefills of groups of similar chunks (`grouped`), and records which context each
chunk's entry is built after.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

from ...config import DEFAULT_PRECOMPUTE_GROUPS, EngineConfig
from ..chunks.cache import ChunkCache
from ..chunks.context import NEIGHBOURS, ContextArg, assign_contexts, context_parts, corpus_ids
from ..prefill.prefiller import Prefiller
from ..request.prompt import PromptTemplate, TokenizedPrompt
from ..request.request import check_length
from ..serving.thread_pools import releasing_thread_pool
from .groups import GROUPS, check_groups_policy, fill_groups, group_indexes


class CorpusMethods:
    """The engine's methods over a corpus; `CacheBlendEngine` sets these attributes."""

    tokenizer: Any
    template: PromptTemplate
    config: EngineConfig
    chunks: ChunkCache
    max_tokens: int
    _lock: threading.RLock
    _prefiller: Prefiller

    @releasing_thread_pool
    def precompute(
        self,
        chunks: Sequence[str],
        question: str | None = None,
        *,
        template: PromptTemplate | None = None,
        prefix: str | None = None,
        context: ContextArg = NEIGHBOURS,
        show_progress: bool = False,
        group_tokens: int | None = None,
    ) -> tuple[int, int]:
        """Make sure every chunk's KV is in the store, for the template's prefix or an explicit prefix.

        `chunks` are taken as the corpus: each chunk's KV is prefilled after its `config.context_neighbours` most
        similar other chunks among them (`set_chunk_context`; `context=None` stores isolated entries, "keep" the
        contexts recorded already, a list per chunk gives other context texts; "groups" lays them out in groups of
        similar chunks of up to `group_tokens` tokens (default: `config.group_tokens`, else 3072) and keeps
        each chunk's KV from its group's full prefill: `precompute_groups`). The default follows the engine's
        settings: "groups" while grouped precompute is in force (`config.group_tokens`, the default), else
        neighbours. A chunk with a context also gets its isolated entry, which a prompt reads for its first chunk
        (whose real context is the prefix alone).
        The template's prefix does not depend on the question, so `question` is only needed by templates that
        place it before the chunks. Returns (already cached, newly computed).
        """
        if isinstance(context, str) and context == NEIGHBOURS and self.config.group_tokens:
            context = GROUPS  # the two settings are exclusive: this engine's corpus context is its groups
        grouped = isinstance(context, str) and context == GROUPS
        if grouped:
            check_groups_policy(self.config.capture_policy)
        prefix_ids, chunk_ids = self._take_corpus(chunks, None if grouped else context, question, template, prefix)
        if grouped:
            group_tokens = group_tokens or self.config.group_tokens or DEFAULT_PRECOMPUTE_GROUPS
            found = group_indexes(chunks, [len(ids) for ids in chunk_ids], group_tokens)
            return self._fill_groups(prefix_ids, [[chunk_ids[i] for i in g] for g in found], show_progress)
        with self._lock:
            return self.chunks.fill(prefix_ids, chunk_ids, show_progress=show_progress, heads=True)

    @releasing_thread_pool
    def precompute_groups(
        self, groups: Sequence[Sequence[str]], question: str | None = None, *, template: PromptTemplate | None = None,
        prefix: str | None = None, show_progress: bool = False,
    ) -> tuple[int, int]:  # fmt: skip
        """`precompute(context="groups")` with the groups given (each a list of chunks in prefill order; a chunk in
        one group only): every chunk's isolated entry, and each group's later chunks' KV from one full prefill of
        the group, stored as their captured entries (`grouped`). Returns (already cached, newly computed)."""
        check_groups_policy(self.config.capture_policy)
        flat = [c for group in groups for c in group]
        prefix_ids, chunk_ids = self._take_corpus(flat, None, question, template, prefix)
        spans = itertools.accumulate((len(g) for g in groups), initial=0)
        return self._fill_groups(prefix_ids, [chunk_ids[a:b] for a, b in itertools.pairwise(spans)], show_progress)

    def _fill_groups(
        self, prefix_ids: tuple[int, ...], groups: Sequence[Sequence[tuple[int, ...]]], show_progress: bool
    ) -> tuple[int, int]:
        """Check that the longest group fits the model, then store the groups' entries (`grouped.fill_groups`)."""
        longest = max(groups, key=lambda g: sum(map(len, g)))
        check_length(TokenizedPrompt(prefix_ids, tuple(longest), (0,)), 0, self.max_tokens)
        with self._lock:
            return fill_groups(self.chunks, self._prefiller, prefix_ids, groups, show_progress=show_progress)

    def set_chunk_context(
        self, chunks: Sequence[str], context: ContextArg = NEIGHBOURS, *, question: str | None = None,
        template: PromptTemplate | None = None, prefix: str | None = None,
    ) -> int:  # fmt: skip
        """Record what each chunk's KV is prefilled after, computing none: its `config.context_neighbours` most
        similar chunks among `chunks` ("neighbours"), nothing (None), or the texts given per chunk (in order).

        Requests then read, and on a miss store, each chunk's contextual entry (its key holds the context's
        digest). Give it the whole corpus (a retriever's chunks) when an index is built or loaded. Returns how
        many chunks have a context.
        """
        _, chunk_ids = self._take_corpus(chunks, context, question, template, prefix)
        return sum(1 for ids in chunk_ids if self.chunks.contexts.digest(ids))

    def _take_corpus(
        self, chunks: Sequence[str], context: ContextArg, question: str | None, template: PromptTemplate | None,
        prefix: str | None,
    ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:  # fmt: skip
        """Check and tokenize a corpus, record each chunk's context; -> (prefix ids, chunk ids)."""
        prefix_ids, chunk_ids = corpus_ids(self.tokenizer, template or self.template, chunks, question, prefix,
                                           self.config.chunk_separator, self.max_tokens)  # fmt: skip
        parts = context_parts(chunks, context, self.config.context_neighbours)  # embeds: outside the lock
        with self._lock:
            assign_contexts(self.chunks.contexts, self.tokenizer, chunk_ids, parts, self.config.chunk_separator)
        return prefix_ids, chunk_ids
