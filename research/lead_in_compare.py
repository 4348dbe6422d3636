# A study, kept for reading. It runs at the git tag lab-2026-11-25, where it is
# benchmarks/lead_in_compare.py: see research/README.md.
"""Chunk KV cached after a lead-in against chunk KV cached alone: two `bench fidelity` runs, paired per case.

`cacheblend-rag bench fidelity --lead-in default` measures every method with each chunk but a prompt's first
cached after `DEFAULT_LEAD_IN`; the run without it caches every chunk right after the prefix. The reference
answer (full recompute) is the same in both. This script reads both runs' records, names the lead-in run's
methods `METHOD+lead-in`, and prints per data set, over the cases both runs finished:
- every method's mean KL and top-1 agreement [95% CI], and its paired KL difference to the same method
  without the lead-in;
- the fidelity targets with the lead-in: the default rule at r = 0.05 against `paper` at 0.15 without one
  (KL and top-1 agreement, paired), and full KV reuse against the default rule at 0.15.

    python benchmarks/lead_in_compare.py --alone benchmarks/results/fidelity \\
        --lead-in benchmarks/results/fidelity-lead-in --out benchmarks/results/fidelity-lead-in/compare.md

`--lead-in` repeats, as `NAME=FOLDER`, to set lead-ins side by side: each one's methods are tagged `+NAME`,
and each later one's default rule at r = 0.05 is also paired with the first one's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from cacheblend_rag.evaluation.case_scripts import paired_kl_table
from cacheblend_rag.evaluation.fidelity import RESULTS_FILE
from cacheblend_rag.evaluation.fidelity_report import paired_difference
from cacheblend_rag.evaluation.records import load_records

TAG = "+lead-in"  # the suffix of a run given without a name


def parse_run(spec: str) -> tuple[str, Path]:
    """'[NAME=]FOLDER' -> (the suffix its methods get, the folder): '+NAME', or '+lead-in' without a name."""
    name, sep, folder = spec.partition("=")
    if not sep:
        return TAG, Path(spec)
    if not name.replace("-", "").isalnum():
        raise SystemExit(f"--lead-in {spec!r}: a run's name is letters, digits and '-' (e.g. set-lead-in=FOLDER)")
    return "+" + name, Path(folder)


def tag_of(method: str, tags: Sequence[str]) -> str | None:
    """The lead-in suffix `method` ends with (the longest, so '+set-lead-in' is not read as '+lead-in')."""
    return next((t for t in sorted(tags, key=len, reverse=True) if method.endswith(t)), None)


def merged(alone: list[dict], runs: Sequence[tuple[str, list[dict]]]) -> list[dict]:
    """The runs' records on the cases some lead-in run measured (errors and full recompute's own rows left
    out), each lead-in run's methods tagged with its suffix."""
    tagged = [
        {**r, "method": r["method"] + tag}
        for tag, records in runs
        for r in records
        if "error" not in r and r["method"] != "full"
    ]
    cases = {(r["dataset"], r["case_id"]) for r in tagged}
    ok = [r for r in alone if "error" not in r and r["method"] != "full" and (r["dataset"], r["case_id"]) in cases]
    return ok + tagged


def targets(tags: Sequence[str]) -> list[tuple[str, str]]:
    """The pairs compared: per lead-in, the default rule at 0.05 against `paper` at 0.15 without a lead-in, and
    reuse against the default rule at 0.15 with the same lead-in; then each later lead-in's default rule at
    0.05 against the first one's."""
    pairs = [p for t in tags for p in (("attention@0.05" + t, "paper@0.15"), ("reuse" + t, "attention@0.15" + t))]
    return pairs + [("attention@0.05" + t, "attention@0.05" + tags[0]) for t in tags[1:]]


def report(records: list[dict], tags: Sequence[str] = (TAG,)) -> str:
    names = {r["method"] for r in records}
    tagged = [(m, tag_of(m, tags)) for m in names]
    plain = sorted({m[: -len(t)] for m, t in tagged if t} | {"paper@0.15"})  # the methods some lead-in run has
    order = [m + t for m in plain for t in ("", *tags) if m + t in names]

    def baseline(method: str) -> str | None:
        tag = tag_of(method, tags)
        return method[: -len(tag)] if tag else None

    text = paired_kl_table(
        records, lambda found: [m for m in order if m in found], baseline, diff_column="KL - without lead-in"
    )
    lines = [text, "Targets, paired per case over the cases both runs finished:", ""]
    lines += ["| data set | A | B | cases | KL(A) - KL(B) [95% CI] | top-1(A) - top-1(B) [95% CI] |"]
    lines += ["|---|---|---|---|---|---|"]
    for ds in sorted({r["dataset"] for r in records}):
        for a, b in targets(tags):
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
    p.add_argument(
        "--lead-in",
        required=True,
        action="append",
        metavar="[NAME=]FOLDER",
        help="a `bench fidelity --lead-in ...` folder; repeat it to compare lead-ins (runs of one NAME, e.g. one "
        "folder per data set, are read together; the first NAME is the one later ones are paired with)",
    )
    p.add_argument("--out", help="also write the report to this file")
    args = p.parse_args(argv)
    alone = load_records(args.alone, filename=RESULTS_FILE)
    runs = [(tag, load_records(folder, filename=RESULTS_FILE), folder) for tag, folder in map(parse_run, args.lead_in)]
    for folder, records in [(Path(args.alone), alone)] + [(f, r) for _, r, f in runs]:
        if not records:
            print(f"no records in {folder / RESULTS_FILE}; run `cacheblend-rag bench fidelity` there", file=sys.stderr)
            return 2
    tags = list(dict.fromkeys(tag for tag, _, _ in runs))
    text = report(merged(alone, [(tag, records) for tag, records, _ in runs]), tags)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
