"""Chunk KV cached after a lead-in against chunk KV cached alone: two `bench fidelity` runs, paired per case.

`cacheblend-rag bench fidelity --lead-in default` measures every method with each chunk but a prompt's first
cached after `DEFAULT_LEAD_IN`; the run without it caches every chunk right after the prefix. The reference
answer (full recompute) is the same in both. This script reads both runs' records, names the lead-in run's
methods `METHOD+lead-in`, and prints per data set, over the cases both runs finished:
- every method's mean KL and top-1 agreement [95% CI], and its paired KL difference to the same method
  without the lead-in;
- the issue's targets with the lead-in: the default rule at r = 0.05 against `paper` at 0.15 without one
  (KL and top-1 agreement, paired), and full KV reuse against the default rule at 0.15.

    python benchmarks/lead_in_compare.py --alone benchmarks/results/fidelity \\
        --lead-in benchmarks/results/fidelity-lead-in --out benchmarks/results/fidelity-lead-in/compare.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cacheblend_rag.evaluation.case_scripts import paired_kl_table
from cacheblend_rag.evaluation.fidelity import RESULTS_FILE
from cacheblend_rag.evaluation.fidelity_report import paired_difference
from cacheblend_rag.evaluation.records import load_records

TAG = "+lead-in"
TARGETS = (("attention@0.05" + TAG, "paper@0.15"), ("reuse" + TAG, "attention@0.15" + TAG))


def merged(alone: list[dict], lead_in: list[dict]) -> list[dict]:
    """Both runs' records on the cases the lead-in run measured (errors and full recompute's own rows left
    out), the lead-in run's methods tagged."""
    tagged = [{**r, "method": r["method"] + TAG} for r in lead_in if "error" not in r and r["method"] != "full"]
    cases = {(r["dataset"], r["case_id"]) for r in tagged}
    ok = [r for r in alone if "error" not in r and r["method"] != "full" and (r["dataset"], r["case_id"]) in cases]
    return ok + tagged


def report(records: list[dict]) -> str:
    tagged = sorted({r["method"] for r in records if r["method"].endswith(TAG)})
    plain = [m[: -len(TAG)] for m in tagged]
    order = [m for pair in zip(plain, tagged, strict=True) for m in pair]
    if "paper@0.15" not in order:
        order.append("paper@0.15")
    text = paired_kl_table(
        records,
        lambda names: [m for m in order if m in names],
        lambda m: m[: -len(TAG)] if m.endswith(TAG) else None,
        diff_column="KL - without lead-in",
    )
    lines = [text, "Targets, paired per case over the cases both runs finished:", ""]
    lines += ["| data set | A | B | cases | KL(A) - KL(B) [95% CI] | top-1(A) - top-1(B) [95% CI] |"]
    lines += ["|---|---|---|---|---|---|"]
    for ds in sorted({r["dataset"] for r in records}):
        for a, b in TARGETS:
            kl, top = paired_difference(records, ds, a, b, "kl_mean"), paired_difference(records, ds, a, b, "top1")
            if kl is None or top is None:
                continue
            lines.append(
                f"| {ds} | {a} | {b} | {kl[0]} | {kl[1]:+.4f} [{kl[2][0]:+.4f}, {kl[2][1]:+.4f}] | "
                f"{top[1]:+.3f} [{top[2][0]:+.3f}, {top[2][1]:+.3f}] |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--alone", required=True, help="the `bench fidelity` folder run without a lead-in")
    p.add_argument("--lead-in", required=True, help="the `bench fidelity --lead-in ...` folder")
    p.add_argument("--out", help="also write the report to this file")
    args = p.parse_args(argv)
    alone = load_records(args.alone, filename=RESULTS_FILE)
    lead_in = load_records(args.lead_in, filename=RESULTS_FILE)
    if not alone or not lead_in:
        empty = args.alone if not alone else args.lead_in
        print(f"no records in {Path(empty) / RESULTS_FILE}; run `cacheblend-rag bench fidelity` there", file=sys.stderr)
        return 2
    text = report(merged(alone, lead_in))
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
