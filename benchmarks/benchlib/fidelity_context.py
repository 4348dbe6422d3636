"""Contextual chunk KV in the fidelity benchmark: every method measured again on chunk KV prefilled after each
chunk's nearest neighbours, searched in the data set's whole passage pool, or captured from an earlier request.

`fidelity.py --chunk-context neighbours` adds, beside each method on isolated chunk KV (`attention@0.15`), the
same method on contextual KV (`attention@0.15+ctx`), against the same full-recompute reference. The neighbours
of a case's chunk are its `n` most similar passages among every case's passages of the set (all-MiniLM-L6-v2
cosine, the chunk's own text left out), as a user's index over the whole corpus would give them, never the
case's own passages alone. The paired table is `fidelity_codecs.codec_differences` with "ctx" as the variant.

`--chunk-context captured` measures chunk KV as `EngineConfig(chunk_context="captured")` keeps it
(`attention@0.15+cap`): each chunk's entry cut from the full prefill of an earlier request that retrieved the same
passages in another order (a seeded shuffle per case), so a chunk's cached context is the passages that came before it
there, not here. The prompt's first chunk reads its own (isolated) entry, as the engine does: when the earlier request
had it elsewhere, it is prefilled alone during the measured request (in its TTFT, not in its compute share).
`--chunk-context captured-mixed` (`+capmix`) is the harder case: two earlier requests, each with half of the
case's passages and as many passages of other cases of the set, shuffled, so a chunk was captured mostly after
text that is not in the measured prompt.
`--chunk-context grouped` (`+grp`) measures `precompute(context="groups")`: the set's whole pool laid out in groups of
similar passages (`retrieval.groups`, up to `--group-tokens` tokens each), and each case's chunks stored from one
full prefill of their groups (`engine.precompute_groups`), isolated entries beside them.
With `--kv-codec int4` as well, every variant is also read through each codec (`attention@0.15+grp+int4`): its
entries of the case copied into a store that encodes them (`VariantThroughCodec`), paired against the variant
uncompressed.
"""

from __future__ import annotations

import hashlib
import random
import statistics
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from benchlib.fidelity_codecs import CodecDifference
from benchlib.fidelity_run import copy_chunks
from cacheblend_rag.engine import CacheBlendEngine, TokenizedPrompt
from cacheblend_rag.engine.request.prompt import tokenize_chunks
from cacheblend_rag.evaluation.datasets import Case, Dataset, TaskSpec
from cacheblend_rag.retrieval.embeddings import embed_texts, load_embedder
from cacheblend_rag.retrieval.groups import similarity_groups
from cacheblend_rag.retrieval.neighbours import nearest_neighbours, neighbour_context

CONTEXT = "ctx"  # the variant name: `attention@0.15+ctx`
CAPTURED = "cap"  # `attention@0.15+cap`
CAPTURED_MIXED = "capmix"  # `attention@0.15+capmix`
GROUPED = "grp"  # `attention@0.15+grp`
CONTEXT_VARIANTS = (CONTEXT, CAPTURED, CAPTURED_MIXED, GROUPED)


def text_rank(text: str) -> str:
    """A passage's place in a fixed order of the corpus (its sha256), the same however the corpus is listed."""
    return hashlib.sha256(text.encode()).hexdigest()


