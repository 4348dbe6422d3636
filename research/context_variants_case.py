"""Which context makes one case's chunk KV better or worse? Full KV reuse of one data-set case under several contexts.

Runs on `main` (the public API): each chunk of the case is prefilled after a context and stored
(`engine.precompute(..., context=...)`), then full KV reuse is teacher-forced along full recompute's answer.
Contexts: none (isolated), every chunk before it in the prompt (the exact context: reuse must equal full), its
predecessor, and its nearest neighbours among the case's own chunks (all-MiniLM-L6-v2), nearest first, nearest
last, one neighbour, 2 neighbours with the first chunk isolated, 2 other chunks at random, and 2 neighbours with
no two chunks in each other's context (`--only` picks some). Prints per-token KL(full || reuse) and reuse's first
token. `--leave-one-out` then puts each chunk in turn back on its isolated entry, the others after their
neighbours. Since the engine reads a prompt's first chunk from its isolated entry whatever context built its own
(research/README.md, study 17), "2 neighbours, first isolated" measures the same as "2 neighbours, nearest last".

    python research/context_variants_case.py --model qwen2.5-coder-0.5b-instruct --dataset musique --case 0
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from benchlib.fidelity_context import text_rank  # noqa: E402

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.evaluation import load_dataset
from cacheblend_rag.evaluation.fidelity import prepare_case, teacher_forced_logits, token_kl
from cacheblend_rag.retrieval.neighbours import neighbour_texts


def others(chunks: list[str], j: int) -> list[str]:
    return [c for i, c in enumerate(chunks) if i != j]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dataset", default="musique")
    p.add_argument("--case", type=int, default=0)
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--only", help="semicolon-separated context names to run (default: all)")
    p.add_argument("--leave-one-out", action="store_true", help="then, with every chunk after its 2 neighbours "
                   "(nearest last), put each chunk in turn back on its isolated entry: which chunk's context does "
                   "the harm?")  # fmt: skip
    args = p.parse_args()
    ds = load_dataset(args.dataset, args.data_dir, args.case + 1)
    spec, case = ds.spec, ds.cases[args.case]
    engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig(), show_progress=False)
    prompt, ref = prepare_case(engine, spec, case)
    print(f"{spec.name} {case.id}: {prompt.num_tokens} tokens, reference {ref.text!r}")
    chunks = list(case.chunks)
    nearest = neighbour_texts(chunks, 2)
    ranked = neighbour_texts(chunks, len(chunks) - 1)  # every other chunk, nearest first
    rank = {c: text_rank(c) for c in chunks}  # the fidelity benchmark's fixed order of the corpus
    contexts = {
        "isolated": None,
        "all-before (exact)": [chunks[:j] for j in range(len(chunks))],
        "predecessor": [[]] + [[c] for c in chunks[:-1]],
        "2 neighbours, nearest first": [list(n) for n in nearest],
        "2 neighbours, nearest last": [list(reversed(n)) for n in nearest],
        "1 neighbour": [[n[0]] for n in nearest],
        "2 neighbours, first isolated": [[]] + [list(reversed(n)) for n in nearest[1:]],
        "2 others at random, first isolated": [[]]
        + [random.Random(j).sample(others(chunks, j), 2) for j in range(1, len(chunks))],
        # no two chunks in each other's context: only neighbours earlier in a fixed order of the corpus
        "2 neighbours, acyclic": [
            list(reversed([n for n in r if rank[n] < rank[c]][:2])) for c, r in zip(chunks, ranked, strict=True)
        ],
    }
    only = set(args.only.split(";")) if args.only else None
    for name, context in contexts.items():
        if only is not None and name not in only:
            continue
        engine.precompute(chunks, case.question, template=spec.template, context=context)
        pre = engine.prefill(prompt, "reuse")
        logits = teacher_forced_logits(engine, pre, ref)
        kl = token_kl(ref, logits)
        first = engine.tokenizer.decode([int(logits[0].argmax())])
        print(f"  {name:<28} KL {float(kl.mean()):.4f}  per token {[round(float(x), 3) for x in kl]}  first {first!r}")
    if args.leave_one_out:
        leave_one_out(engine, spec, case, prompt, ref, [list(reversed(n)) for n in nearest])


def leave_one_out(engine, spec, case, prompt, ref, context: list[list[str]]) -> None:
    """Full reuse with every chunk after its context but chunk j, read from its isolated entry, for each j.
    `precompute` stores both entries, so each variant only records other contexts (`set_chunk_context`)."""
    chunks = list(case.chunks)
    engine.precompute(chunks, case.question, template=spec.template, context=context)
    for j in range(len(chunks)):
        ctx = [[] if i == j else c for i, c in enumerate(context)]
        engine.set_chunk_context(chunks, ctx, question=case.question, template=spec.template)
        pre = engine.prefill(prompt, "reuse")
        assert pre.metrics.chunks_missed == 0, "both entries of every chunk are stored"
        logits = teacher_forced_logits(engine, pre, ref)
        first = engine.tokenizer.decode([int(logits[0].argmax())])
        heads = " | ".join(t[:40].replace("\n", " ") for t in context[j])
        print(
            f"  chunk {j} isolated: KL {float(token_kl(ref, logits).mean()):.4f} first {first!r}  "
            f"chunk {chunks[j][:50]!r}  after {heads!r}"
        )


if __name__ == "__main__":
    main()
