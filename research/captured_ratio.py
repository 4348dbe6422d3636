"""Could the default ratio drop on captured chunk KV? The blend at a lower ratio on captured entries against the
default ratio on isolated ones, paired per case, from the captured-mixed fidelity run's records.

The serving plan asks whether r = 0.05 on context-aware chunk KV is as faithful as r = 0.15 on isolated KV (a third
of the recompute at today's fidelity). This pairs, per case, `attention@LOW+capmix` with `attention@HIGH` (the
isolated entries' default), on the same full-recompute reference (a pair whose reference digests differ is left
out), and prints per data set and pooled: mean KL of each, the paired difference with a 95% bootstrap interval
over cases, how many cases are closer, and first-token agreement. Runs on the current code, from records only:

    python research/captured_ratio.py benchmarks/results/fidelity-captured-mixed/fidelity.jsonl \
        > research/results/captured_ratio.md
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from cacheblend_rag.evaluation.fidelity import bootstrap_ci

SETS = {"samsum": "SAMSum", "multi_news": "MultiNews", "musique": "MuSiQue", "wikimqa": "2WikiMQA"}


def pairs(records: list[dict], low: str, high: str) -> dict[str, list[tuple[dict, dict]]]:
    """(captured low-ratio record, isolated default record) per case, grouped by data set."""
    by_case: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for r in records:
        if "error" not in r:
            by_case[(r["dataset"], r["case_id"])][r["method"]] = r
    out: dict[str, list[tuple[dict, dict]]] = defaultdict(list)
    for (dataset, _), methods in sorted(by_case.items()):
        a, b = methods.get(f"attention@{low}+capmix"), methods.get(f"attention@{high}")
        if a is None or b is None:
            continue
        if a.get("reference_digest") and b.get("reference_digest") and a["reference_digest"] != b["reference_digest"]:
            continue  # (taken records of older runs carry no digest; `--take-records` checked their answers)
        out[dataset].append((a, b))
    return out


def row(name: str, group: list[tuple[dict, dict]]) -> str:
    diffs = [a["kl_mean"] - b["kl_mean"] for a, b in group]
    lo, hi = bootstrap_ci(diffs)
    n = len(group)
    captured = sum(a["kl_mean"] for a, _ in group) / n
    isolated = sum(b["kl_mean"] for _, b in group) / n
    closer = sum(d < 0 for d in diffs)
    first_a = round(sum(a["first_token"] for a, _ in group))
    first_b = round(sum(b["first_token"] for _, b in group))
    share_a = sum(a["compute_share"] for a, _ in group) / n
    share_b = sum(b["compute_share"] for _, b in group) / n
    return (f"| {name} | {n} | {isolated:.3f} | {captured:.3f} | {sum(diffs) / n:+.3f} [{lo:+.3f}, {hi:+.3f}] | "
            f"{closer} of {n} | {first_b}/{n} -> {first_a}/{n} | {share_b:.3f} -> {share_a:.3f} |")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records", type=Path, help="a captured-mixed run's fidelity.jsonl (benchmarks/fidelity.py)")
    p.add_argument("--low", default="0.05", help="the ratio on captured entries (default: %(default)s)")
    p.add_argument("--high", default="0.15", help="the ratio on isolated entries (default: %(default)s)")
    args = p.parse_args()
    if not args.records.is_file():
        p.error(f"{args.records}: no such file; give the fidelity.jsonl of a --chunk-context captured-mixed run")
    records = [json.loads(line) for line in args.records.read_text().splitlines() if line.strip()]
    grouped = pairs(records, args.low, args.high)
    if not grouped:
        p.error(f"no case has both attention@{args.low}+capmix and attention@{args.high} with one reference")
    print(f"`attention`@{args.low} on captured-mixed chunk KV against `attention`@{args.high} on isolated chunk KV, "
          f"paired per case (KL to full recompute, nats; difference = captured@{args.low} - isolated@{args.high}, "
          "95% bootstrap interval over cases).\n")  # fmt: skip
    print(f"| set | cases | KL isolated@{args.high} | KL captured@{args.low} | difference [95% CI] | captured closer | "
          f"first token isolated@{args.high} -> captured@{args.low} | compute share |")  # fmt: skip
    print("|---|---:|---:|---:|---|---:|---|---|")
    for dataset, group in grouped.items():
        print(row(SETS.get(dataset, dataset), group))
    print(row("pooled", [pair for group in grouped.values() for pair in group]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