class PoolNeighbours:
    """Each passage's nearest neighbours in a data set's pool (every case's passages, duplicates once).

    `acyclic`: only among passages earlier in a fixed order of the pool (`text_rank`), so no two passages are in
    each other's context (research/README.md, "Which passages to cache a chunk after": chunks cached after each other,
    all in one prompt, broke a MuSiQue answer); searched among the 8n + 16 nearest, so a passage early in the
    order may get fewer than n, and the first none."""

    def __init__(self, dataset: Dataset, n: int, acyclic: bool = False) -> None:
        self.n, self.acyclic = n, acyclic
        self.pool = list(dict.fromkeys(c for case in dataset.cases for c in case.chunks))
        self.vectors = embed_texts(load_embedder(), self.pool, batch_size=32, show_progress=False)
        self.row = {t: i for i, t in enumerate(self.pool)}

    def context(self, chunks: list[str]) -> list[list[str]]:
        """Per chunk, its neighbours in the order they are prefilled before it (nearest last)."""
        queries = self.vectors[[self.row[c] for c in chunks]]
        depth = min(8 * self.n + 16, len(self.pool)) if self.acyclic else self.n
        found = nearest_neighbours(queries, self.vectors, depth, query_texts=chunks, pool_texts=self.pool)
        if self.acyclic:
            found = [[j for j in ids if text_rank(self.pool[j]) < text_rank(c)][: self.n]
                     for c, ids in zip(chunks, found, strict=True)]  # fmt: skip
        return [neighbour_context([self.pool[j] for j in ids]) for ids in found]


def context_engine(engine: CacheBlendEngine, n: int) -> CacheBlendEngine:
    """An engine on `engine`'s model (shared) with its own store, for contextual entries of `n` neighbours (each
    chunk's given as its context by `ContextPreparer`; only exact entries captured, as such entries need)."""
    config = replace(engine.config, chunk_context="isolated")
    return CacheBlendEngine(engine.model, engine.tokenizer, config=config, template=engine.template)


class ContextPreparer:
    """Fills a context engine's store with a case's contextual chunk KV (timed), one data set's pool each."""

    def __init__(self, full_datasets: dict[str, Dataset], n: int, acyclic: bool = False) -> None:
        self.full = full_datasets  # by set name: every case, whose passages make the pool
        self.n, self.acyclic = n, acyclic
        self._pools: dict[str, PoolNeighbours] = {}

    def __call__(self, engine: CacheBlendEngine, spec: TaskSpec, case: Case, prompt: TokenizedPrompt) -> dict[str, Any]:
        pool = self._pools.get(spec.name)
        if pool is None:
            pool = self._pools[spec.name] = PoolNeighbours(self.full[spec.name], self.n, self.acyclic)
        engine.clear_store()
        engine.chunks.contexts.clear()
        chunks = list(case.chunks)
        parts = pool.context(chunks)
        t = time.perf_counter()
        engine.precompute(chunks, case.question, template=spec.template, context=parts)
        precompute_s = time.perf_counter() - t
        context_tokens = [len(engine.chunks.contexts.tokens(ids)) for ids in prompt.chunk_ids]
        return {
            "context_neighbours": self.n,
            "context_order": "acyclic" if self.acyclic else "nearest",
            "precompute_s": precompute_s,
            "context_tokens": sum(context_tokens) / max(len(context_tokens), 1),  # per chunk, mean
            "chunk_tokens": sum(len(ids) for ids in prompt.chunk_ids) / max(len(prompt.chunk_ids), 1),
        }


def capture_engine(engine: CacheBlendEngine) -> CacheBlendEngine:
    """An engine on `engine`'s model (shared) with its own store, keeping chunk KV as full prefills capture it."""
    config = replace(engine.config, miss_policy="blend", chunk_context="grouped")
    return CacheBlendEngine(engine.model, engine.tokenizer, config=config, template=engine.template)


_cold_engines: weakref.WeakKeyDictionary[CacheBlendEngine, CacheBlendEngine] = weakref.WeakKeyDictionary()


