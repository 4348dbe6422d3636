"""Near copies in a chunk's context: how often similar chunks are overlapping windows of one text, and what a
chunk's KV cached after such a window does to the blend (research/README.md, "Near copies in a chunk's context").

    python research/near_copies.py stats --data-dir ../shared/data
    python research/near_copies.py case musique musique-10 --data-dir ../shared/data
    python research/near_copies.py case multi_news multi_news-0cd7b... --ablate apart
    python research/near_copies.py case musique musique-6 --ablate none

`stats` (no language model): per data set, the share of each passage pool's similarity chain (grouped
precompute's order, near copies allowed) whose neighbours share word 8-grams, and how many cases hold near copies
among their own passages.

`case`: one case's grouped entries as the fidelity benchmark builds them (the set's whole pool, 3,072-token groups)
with near copies allowed and left apart (an entry cached after near copies of its chunk is read only where the
prompt shows them before it too, `ChunkCache.read_keys`); then each later chunk read from its
isolated entry in turn and each alone from its grouped entry (of the layout `--ablate` names), and neighbour
context (2, the pool) left apart: mean KL(full || method) and the first token, for full reuse and the default
blend.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import numpy as np

import cacheblend_rag.retrieval.overlap as overlap
from cacheblend_rag import BlendConfig, CacheBlendEngine, EngineConfig
from cacheblend_rag.engine.request.prompt import tokenize_chunks
from cacheblend_rag.evaluation import load_dataset
from cacheblend_rag.evaluation.fidelity import measure, reference_answer
from cacheblend_rag.retrieval.embeddings import embed_texts, load_embedder
from cacheblend_rag.retrieval.groups import similarity_chain, similarity_groups
from cacheblend_rag.retrieval.neighbours import neighbour_context, neighbour_texts

SETS = ("musique", "wikimqa", "multi_news", "samsum")


def pool_of(dataset) -> list[str]:
    return list(dict.fromkeys(c for case in dataset.cases for c in case.chunks))


def shared(a: str, b: str) -> float:
    sa, sb = overlap.shingles(a), overlap.shingles(b)
    return len(sa & sb) / max(1, min(len(sa), len(sb)))


def stats(data_dir: str) -> None:
    bins = [0, 0.001, 0.02, 0.1, 0.3, 0.6, 0.9, 1.01]
    print("| set | passages | chain neighbours sharing >= 0.1 | >= 0.6 | cases with near copies among own passages |")
    print("|---|---:|---:|---:|---:|")
    for name in SETS:
        ds = load_dataset(name, data_dir, None)
        pool = pool_of(ds)
        with near_copies_allowed():  # the chain as it was
            order = similarity_chain(embed_texts(load_embedder(), pool, batch_size=64, show_progress=False), pool)
        fr = np.array([shared(pool[a], pool[b]) for a, b in zip(order, order[1:], strict=False)])
        own = sum(
            any(overlap.near_copies(c[i], c[j]) for i in range(len(c)) for j in range(i + 1, len(c)))
            for c in (case.chunks for case in ds.cases)
        )
        print(f"| {name} | {len(pool)} | {(fr >= 0.1).mean():.2f} | {(fr >= 0.6).mean():.2f} | {own}/{len(ds.cases)} |")
        print(f"<!-- {name} histogram over {bins}: {np.histogram(fr, bins=bins)[0].tolist()} -->")


def case_study(name: str, case_id: str, data_dir: str, ablate: str = "allowed") -> None:
    engine = CacheBlendEngine.from_pretrained(config=EngineConfig(miss_policy="blend"), show_progress=False)
    ds = load_dataset(name, data_dir, None)
    case = next(c for c in ds.cases if c.id == case_id)
    pool, chunks, spec = pool_of(ds), list(case.chunks), ds.spec
    vectors = embed_texts(load_embedder(), pool, batch_size=64, show_progress=False)
    lengths = [len(ids) for ids in tokenize_chunks(engine.tokenizer, pool, engine.config.chunk_separator)]
    prompt = engine.build_prompt(chunks, case.question, template=spec.template)
    engine.precompute(chunks, case.question, template=spec.template, context=None)
    ref = reference_answer(engine, prompt, spec.max_new_tokens)
    # per chunk, the captured entries it may be read from in this prompt: cached after the near copies of it that
    # the prompt shows before it, then the plain one (`ChunkCache.read_keys`; none for the first chunk)
    reading = engine.chunks.reading(prompt.chunk_ids)
    keys = [engine.chunks.read_keys(prompt.prefix_ids, ids, j, "all", isolated=iso, copies=cp)[:-1]
            for j, (ids, (iso, cp)) in enumerate(zip(prompt.chunk_ids, reading, strict=True))]  # fmt: skip
    every = [k for ks in keys for k in ks]

    def row(label: str, eng: CacheBlendEngine = engine) -> None:
        a, b = measure(eng, prompt, ref, None), measure(eng, prompt, ref, BlendConfig())
        print(f"| {label} | {a['kl_mean']:.3f} ({'kept' if a['first_token'] else 'lost'}) | "
              f"{b['kl_mean']:.3f} ({'kept' if b['first_token'] else 'lost'}) |", flush=True)  # fmt: skip

    def load(found: list) -> None:
        for k in every:
            engine.store.discard(k)
        for kv in found:
            engine.store.put(kv)

    print(f"{case_id}: answer {ref.text!r}\n\n| chunk KV | reuse | default (r = 0.15) |\n|---|---:|---:|")
    row("isolated")
    layouts = {allowed: group_of(pool, vectors, lengths, allowed=allowed) for allowed in (True, False)}
    entries: dict[bool, dict[int, list]] = {}
    for allowed, layout in layouts.items():  # near copies allowed, then left apart
        load([])
        wanted = set(chunks)
        groups = [g[: max(i for i, c in enumerate(g) if c in wanted) + 1]
                  for g in dict.fromkeys(layout[c] for c in chunks)]  # fmt: skip
        engine.precompute_groups([list(g) for g in groups], case.question, template=spec.template)
        entries[allowed] = {j: [engine.store.get(k) for k in ks if k in engine.store] for j, ks in enumerate(keys)}
        entries[allowed] = {j: found for j, found in entries[allowed].items() if found}
        read = sum(bool(found) for found in entries[allowed].values())
        row(f"grouped, near copies {'allowed' if allowed else 'apart'} ({read} chunks read a grouped entry)")
    if ablate == "none":
        return
    saved, layout = entries[ablate == "allowed"], layouts[ablate == "allowed"]

    for j in saved:  # the ablated layout: one chunk at a time isolated, then one at a time grouped
        load([kv for other, found in saved.items() if other != j for kv in found])
        before = layout[chunks[j]][: layout[chunks[j]].index(chunks[j])]
        most = max((shared(chunks[j], b) for b in before), default=0.0)
        row(
            f"{ablate}, chunk {j} isolated ({len(before)} passages before it in its group, "
            f"{sum(overlap.near_copies(chunks[j], b) for b in before)} near copies, most shared {most:.2f})"
        )
    for j, found in saved.items():
        load(found)
        row(f"{ablate}, only chunk {j} grouped")
    nb = CacheBlendEngine(
        engine.model, engine.tokenizer, config=EngineConfig(miss_policy="blend", chunk_context="isolated")
    )
    contexts = [neighbour_context(n) for n in neighbour_texts(chunks, 2, pool=pool)]
    nb.precompute(chunks, case.question, template=spec.template, context=contexts)
    row("2 neighbours of the pool, near copies apart", nb)


@contextlib.contextmanager
def near_copies_allowed() -> Iterator[None]:
    """Groups and neighbours as they were built before the rule: only equal texts count as copies."""
    share, overlap.NEAR_COPY_SHARE = overlap.NEAR_COPY_SHARE, 2.0
    try:
        yield
    finally:
        overlap.NEAR_COPY_SHARE = share


def group_of(pool, vectors, lengths, *, allowed: bool) -> dict[str, tuple[str, ...]]:
    """Each passage of the pool -> its group (3,072 tokens), near copies allowed in a group or left apart."""
    with near_copies_allowed() if allowed else contextlib.nullcontext():
        return {pool[i]: tuple(pool[j] for j in g) for g in similarity_groups(vectors, pool, lengths, 3072) for i in g}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("stats", "case"))
    p.add_argument("dataset", nargs="?")
    p.add_argument("case_id", nargs="?")
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--ablate", choices=("allowed", "apart", "none"), default="allowed",
                   help="case: the layout to take apart chunk by chunk (none: no ablation, no neighbours)")  # fmt: skip
    args = p.parse_args()
    if args.what == "stats":
        stats(args.data_dir)
    else:
        case_study(args.dataset, args.case_id, args.data_dir, args.ablate)


if __name__ == "__main__":
    main()
