# A study, kept for reading. It runs at the git tag lab-2026-11-25, where it is
# benchmarks/answer_drift.py: see research/README.md.
"""Where along the answer does each rule lose fidelity? Teacher-forced KL(full || method) per quarter of full
recompute's answer, on the long-answer data sets (summaries).

The attention rule ranks chunk tokens by the attention the *question* pays to them. On a short answer that is
the attention the answer pays too; a summary walks through every document, so the question's attention may
only predict its opening. If so, the attention rule's KL grows along the answer faster than the deviation
rules', which rank tokens by how wrong their cached KV is whoever reads it.

    python benchmarks/answer_drift.py --cases 0-7 --out benchmarks/results/answer_drift

Appends one JSON line per (case, method) to OUT/answer_drift.jsonl (rerun to resume) and prints, per data set,
the mean KL in each quarter of the answer with bootstrap 95% intervals, and the paired ratio of each rule's
late-answer KL (last half) to its early-answer KL (first quarter).
"""

from __future__ import annotations

import statistics
import sys

from cacheblend_rag import BlendConfig, CacheBlendEngine, EngineConfig, blend_rule
from cacheblend_rag.evaluation.case_scripts import case_script_parser, no_records, open_records, parse_cases
from cacheblend_rag.evaluation.datasets import load_dataset
from cacheblend_rag.evaluation.fidelity import prepare_case, teacher_forced_logits, token_kl
from cacheblend_rag.evaluation.records import append_record
from cacheblend_rag.evaluation.report import bootstrap_ci

RESULTS_FILE = "answer_drift.jsonl"
QUARTERS = 4


def methods(rules: list[str], ratio: float) -> dict[str, BlendConfig | None]:
    out: dict[str, BlendConfig | None] = {"reuse": None}
    out.update({f"{rule}@{ratio}": blend_rule(rule, ratio) for rule in rules})
    return out


def quarters(kl: list[float]) -> list[float]:
    """Mean KL over each quarter of the answer's positions (an answer shorter than 4 tokens gives nan rows)."""
    n = len(kl)
    bounds = [round(i * n / QUARTERS) for i in range(QUARTERS + 1)]
    return [statistics.fmean(kl[a:b]) if b > a else float("nan") for a, b in zip(bounds, bounds[1:], strict=False)]


def table(records: list[dict]) -> str:
    lines = []
    for ds in sorted({r["dataset"] for r in records}):
        mine = [r for r in records if r["dataset"] == ds and len(r["kl"]) >= QUARTERS]
        by_method: dict[str, set[str]] = {}
        for r in mine:
            by_method.setdefault(r["method"], set()).add(r["case"])
        cases = set.intersection(*by_method.values())
        lines += [f"{ds}: {len(cases)} cases, mean answer length "
                  f"{statistics.fmean(len(r['kl']) for r in mine if r['case'] in cases):.0f} tokens",
                  "method".ljust(26) + "".join(f"Q{q + 1} KL [95% CI]".rjust(26) for q in range(QUARTERS))
                  + "   last half / Q1 [95% CI]"]  # fmt: skip
        for method in dict.fromkeys(r["method"] for r in mine):
            rs = sorted((r for r in mine if r["method"] == method and r["case"] in cases), key=lambda r: r["case"])
            per_case = [quarters(r["kl"]) for r in rs]
            cells = []
            for q in range(QUARTERS):
                vals = [qs[q] for qs in per_case]
                lo, hi = bootstrap_ci(vals)
                cells.append(f"{statistics.fmean(vals):.4f} [{lo:.4f}, {hi:.4f}]".rjust(26))
            late = [statistics.fmean(qs[2:]) / max(qs[0], 1e-6) for qs in per_case]
            lo, hi = bootstrap_ci(late)
            lines.append(method.ljust(26) + "".join(cells) + f"   {statistics.fmean(late):.2f} [{lo:.2f}, {hi:.2f}]")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = case_script_parser(__doc__, cases="0-7", datasets="multi_news,samsum", out="bench-results/answer_drift")
    p.add_argument("--rules", default="attention,paper,gradual,attention-deviation", help="comma-separated")
    p.add_argument("--ratio", type=float, default=0.15)
    args = p.parse_args(argv)
    out, records = open_records(args.out, RESULTS_FILE)
    if not args.report_only:
        done = {(r["dataset"], r["case"], r["method"]) for r in records}
        indices = parse_cases(args.cases)
        plan = methods(args.rules.split(","), args.ratio)
        engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig())
        for name in args.datasets.split(","):
            ds = load_dataset(name, args.data_dir, limit=max(indices) + 1)
            for i in indices:
                case = ds.cases[i]
                todo = {m: b for m, b in plan.items() if (name, case.id, m) not in done}
                if not todo:
                    continue
                prompt, ref = prepare_case(engine, ds.spec, case)
                for method, blend in todo.items():
                    pre = engine.prefill(prompt, "reuse" if blend is None else "blend", blend=blend)
                    kl = token_kl(ref, teacher_forced_logits(engine, pre, ref)).tolist()
                    rec = {"dataset": name, "case": case.id, "method": method, "kl": kl}
                    append_record(out / RESULTS_FILE, rec)
                    records.append(rec)
                print(name, case.id, file=sys.stderr, flush=True)
    if no_records(records, out / RESULTS_FILE):
        return 2
    text = table(records)
    (out / "summary.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