def answer_cold(engine: CacheBlendEngine, prompt: TokenizedPrompt) -> int:
    """Serve `prompt` as a cold request meets a capture engine: its chunks are not stored, the miss policy answers
    it with a full prefill, and that prefill's chunk KV is stored as `chunk_context="grouped"` keeps it (an engine on
    the same model and store whose miss policy is "full"; the measuring engine's own, "blend", would prefill the missed
    chunks alone). -> how many chunks were captured."""
    cold = _cold_engines.get(engine)
    if cold is None or cold.store is not engine.store:
        config = replace(engine.config, miss_policy="full")
        cold = CacheBlendEngine(engine.model, engine.tokenizer, config=config, template=engine.template,
                                store=engine.store)  # fmt: skip
        _cold_engines[engine] = cold
    pre = cold.prefill(prompt, "blend")
    assert pre.metrics.mode == "full", "the earlier request must be cold: clear the store first"
    return pre.metrics.chunks_captured


def earlier_order(case_id: str, n: int) -> list[int]:
    """The order an earlier request retrieved a case's n passages in: a shuffle seeded by the case, never the
    prompt's own order (when n > 1)."""
    rng = random.Random(f"captured:{case_id}")
    order = list(range(n))
    while n > 1 and order == sorted(order):
        rng.shuffle(order)
    return order


class CapturePreparer:
    """Fills a capture engine's store with a case's chunk KV cut from the full prefill of an earlier request
    (the same passages in the order `order(case id, n)` gives, `earlier_order` by default; the same question)."""

    def __init__(self, order: Callable[[str, int], list[int]] = earlier_order) -> None:
        self.order = order

    def __call__(self, engine: CacheBlendEngine, spec: TaskSpec, case: Case, prompt: TokenizedPrompt) -> dict[str, Any]:
        engine.clear_store()
        order = self.order(case.id, len(prompt.chunk_ids))
        earlier = TokenizedPrompt(prompt.prefix_ids, tuple(prompt.chunk_ids[i] for i in order), prompt.suffix_ids)
        t = time.perf_counter()
        captured = answer_cold(engine, earlier)
        precompute_s = time.perf_counter() - t
        before, seen = {}, 0
        for i in order:
            before[i] = seen  # tokens before chunk i in the earlier prompt
            seen += len(prompt.chunk_ids[i])
        return {
            "capture_order": order,
            "captured_chunks": captured,
            "first_chunk_stored": order[0] == 0,  # else the measured request prefills its own entry
            "precompute_s": precompute_s,
            "context_tokens": sum(before.values()) / max(len(order), 1),  # per chunk, mean
            "chunk_tokens": sum(len(ids) for ids in prompt.chunk_ids) / max(len(order), 1),
            # chunks whose captured context is their real one here: the same passages before them, in order
            "same_context": sum(order[:k] == list(range(i)) for k, i in enumerate(order)),
        }


class MixedCapturePreparer:
    """Fills a capture engine's store from two earlier requests, each with half of the case's passages (a seeded
    split) and as many passages of other cases of the same set (`pools`: set name -> every case's passages),
    shuffled: each chunk is captured among passages the measured prompt does not have."""

    def __init__(self, pools: Mapping[str, Sequence[str]]) -> None:
        self.pools = pools

    def __call__(self, engine: CacheBlendEngine, spec: TaskSpec, case: Case, prompt: TokenizedPrompt) -> dict[str, Any]:
        engine.clear_store()
        rng = random.Random(f"captured-mixed:{case.id}")
        own = list(range(len(prompt.chunk_ids)))
        rng.shuffle(own)
        others = [c for c in self.pools[spec.name] if c not in set(case.chunks)]
        halves, captured, t = [own[::2], own[1::2]], 0, time.perf_counter()
        for half in halves:
            if not half:
                continue
            strangers = tokenize_chunks(engine.tokenizer, rng.sample(others, min(len(half), len(others))),
                                        engine.config.chunk_separator)  # fmt: skip
            parts = [prompt.chunk_ids[i] for i in half] + list(strangers)
            rng.shuffle(parts)
            earlier = TokenizedPrompt(prompt.prefix_ids, tuple(parts), prompt.suffix_ids)
            captured += answer_cold(engine, earlier)
        return {"captured_halves": halves, "captured_chunks": captured, "precompute_s": time.perf_counter() - t}


