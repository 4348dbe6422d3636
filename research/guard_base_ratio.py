"""The margin guard from a cheaper base blend: a grouped fidelity run's blends at r = 0.05 and r = 0.15, each
escalated to full recompute where its own first-token margin is under a threshold, replayed from the records
(the engine's `Guard(min_margin=m)` on a request blended at that ratio). First token kept, pooled with a 95%
bootstrap interval and per set, and the mean compute share (the base blend's, plus full recompute's where it
escalates). Loads no model.

    python research/guard_base_ratio.py benchmarks/results/fidelity-grouped-apart --variant grp

`benchmarks/guard_signals.py` replays the same guard from r = 0.15 only, with every trigger and the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from cacheblend_rag.evaluation.fidelity import bootstrap_ci

MARGINS = (0.0, 0.02, 0.05, 0.1, 0.2)
BASES = (0.05, 0.15)


def cases_of(folder: Path, variant: str) -> dict[str, dict[str, dict]]:
    """{case: {method without the variant's suffix: record}} of a fidelity run."""
    suffix = "" if variant == "native" else f"+{variant}"
    out: dict[str, dict[str, dict]] = defaultdict(dict)
    for line in (folder / "fidelity.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["method"] == "full" or r["method"].endswith(suffix) and suffix:
            out[r["case_id"]][r["method"].removesuffix(suffix)] = r
        elif not suffix and "+" not in r["method"]:
            out[r["case_id"]][r["method"]] = r
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="a benchmarks/fidelity.py output folder")
    p.add_argument("--variant", default="grp", help="the records' chunk KV suffix ('native': isolated entries)")
    args = p.parse_args()
    runs = cases_of(args.folder, args.variant)
    methods = [f"attention@{b:.2f}" for b in BASES]
    cases = [c for c, m in runs.items() if "full" in m and all(x in m and m[x].get("risk") for x in methods)]
    sets = sorted({runs[c]["full"]["dataset"] for c in cases})
    print(f"{len(cases)} cases; first token kept, pooled [95% CI] and per set ({' / '.join(sets)}), compute share\n")
    print("| base | escalate where margin < | first token, pooled | per set | compute share | escalated |")
    print("|---:|---:|---|---|---:|---:|")
    for base, method in zip(BASES, methods, strict=True):
        for m in MARGINS:
            kept, per, compute, escalated = [], defaultdict(list), [], 0
            for c in cases:
                r, full = runs[c][method], runs[c]["full"]
                esc = r["risk"]["margin"] < m
                ok = 1.0 if esc else float(r["first_token"])
                kept.append(ok)
                per[full["dataset"]].append(ok)
                compute.append(r["compute_share"] + (full["compute_share"] if esc else 0.0))
                escalated += esc
            lo, hi = bootstrap_ci(kept)
            cells = " / ".join(f"{statistics.fmean(per[s]):.2f}" for s in sets)
            print(f"| {base} | {m} | {statistics.fmean(kept):.2f} [{lo:.2f}, {hi:.2f}] | {cells} | "
                  f"{statistics.fmean(compute):.3f} | {escalated / len(cases):.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
