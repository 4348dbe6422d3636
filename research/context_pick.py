"""Which passages should a chunk's KV be prefilled after? Nearest, random, or mid-ranked passages of the corpus.

Contextual chunk KV after a chunk's 2 nearest passages broke MuSiQue on the default model (the research log, "Neighbour
context on the default model"), while KV captured among a request's other passages helped on every set. This
screens, per case, chunk KV prefilled after 2 passages picked from the data set's whole pool (every case's
passages, the chunk's own text left out) by several rules, against the same chunk prefilled alone:

- `nearest`: the 2 most similar passages (all-MiniLM-L6-v2 cosine), nearest last (`context_neighbours=2`);
- `ranked-R`: the passages at similarity ranks R and R+1 (related, but not near copies);
- `random`: 2 passages of the pool at random (seeded by the chunk); `random-K`: K of them;
- `case-random`: 2 other passages of the same case at random (what a request's own neighbours look like);
- any of them with `+first`: the prompt's first chunk keeps its isolated entry (its real context is the prefix
  alone), as the engine reads captured KV.

For each, full KV reuse and the default blend (`attention`@0.15) are teacher-forced along full recompute's
answer; it prints mean KL(full || method) and whether the first token is full recompute's, and writes one JSON
line per case and variant. Runs on `main` (the public API). Its records were taken before the engine read a
prompt's first chunk from its isolated entry whatever context built its own (research/README.md, study 17); since then
every variant reads it so, and `+first` measures the same as its base variant.

    python research/context_pick.py --datasets musique,multi_news,wikimqa,samsum --cases 0,1 \
        --variants isolated,nearest,ranked-20,random,case-random --out research/results/context_pick.jsonl
    python research/context_pick.py --report research/results/context_pick.jsonl      # the table, no model
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from benchlib.fidelity_context import PoolNeighbours  # noqa: E402

from cacheblend_rag import CacheBlendEngine, EngineConfig  # noqa: E402
from cacheblend_rag.evaluation import load_dataset  # noqa: E402
from cacheblend_rag.evaluation.fidelity import prepare_case, teacher_forced_logits, token_kl  # noqa: E402
from cacheblend_rag.retrieval.neighbours import nearest_neighbours, neighbour_context  # noqa: E402

PAIR = 2  # passages of context per chunk


class Pool(PoolNeighbours):
    """A data set's passage pool with its embeddings (the fidelity benchmark's), and the rules that pick a chunk's
    context from it besides the nearest passages."""

    def ranked(self, chunks: list[str], start: int) -> list[list[str]]:
        """Per chunk, the pool passages at similarity ranks start .. start + PAIR - 1, the more similar last."""
        found = nearest_neighbours(self.vectors[[self.row[c] for c in chunks]], self.vectors, start + PAIR,
                                   query_texts=chunks, pool_texts=self.pool)  # fmt: skip
        return [neighbour_context([self.pool[j] for j in ids[start:]]) for ids in found]

    def random(self, chunks: list[str], k: int = PAIR) -> list[list[str]]:
        out = []
        for c in chunks:
            rng = random.Random(f"pool:{c}")
            out.append(rng.sample([t for t in self.pool if t != c], k))
        return out


def contexts_for(variant: str, pool: Pool, chunks: list[str]) -> list[list[str]] | None:
    if variant.endswith("+first"):  # the prompt's first chunk keeps its isolated entry, as captured KV does
        rest = contexts_for(variant.removesuffix("+first"), pool, chunks)
        return None if rest is None else [[], *rest[1:]]
    if variant == "isolated":
        return None
    if variant == "nearest":
        return pool.ranked(chunks, 0)
    if variant.startswith("ranked-"):
        return pool.ranked(chunks, int(variant.split("-", 1)[1]))
    if variant == "random":
        return pool.random(chunks)
    if variant.startswith("random-"):
        return pool.random(chunks, int(variant.split("-", 1)[1]))
    if variant == "case-random":
        return [random.Random(f"case:{c}").sample([o for o in chunks if o != c], min(PAIR, len(chunks) - 1))
                for c in chunks]  # fmt: skip
    raise SystemExit(f"unknown variant {variant!r}: isolated, nearest, ranked-R, random[-K] or case-random[+first]")


def report(path: Path) -> str:
    """A markdown table of a run's lines: per case, each variant's KL and first token (the last line of a
    case and variant wins)."""
    rows: dict[tuple[str, str], dict[str, dict]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        rows.setdefault((r["dataset"], r["case"]), {})[r["variant"]] = r
    out = ["| case | chunk KV after | reuse KL | reuse first token | attention@0.15 KL | attention@0.15 first token |",
           "|---|---|---:|:---:|---:|:---:|"]  # fmt: skip
    for (dataset, case), by_variant in rows.items():
        name = f"{dataset} {case[:20]}"
        for variant, r in by_variant.items():
            reuse, blend = r["reuse"], r["attention@0.15"]
            out.append(f"| {name} | {variant} | {reuse['kl']:.3f} | {'yes' if reuse['first'] else 'no'} | "
                       f"{blend['kl']:.3f} | {'yes' if blend['first'] else 'no'} |")  # fmt: skip
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--datasets", default="musique,multi_news,wikimqa,samsum")
    p.add_argument("--cases", default="0", help="comma-separated case numbers of each data set")
    p.add_argument("--variants", default="isolated,nearest,ranked-20,random,case-random")
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--out", type=Path, help="append one JSON line per case and variant here")
    p.add_argument("--report", type=Path, metavar="JSONL", help="print the table of a run's lines and stop")
    args = p.parse_args()
    if args.report:
        print(report(args.report))
        return
    cases = [int(c) for c in args.cases.split(",")]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig(), show_progress=False)
    for name in args.datasets.split(","):
        full = load_dataset(name, args.data_dir, None)
        pool = Pool(full, PAIR)
        for n in cases:
            spec, case = full.spec, full.cases[n]
            engine.clear_store()
            prompt, ref = prepare_case(engine, spec, case)
            print(f"{spec.name} {case.id}: {prompt.num_tokens} tokens, reference {ref.text[:60]!r}", flush=True)
            chunks = list(case.chunks)
            for i, variant in enumerate(variants):
                if i > 0 or variant != "isolated":  # else prepare_case's isolated entries are the ones to measure
                    engine.clear_store()
                    engine.precompute(chunks, case.question, template=spec.template,
                                      context=contexts_for(variant, pool, chunks))  # fmt: skip
                row = {"dataset": spec.name, "case": case.id, "variant": variant}
                for method, ratio in (("reuse", None), ("attention@0.15", 0.15)):
                    pre = engine.prefill(prompt, "reuse" if ratio is None else "blend", recompute_ratio=ratio)
                    logits = teacher_forced_logits(engine, pre, ref)
                    kl = float(token_kl(ref, logits).mean())
                    first = int(logits[0].argmax()) == int(ref.token_ids[0])
                    row[method] = {"kl": kl, "first": first}
                print(f"  {variant:<12} reuse KL {row['reuse']['kl']:.4f} first {row['reuse']['first']!s:<5}  "
                      f"attention@0.15 KL {row['attention@0.15']['kl']:.4f} first {row['attention@0.15']['first']}",
                      flush=True)  # fmt: skip
                if args.out:
                    with args.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
