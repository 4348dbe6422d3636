# A study, kept for reading. It runs at the git tag lab-2026-11-25, where it is
# benchmarks/chunk_context.py: see research/README.md.
"""Would better cached KV close the gap that no choice of tokens closes? Chunks precomputed after other text.

The library prefills every chunk on its own, right after the prompt's prefix, so a chunk's cached KV never saw
the chunks that precede it in a request. `selection_headroom.py` shows that on MultiNews no single choice of 5% of
the tokens, oracles included, makes up for that. This script changes the cached KV instead: before measuring,
each chunk of a case is prefilled again after some context (placed between the prefix and the chunk, keeping
only the chunk's KV) and stored under the key the request looks up. Contexts:
- `alone`: none, as the library stores chunks without a lead-in (the baseline of every row);
- `predecessor`: the chunk just before it in this prompt (the first chunk keeps none): what a store could hold
  if chunks came back in a stable order, e.g. neighbouring pieces of one document;
- `all-before`: every chunk before it in this prompt. The cached KV is then full prefill's, so full KV reuse
  must match full recompute (a check of the set-up, and the bound of the lever);
- `unrelated`: the first 256 tokens of another case's chunks (case i + 25 of the set): some text before the
  chunk, but not the text the request puts there;
- `lead-in`: as `unrelated`, but the first chunk keeps none: what `EngineConfig(lead_in=...)` does, with a
  passage of the same data set as the lead-in. It needs no knowledge of the request, only two entries per chunk
  (one for the first place, whose KV alone is exact, and one for the others).
Every context is measured with full KV reuse and the `paper` and `attention` rules at r = 0.05, teacher-forced
along full recompute's answer (as `cacheblend-rag bench fidelity` does); `paper` at r = 0.15 on `alone` KV is the
row the fidelity benchmark's r = 0.05 target compares with.

    python benchmarks/chunk_context.py --datasets multi_news,musique --cases 0-4 \\
        --out benchmarks/results/chunk_context

Appends one JSON line per (case, context, method) to OUT/chunk_context.jsonl (a run resumes where it stopped)
and prints, per data set, mean KL and top-1 agreement with 95% intervals over the cases every row finished,
with each row's paired KL difference to the same method on `alone` chunk KV.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from cacheblend_rag import blend_rule
from cacheblend_rag.evaluation.case_scripts import case_script_parser, paired_kl_table, run_case_script
from cacheblend_rag.evaluation.fidelity import measure_blend, prepare_case
from cacheblend_rag.evaluation.records import append_record
from cacheblend_rag.store import ChunkKV

RESULTS_FILE = "chunk_context.jsonl"
CONTEXTS = ("alone", "predecessor", "all-before", "unrelated", "lead-in")
UNRELATED_TOKENS = 256
UNRELATED_OFFSET = 25  # case i borrows its unrelated context from case i + 25 (mod the set's size)
METHODS = ("reuse", "paper@0.05", "attention@0.05")  # on every context
BASELINE = "paper@0.15"  # on `alone` only: the fidelity target for r = 0.05


def row_names() -> list[str]:
    """Every row of a case, in the order of the report."""
    return [row_name("alone", BASELINE)] + [row_name(c, m) for c in CONTEXTS for m in METHODS]


def contexts(kind: str, chunk_ids: Sequence[Sequence[int]], unrelated: Sequence[int]) -> list[tuple[int, ...]]:
    """The tokens placed before each chunk (after the prefix) when its KV is prefilled, for one context kind."""
    if kind == "alone":
        return [()] * len(chunk_ids)
    if kind == "predecessor":
        return [()] + [tuple(c) for c in chunk_ids[:-1]]
    if kind == "all-before":
        return [tuple(t for c in chunk_ids[:j] for t in c) for j in range(len(chunk_ids))]
    if kind == "unrelated":
        return [tuple(unrelated)] * len(chunk_ids)
    if kind == "lead-in":
        return [()] + [tuple(unrelated)] * (len(chunk_ids) - 1)
    raise ValueError(f"unknown context {kind!r}; choose from {CONTEXTS}")


def store_with_context(engine, prompt, before: Sequence[Sequence[int]]) -> None:
    """Prefill each chunk of `prompt` after its prefix and `before[j]`, and store only the chunk's KV under the
    key a request for `prompt` reads it from (`engine.prompt_keys`), replacing what was there."""
    prefix = tuple(prompt.prefix_ids)
    keys = engine.prompt_keys(prompt, with_prefix=False)  # the entries this engine reads (lead-in or not)
    for ids, ctx, key in zip(prompt.chunk_ids, before, keys, strict=True):
        context = prefix + tuple(ctx)
        kv = engine.chunks.prefill(engine.chunks.prefix_kv(context), context, ids)
        engine.store.put(ChunkKV(key, kv.keys, kv.values))


def row_name(context: str, method: str) -> str:
    return f"{context}/{method}"


def run_case(engine, name: str, ds, index: int, done: set[str], out) -> list[dict]:
    """Measure one case's rows not in `done`; -> the new records (already appended to the file)."""
    rows = [name.partition("/")[::2] for name in row_names() if name not in done]
    if not rows:
        return []
    case = ds.cases[index]
    prompt, ref = prepare_case(engine, ds.spec, case)
    other = ds.cases[(index + UNRELATED_OFFSET) % len(ds.cases)]
    other_ids = engine.build_prompt(list(other.chunks), other.question, template=ds.spec.template).chunk_ids
    unrelated = [t for c in other_ids for t in c][:UNRELATED_TOKENS]
    base = {"dataset": name, "case_id": case.id, "answer_tokens": len(ref.token_ids), "chunks": len(prompt.chunk_ids)}
    new = []
    for context in CONTEXTS:
        todo = [m for c, m in rows if c == context]
        if not todo:
            continue
        store_with_context(engine, prompt, contexts(context, prompt.chunk_ids, unrelated))
        for method in todo:
            blend = None if method == "reuse" else blend_rule(*_rule(method))
            rec = {**base, "method": row_name(context, method), **measure_blend(engine, prompt, ref, blend)}
            append_record(out / RESULTS_FILE, rec)
            new.append(rec)
    store_with_context(engine, prompt, contexts("alone", prompt.chunk_ids, unrelated))  # leave the store as found
    return new


def _rule(method: str) -> tuple[str, float]:
    rule, _, r = method.partition("@")
    return rule, float(r)


def table(records: list[dict]) -> str:
    """Per data set, over the cases every row finished: mean KL and top-1 [95% CI], compute share, and the
    paired KL difference to the same method on `alone` chunk KV."""
    order = row_names()
    return paired_kl_table(
        records,
        lambda names: [n for n in order if n in names],
        lambda name: None if name.startswith("alone/") else row_name("alone", name.partition("/")[2]),
        first_column="context / method",
        diff_column="KL - alone",
    )


def main(argv: list[str] | None = None) -> int:
    p = case_script_parser(__doc__, cases="0-4", datasets="multi_news,musique", out="bench-results/chunk_context")
    args = p.parse_args(argv)
    return run_case_script(args, RESULTS_FILE, run_case, table)


if __name__ == "__main__":
    sys.exit(main())