class GroupPreparer:
    """Fills a capture engine's store with a case's chunk KV as grouped precompute over the set's whole pool gives
    it: the groups holding the case's passages, each prefilled once up to the last of them (`engine.precompute_groups`;
    a causal prefill gives them the KV the whole group's prefill does)."""

    def __init__(self, full_datasets: dict[str, Dataset], group_tokens: int) -> None:
        self.full = full_datasets  # by set name: every case, whose passages make the pool
        self.group_tokens = group_tokens
        self._groups: dict[str, dict[str, tuple[str, ...]]] = {}  # set name -> passage -> its group

    def groups_of(self, engine: CacheBlendEngine, name: str) -> dict[str, tuple[str, ...]]:
        if name not in self._groups:
            pool = list(dict.fromkeys(c for case in self.full[name].cases for c in case.chunks))
            vectors = embed_texts(load_embedder(), pool, batch_size=32, show_progress=False)
            lengths = [len(ids) for ids in tokenize_chunks(engine.tokenizer, pool, engine.config.chunk_separator)]
            found = similarity_groups(vectors, pool, lengths, self.group_tokens)
            self._groups[name] = {pool[i]: tuple(pool[j] for j in group) for group in found for i in group}
        return self._groups[name]

    def __call__(self, engine: CacheBlendEngine, spec: TaskSpec, case: Case, prompt: TokenizedPrompt) -> dict[str, Any]:
        group_of = self.groups_of(engine, spec.name)
        engine.clear_store()
        groups = list(dict.fromkeys(group_of[c] for c in case.chunks))
        # each group up to its last passage of this case: a causal prefill gives those passages the same KV
        wanted = set(case.chunks)
        groups = [g[: max(i for i, c in enumerate(g) if c in wanted) + 1] for g in groups]
        t = time.perf_counter()
        engine.precompute_groups([list(g) for g in groups], case.question, template=spec.template)
        precompute_s = time.perf_counter() - t
        tokens = dict(zip(case.chunks, (len(ids) for ids in prompt.chunk_ids), strict=True))
        length = {c: len(ids) for g in groups for c, ids in zip(g, tokenize_chunks(
            engine.tokenizer, list(g), engine.config.chunk_separator), strict=True)}  # fmt: skip
        before = [sum(length[x] for x in group_of[c][: group_of[c].index(c)]) for c in case.chunks]
        return {
            "group_tokens": self.group_tokens,
            "groups": len(groups),
            "precompute_s": precompute_s,
            "context_tokens": sum(before) / max(len(before), 1),  # per chunk, mean: its group's text before it
            "chunk_tokens": sum(tokens.values()) / max(len(tokens), 1),
            "first_in_group": sum(b == 0 for b in before),  # chunks with no captured entry (isolated everywhere)
        }


Preparer = Callable[[CacheBlendEngine, TaskSpec, Case, TokenizedPrompt], dict[str, Any]]


class VariantThroughCodec:
    """Prepares a variant of the chunk KV read through a codec (`grp+int4`) without computing it again: the case's
    entries as the variant's own engine holds them, put into the codec engine's store, which encodes them.

    `fill_variant` is the variant's own preparer (register it for the variant); called for a codec engine, this
    fills the variant's engine first when it holds another case (its records were taken, or done before a resume).
    """

    def __init__(self, variant_engine: CacheBlendEngine, prepare: Preparer) -> None:
        self.engine, self.prepare = variant_engine, prepare
        self.filled: tuple[str, str] | None = None  # the case the variant's engine holds
        self.extra: dict[str, Any] = {}  # what its preparer reported for that case

    def fill_variant(self, engine: CacheBlendEngine, spec: TaskSpec, case: Case, prompt: TokenizedPrompt) -> dict:
        if engine is not self.engine:
            raise ValueError("fill_variant prepares the variant's own engine")
        self.extra = self.prepare(engine, spec, case, prompt)
        self.filled = (spec.name, case.id)
        return self.extra

    def __call__(self, engine: CacheBlendEngine, spec: TaskSpec, case: Case, prompt: TokenizedPrompt) -> dict:
        if self.filled != (spec.name, case.id):
            self.fill_variant(self.engine, spec, case, prompt)
        engine.clear_store()
        copy_chunks(self.engine, engine, prompt)
        return dict(self.extra)


