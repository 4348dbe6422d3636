"""Do a blend's risk signals tell which requests drift from full recompute, and what would a guard buy?

Reads fidelity records (`benchmarks/fidelity.py`, whose blend records carry the "attention" rule's risk signals,
`cacheblend_rag.engine.guard.first_token_signals`) with `reuse`, the base blend (e.g. `attention@0.15`) and a
larger one (e.g. `attention@0.50`) on the same cases. It prints, per data set and pooled:
- each signal's Spearman correlation with KL(full || blend), its ROC AUC for "blend's first token differs from
  full's" and for "blend is further from full than reuse" (higher signal = more risk);
- the guard replayed offline: a case whose signal crosses a threshold takes the larger blend's record, the others
  the base blend's; first-token and top-1 agreement with full, mean KL and mean compute share (95% intervals),
  next to fixed r.

    python benchmarks/fidelity.py --rules attention --ratios 0.15,0.5 --limit 20 --out benchmarks/results/guard
    python benchmarks/guard_signals.py --records benchmarks/results/guard/fidelity.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr
from sklearn.metrics import roc_auc_score

from cacheblend_rag.evaluation import bootstrap_ci

# signal name -> how to read it as "higher = riskier"
SIGNALS = {
    "kl_reuse": lambda r: r["kl_reuse"],
    "disagree_reuse": lambda r: 0.0 if r["agree_reuse"] else 1.0,
    "low_margin": lambda r: -r["margin"],
    "stale_attention": lambda r: r["stale_attention"],
}


def load_cases(path: Path, base: str, high: str) -> dict[str, list[dict]]:
    """dataset -> cases that have reuse, `base` (with risk signals) and `high` records."""
    by_case: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            by_case[(r["dataset"], r["case_id"])][r["method"]] = r
    out: dict[str, list[dict]] = defaultdict(list)
    for (dataset, _), methods in sorted(by_case.items()):
        if {"reuse", base, high} <= set(methods) and methods[base].get("risk"):
            out[dataset].append({"reuse": methods["reuse"], "base": methods[base], "high": methods[high]})
    return out


def auc(labels: list[bool], scores: list[float]) -> float:
    return float(roc_auc_score(labels, scores)) if 0 < sum(labels) < len(labels) else float("nan")


def signal_rows(cases: list[dict]) -> list[str]:
    kl = [c["base"]["kl_mean"] for c in cases]
    flipped = [c["base"]["first_token"] < 1 for c in cases]
    worse = [c["base"]["kl_mean"] > c["reuse"]["kl_mean"] for c in cases]
    rows = []
    for name, read in SIGNALS.items():
        s = [read(c["base"]["risk"]) for c in cases]
        rho = spearmanr(s, kl).statistic if len(set(s)) > 1 else float("nan")
        rows.append(f"| {name} | {rho:+.2f} | {auc(flipped, s):.2f} | {auc(worse, s):.2f} |")
    return rows


def ci(values: list[float]) -> str:
    lo, hi = bootstrap_ci(values)
    return f"{np.mean(values):.3f} [{lo:.3f}, {hi:.3f}]"


def guard_rows(cases: list[dict], base: str, high: str) -> list[str]:
    def row(name: str, picks: list[dict]) -> str:
        first = [p["first_token"] for p in picks]
        top1 = [p["top1"] for p in picks]
        kl = [p["kl_mean"] for p in picks]
        share = np.mean([p["compute_share"] for p in picks])
        return f"| {name} | {ci(first)} | {ci(top1)} | {ci(kl)} | {share:.2f} |"

    rows = [row(f"fixed {base}", [c["base"] for c in cases]), row(f"fixed {high}", [c["high"] for c in cases])]
    kls = sorted(c["base"]["risk"]["kl_reuse"] for c in cases)
    for q in (0.5, 0.75, 0.9):
        t = float(np.quantile(kls, q))
        picks = []
        for c in cases:
            risky = c["base"]["risk"]["kl_reuse"] > t or not c["base"]["risk"]["agree_reuse"]
            # an escalated request pays for the base blend and then the larger one
            pick = dict(c["high"], compute_share=c["base"]["compute_share"] + c["high"]["compute_share"])
            picks.append(pick if risky else c["base"])
        rows.append(row(f"guard kl_reuse > {t:.3f} or disagree", picks))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=Path, default=Path(__file__).parent / "results" / "guard" / "fidelity.jsonl")
    p.add_argument("--base", default="attention@0.15", help="the blend the guard starts from (default: %(default)s)")
    p.add_argument("--high", default="attention@0.50", help="the blend it escalates to (default: %(default)s)")
    args = p.parse_args()
    by_set = load_cases(args.records, args.base, args.high)
    if not by_set:
        raise SystemExit(f"no case in {args.records} has reuse, {args.base} (with risk signals) and {args.high}")
    groups = {**by_set, "pooled": [c for cases in by_set.values() for c in cases]}
    for name, cases in groups.items():
        print(f"\n### {name} ({len(cases)} cases)\n")
        print("| signal (higher = riskier) | Spearman with KL | AUC first token differs | AUC further than reuse |")
        print("|---|---|---|---|")
        print("\n".join(signal_rows(cases)))
        print("\n| method | first-token agreement | top-1 agreement | mean KL (nats) | mean compute share |")
        print("|---|---|---|---|---|")
        print("\n".join(guard_rows(cases, args.base, args.high)))


if __name__ == "__main__":
    main()
