"""Do a blend's risk signals tell which requests drift from full recompute, and what does the guard buy?

Reads the fidelity benchmark's records of full recompute, full KV reuse and the "attention" rule at 0.05, 0.15 and
0.5 on the same cases (`benchlib.guard_study`), and writes OUT/summary.md and one Pareto figure per data set:
- the signal table, per data set and pooled: each signal's Spearman correlation with KL(full || blend@0.15), its
  ROC AUC for "blend's first token differs from full's" and for "blend is further from full than reuse";
- every setting on the same cases: full reuse, fixed r, and the guard at each threshold (`Guard(max_kl)`, ladder
  0.5 then 1.0), replayed from the records exactly as the engine decides (`FidelityProfile.outcome`), with 95%
  intervals, the cases left further from full than reuse, and TTFT mean and p90 next to full's;
- the held-back check: the cheapest setting meeting a first-token target, chosen on the first two thirds of one
  data set's cases, measured on the rest.

    python benchmarks/fidelity.py --rules attention --ratios 0.05,0.15,0.5 --kv-codec int8 --limit 50 \
        --out benchmarks/results/guard --data-dir ../shared/data
    python benchmarks/guard_signals.py --records benchmarks/results/guard/fidelity.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchlib.guard_study import load_cases, markdown_rows, plot_pareto, profile, rows, signal_table

RESULTS = Path(__file__).parent / "results" / "guard"


def signal_markdown(cases: list[dict]) -> list[str]:
    out = ["| signal (higher = riskier) | Spearman with KL | AUC first token differs | AUC further than reuse |",
           "|---|---|---|---|"]  # fmt: skip
    for name, rho, auc_flip, auc_worse in signal_table(cases):
        out.append(f"| {name} | {rho:+.2f} | {auc_flip:.2f} | {auc_worse:.2f} |")
    flips = sum(c["attention@0.15"]["first_token"] < 1 for c in cases)
    worse = sum(c["attention@0.15"]["kl_mean"] > c["reuse"]["kl_mean"] for c in cases)
    out.append(f"\nBlend@0.15: {flips} of {len(cases)} cases change full's first token; {worse} are further from "
               "full than reuse.")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=Path, default=RESULTS / "fidelity.jsonl")
    p.add_argument("--out", type=Path, help="folder for summary.md and figures (default: the records' folder)")
    p.add_argument("--held-back", default="multi_news", help="data set of the held-back check (default: %(default)s)")
    p.add_argument("--target-first-token", type=float, default=0.95)
    args = p.parse_args(argv)
    if not args.records.is_file():
        print(f"error: no records at {args.records}; run benchmarks/fidelity.py first (see --help)", file=sys.stderr)
        return 2
    records = [json.loads(line) for line in args.records.read_text().splitlines() if line.strip()]
    by_set = load_cases(records)
    if not by_set:
        print(f"error: no case in {args.records} has full, reuse and attention@0.05/0.15/0.50", file=sys.stderr)
        return 2
    out = args.out or args.records.parent
    out.mkdir(parents=True, exist_ok=True)
    groups = {**by_set, "pooled": [c for cases in by_set.values() for c in cases]}
    lines = [f"# The fidelity guard on {args.records}\n"]
    for name, cases in groups.items():
        table = rows(profile(cases)) + rows(profile(cases, ladder=(1.0,)), fixed=False)
        lines += [f"\n## {name} ({len(cases)} cases)\n", *signal_markdown(cases), "", *markdown_rows(table)]
        if name != "pooled":
            figure = plot_pareto(table, name, out / f"guard_{name}.png")
            lines.append(f"\n![{name}]({figure.name})")
    if args.held_back in by_set and len(by_set[args.held_back]) >= 3:
        check = profile(by_set[args.held_back]).held_back_check(target_first_token=args.target_first_token)
        c, h = check.choice.estimate, check.held_back
        lines += [f"\n## Held-back check on {args.held_back}\n",
                  f"Chosen on {c.n} cases for first-token agreement >= {args.target_first_token}: "
                  f"{c.setting.name} (met: {check.choice.met}; first token {c.first_token:.2f}, compute "
                  f"{c.compute_share:.3f}). On the {h.n} held-back cases: first token {h.first_token:.2f} "
                  f"[{h.first_token_ci[0]:.2f}, {h.first_token_ci[1]:.2f}], top-1 {h.top1:.3f}, mean KL "
                  f"{h.kl_mean:.3f}, compute {h.compute_share:.3f}."]  # fmt: skip
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