CONTEXT_INTRO = (
    "### Contextual chunk KV: paired difference to isolated chunk KV",
    "Per case, the method on chunk KV prefilled after each chunk's nearest passages of the data set's whole pool "
    "(`ctx`), or cut from an earlier request's full prefill of the same passages in another order (`cap`) or of "
    "half of them among passages of other cases (`capmix`), or from full prefills of groups of similar passages of "
    "the pool (`grp`), minus "
    "the same method on chunk KV prefilled alone, against the same full-recompute reference; a negative "
    "difference is closer to full recompute: 'closer' or 'further' where the 95% interval excludes 0.",
)


def variant_cases(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records of the cases a context variant was measured on, when there is one (else all): a run that took
    the isolated methods' records of more cases (`--take-records`) then compares every method on the same cases,
    in its tables and figures alike."""
    cases = {(r["dataset"], r["case_id"]) for r in records if r.get("codec") in CONTEXT_VARIANTS}
    return [r for r in records if (r["dataset"], r["case_id"]) in cases] if cases else list(records)


def context_verdict(r: CodecDifference) -> str:
    """Whether contextual KV moved the method closer to full recompute, beyond its interval."""
    lo, hi = r.kl_diff_ci
    return "closer" if hi < 0 else "further" if lo > 0 else "no clear change"


def split_context_rows(rows: Sequence[CodecDifference]) -> tuple[list[CodecDifference], list[CodecDifference]]:
    """(the codecs' rows, the contextual rows) of `codec_differences`."""
    return [r for r in rows if r.codec not in CONTEXT_VARIANTS], [r for r in rows if r.codec in CONTEXT_VARIANTS]


def precompute_cost(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown lines: per data set and variant (neighbours, groups), the tokens a chunk's entry is prefilled after
    per chunk, the tokens prefilled per chunk token over a corpus (the entry and the isolated one a prompt's first
    chunk reads, which `precompute` stores beside it), and the precompute seconds per case (one record per case;
    a grouped case prefills whole groups of the pool, of which a corpus prefills each once)."""
    by_set: dict[str, list[Mapping[str, Any]]] = {}
    seen: set[tuple[str, str]] = set()
    for r in records:
        # captured entries cost no precompute: the earlier request's full prefill computed them anyway
        if r.get("codec") in (CONTEXT, GROUPED) and "precompute_s" in r and (r["dataset"], r["case_id"]) not in seen:
            seen.add((r["dataset"], r["case_id"]))
            by_set.setdefault(f"{r['dataset']} ({r['codec']})", []).append(r)
    if not by_set:
        return []
    lines = ["| data set | cases | chunk tokens | context tokens per chunk | prefilled / chunk tokens (both entries) | "
             "precompute per case (s) |", "|---|---|---|---|---|---|"]  # fmt: skip
    for ds, recs in sorted(by_set.items()):
        chunk = statistics.fmean(float(r["chunk_tokens"]) for r in recs)
        ctx = statistics.fmean(float(r["context_tokens"]) for r in recs)
        secs = statistics.fmean(float(r["precompute_s"]) for r in recs)
        # neighbours: the context again for every chunk; groups: each chunk once in its group (a corpus's cost)
        prefilled = 2.0 if ds.endswith(f"({GROUPED})") else (2 * chunk + ctx) / chunk
        lines.append(f"| {ds} | {len(recs)} | {chunk:.0f} | {ctx:.0f} | {prefilled:.2f}x | {secs:.0f} |")
    return lines
