"""A corpus's chunk KV ahead of requests: `precompute`, in groups of similar chunks or alone, and recorded contexts.

`Corpus` is the part of the engine (`engine.corpus`) that takes a corpus (a retriever's chunks) rather than a
request: it stores every chunk's KV before any request needs it, from full prefills of groups of similar chunks
(`groups`, the default), isolated, or after texts the caller gives per chunk (`chunks.context`), and records which
context each chunk's entry is built after.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ...config import DEFAULT_GROUP_TOKENS, EngineConfig
from ..chunks.cache import ChunkCache
from ..chunks.context import ContextArg, assign_contexts, context_parts, corpus_ids
from ..prefill.prefiller import Prefiller
from ..request.prompt import PromptTemplate, TokenizedPrompt
from ..request.request import check_length
from ..request.token_cache import TokenCache
from ..serving.forking import ForkSteps
from ..serving.thread_pools import releasing_thread_pool
from .groups import GROUPS, PrecomputePlan, check_groups_policy, fill_groups, group_indexes

AUTO = "auto"  # `precompute(context=...)`: what the engine's `chunk_context` asks for


class Precomputed(NamedTuple):
    """What a precompute did: chunks whose entries were all stored already, and chunks with an entry computed now."""

    stored: int
    computed: int


class Corpus:
    """The engine's work over a corpus: its chunks' KV stored ahead of requests, and the context each is cached after.
    The engine checks that it is open and delegates (`engine.precompute`, `precompute_groups`, `set_chunk_context`)."""

    def __init__(
        self,
        tokenizer: Any,
        template: PromptTemplate,
        config: EngineConfig,
        chunks: ChunkCache,
        prefiller: Prefiller,
        token_cache: TokenCache,
        lock: threading.RLock,
        forks: ForkSteps,
        max_tokens: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template  # the engine's, for a call that gives none
        self.config = config  # its chunk separator, how chunk KV is cached (`chunk_context`)
        self.chunks = chunks
        self.prefiller = prefiller  # grouped precompute's full prefills
        self.token_cache = token_cache
        self._lock = lock  # the engine's: one forward at a time
        self._forks = forks
        self.max_tokens = max_tokens

    @releasing_thread_pool
    def precompute(
        self,
        chunks: Sequence[str],
        question: str | None = None,
        *,
        template: PromptTemplate | None = None,
        prefix: str | None = None,
        context: ContextArg = AUTO,
        show_progress: bool = False,
        group_tokens: int | None = None,
        on_plan: Callable[[PrecomputePlan], object] | None = None,
    ) -> Precomputed:
        """Make sure every chunk's KV is in the store, for the template's prefix or an explicit prefix.

        `chunks` are taken as the corpus. `context`: "groups" lays them out in groups of similar chunks of up to
        `group_tokens` tokens (default 3072) and keeps each chunk's KV from its group's full prefill (see
        `precompute_groups`); None stores each chunk's KV computed alone (its isolated entry); "keep" the contexts
        recorded already (`set_chunk_context`); one list of texts per chunk caches each after its texts. The
        default, "auto", is "groups" under `EngineConfig(chunk_context="grouped")` (the default), else None. A
        chunk with a context also gets its isolated entry, which a prompt reads for its first chunk (whose real
        context is the prefix alone). The template's prefix does not depend on the question, so `question` is only
        needed by templates that place it before the chunks. `on_plan(plan)` is told what will be computed (chunks,
        tokens, groups: a `PrecomputePlan`) before the first prefill, e.g. to print an estimate. Returns (chunks
        stored already, chunks computed now).
        """
        if isinstance(context, str) and context == AUTO:
            context = GROUPS if self.config.group_tokens else None
        grouped = isinstance(context, str) and context == GROUPS
        if grouped:
            check_groups_policy(self.config.capture_policy)
        prefix_ids, chunk_ids = self._take_corpus(chunks, None if grouped else context, question, template, prefix)
        if grouped:
            group_tokens = group_tokens or DEFAULT_GROUP_TOKENS
            found = group_indexes(chunks, [len(ids) for ids in chunk_ids], group_tokens)
            return self._fill_groups(prefix_ids, [[chunk_ids[i] for i in g] for g in found], show_progress, on_plan)
        with self._lock:
            if on_plan is not None:
                on_plan(self._alone_plan(prefix_ids, chunk_ids))
            return Precomputed(*self.chunks.fill(prefix_ids, chunk_ids, show_progress=show_progress, heads=True))

    @releasing_thread_pool
    def precompute_groups(
        self, groups: Sequence[Sequence[str]], question: str | None = None, *, template: PromptTemplate | None = None,
        prefix: str | None = None, show_progress: bool = False,
    ) -> Precomputed:  # fmt: skip
        """`precompute(context="groups")` with the groups given (each a list of chunks in prefill order; a chunk in
        one group only): every chunk's isolated entry, and each group's later chunks' KV from one full prefill of
        the group, stored as their captured entries (`groups`). Returns (chunks stored already, computed now)."""
        check_groups_policy(self.config.capture_policy)
        flat = [c for group in groups for c in group]
        prefix_ids, chunk_ids = self._take_corpus(flat, None, question, template, prefix)
        spans = itertools.accumulate((len(g) for g in groups), initial=0)
        return self._fill_groups(prefix_ids, [chunk_ids[a:b] for a, b in itertools.pairwise(spans)], show_progress)

    def _alone_plan(self, prefix_ids: tuple[int, ...], chunk_ids: Sequence[tuple[int, ...]]) -> PrecomputePlan:
        """What `chunks.fill(..., heads=True)` will compute: each chunk's own entry, and its isolated one when it has
        a context."""
        unique = list(dict.fromkeys(chunk_ids))
        found = {}
        for ids in unique:
            keys = [self.chunks.key(prefix_ids, ids)]
            if self.chunks.contexts.digest(ids):
                keys.append(self.chunks.key(prefix_ids, ids, isolated=True))
            found[ids] = [k in self.chunks.store for k in keys]
        todo = [ids for ids in unique if not all(found[ids])]
        partly = sum(any(found[ids]) for ids in todo)
        return PrecomputePlan(len(unique), len(unique) - len(todo), partly, len(todo), sum(map(len, todo)), 0, 0, 0)

    def _fill_groups(
        self, prefix_ids: tuple[int, ...], groups: Sequence[Sequence[tuple[int, ...]]], show_progress: bool,
        on_plan: Callable[[PrecomputePlan], object] | None = None,
    ) -> Precomputed:  # fmt: skip
        """Check that the longest group fits the model, then store the groups' entries (`groups.fill_groups`)."""
        longest = max(groups, key=lambda g: sum(map(len, g)))
        check_length(TokenizedPrompt(prefix_ids, tuple(longest), (0,)), 0, self.max_tokens)
        with self._lock:
            done = fill_groups(self.chunks, self.prefiller, prefix_ids, groups, show_progress=show_progress,
                               on_plan=on_plan)  # fmt: skip
        return Precomputed(*done)

    def set_chunk_context(
        self, chunks: Sequence[str], context: ContextArg, *, question: str | None = None,
        template: PromptTemplate | None = None, prefix: str | None = None,
    ) -> int:  # fmt: skip
        """Record what each chunk's KV is prefilled after, computing none: the texts given per chunk (in order, the
        nearest last), or nothing (None: isolated entries).

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
        self._forks.check()
        prefix_ids, chunk_ids = corpus_ids(self.tokenizer, template or self.template, chunks, question, prefix,
                                           self.config.chunk_separator, self.max_tokens, self.token_cache)  # fmt: skip
        parts = context_parts(chunks, context)
        with self._lock:
            assign_contexts(self.chunks.contexts, self.tokenizer, chunk_ids, parts, self.config.chunk_separator)
        return prefix_ids, chunk_ids
