"""Methods of one fidelity run paired case by case against a baseline method of the same run: the paired difference
of mean KL, top-1 and first-token agreement with 95% bootstrap intervals over cases, per data set and pooled, with
each method's compute share and median TTFT beside them. Loads no model.

    python research/methods_paired.py benchmarks/results/fidelity-probe-depth --baseline attention@0.15

Every method the run recorded is compared (or those of `--methods`); a case counts for a method only where the run
measured it and the baseline against the same full-recompute answer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from benchlib.records import load_records  # noqa: E402

from cacheblend_rag.evaluation.fidelity import bootstrap_ci  # noqa: E402

POOLED = "all"


def by_case(folder: Path) -> dict[str, dict[str, dict]]:
    """{case: {method: record}} of a fidelity run's folder."""
    out: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in load_records(folder, filename="fidelity.jsonl"):
        out[r["case_id"]][r["method"]] = r
    return out


def interval(diffs: list[float], digits: int) -> str:
    lo, hi = bootstrap_ci(diffs)
    return f"{statistics.fmean(diffs):+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def paired_rows(cases: dict[str, dict[str, dict]], baseline: str, methods: list[str]) -> list[str]:
    """Markdown rows: one per (data set or pooled, method)."""
    rows = []
    for method in methods:
        groups: dict[str, list[str]] = defaultdict(list)
        for case, recs in cases.items():
            pair = recs.get(method), recs.get(baseline)
            if pair[0] and pair[1] and pair[0].get("reference_digest") == pair[1].get("reference_digest"):
                groups[recs[baseline]["dataset"]].append(case)
                groups[POOLED].append(case)
        for name in [*sorted(g for g in groups if g != POOLED), POOLED]:
            group = groups[name]
            a = [cases[c][method] for c in group]
            b = [cases[c][baseline] for c in group]

            def diffs(field: str, a=a, b=b) -> list[float]:
                return [float(x[field]) - float(y[field]) for x, y in zip(a, b, strict=True)]

            closer = sum(d < 0 for d in diffs("kl_mean"))
            share = statistics.fmean(float(x["compute_share"]) for x in a)
            ttft = statistics.median(float(x["ttft_s"]) for x in a) / statistics.median(float(y["ttft_s"]) for y in b)
            rows.append(
                f"| {name} | {method} | {len(group)} | {statistics.fmean(float(x['kl_mean']) for x in a):.4f} | "
                f"{interval(diffs('kl_mean'), 4)} | {closer}/{len(group)} | {interval(diffs('top1'), 3)} | "
                f"{interval(diffs('first_token'), 3)} | {share:.3f} | {ttft:.2f} |"
            )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="a benchmarks/fidelity.py --out folder")
    p.add_argument("--baseline", default="attention@0.15")
    p.add_argument("--methods", default=None, help="comma-separated (default: every recorded method but full)")
    args = p.parse_args()
    cases = by_case(args.run)
    recorded = sorted({m for recs in cases.values() for m in recs} - {"full", args.baseline})
    methods = [m.strip() for m in args.methods.split(",")] if args.methods else recorded
    if not any(args.baseline in recs for recs in cases.values()):
        p.error(f"{args.run} has no records of the baseline {args.baseline!r}; it has {', '.join(recorded)}")
    print(f"Paired against {args.baseline} (method minus baseline, 95% bootstrap intervals over cases)\n")
    print("| set | method | cases | mean KL | KL minus baseline | closer | top-1 minus baseline | "
          "first token minus baseline | compute share | median TTFT / baseline's |")  # fmt: skip
    print("|---|---|---:|---:|---|---:|---|---|---:|---:|")
    print("\n".join(paired_rows(cases, args.baseline, methods)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
