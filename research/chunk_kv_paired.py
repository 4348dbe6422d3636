"""Chunk KV built several ways, compared case by case on the cases every run measured: isolated entries against
each variant (neighbour context, captured in earlier requests, grouped precompute, ...), paired 95% bootstrap
intervals over cases, first tokens kept, and the same per data set.

    python research/chunk_kv_paired.py ctx=benchmarks/results/fidelity-context-later \
        capmix=benchmarks/results/fidelity-captured-mixed grp=benchmarks/results/fidelity-grouped

Each argument is VARIANT=FOLDER: a `benchmarks/fidelity.py --chunk-context ...` run's folder and the suffix of its
records' methods (`attention@0.15+grp`); `LABEL:VARIANT=FOLDER` names by LABEL a run whose records carry
VARIANT's suffix (two grouped runs: `grp=A rule:grp=B`). `--methods` picks the methods compared (default: reuse
and the default rule at r = 0.05 and 0.15; for a run that measured one ratio, `--methods reuse,attention@0.15`).
The isolated records are the first run's (every run takes them from the main fidelity run); a case counts only
where every run measured every method against the same full-recompute answer. Loads no model.
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

METHODS = ("reuse", "attention@0.05", "attention@0.15")
NAMES = {"ctx": "neighbours", "cap": "captured", "capmix": "captured-mixed", "grp": "grouped"}


def records(folder: Path) -> dict[str, dict[str, dict]]:
    """{case: {method: record}} of a fidelity run's folder."""
    by_case: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in load_records(folder, filename="fidelity.jsonl"):
        by_case[r["case_id"]][r["method"]] = r
    return by_case


def label_name(label: str) -> str:
    """How a run is named in the tables: `NAMES`' name for its label, else the label (before any `:`)."""
    return NAMES.get(label, label.partition(":")[0])


def suffix(label: str) -> str:
    """The suffix of a run's records' methods: its label, or what follows `LABEL:`."""
    return label.rpartition(":")[2]


def common_cases(runs: dict[str, dict[str, dict[str, dict]]], methods: tuple[str, ...] = METHODS) -> list[str]:
    """The cases every run measured every method of, against the same reference answer."""
    first = next(iter(runs.values()))
    out = []
    for case in first:
        rows = [run.get(case, {}) for run in runs.values()]
        complete = all(m in first[case] for m in methods) and all(
            f"{m}+{suffix(v)}" in row for v, row in zip(runs, rows, strict=True) for m in methods
        )
        refs = {row["full"].get("reference") for row in rows if "full" in row}
        if complete and len(refs) <= 1:
            out.append(case)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="VARIANT=FOLDER")
    p.add_argument(
        "--methods", default=",".join(METHODS), help="comma-separated methods to compare (default: %(default)s)"
    )
    args = p.parse_args()
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if not methods:
        p.error("--methods names no method")
    runs = {}
    for spec in args.runs:
        variant, _, folder = spec.partition("=")
        if not folder:
            p.error(f"expected VARIANT=FOLDER, got {spec!r}")
        runs[variant] = records(Path(folder))
    cases = common_cases(runs, methods)
    if not cases:
        p.error(
            f"no case has every one of {', '.join(methods)} in every run (isolated and each variant); "
            "--methods picks fewer"
        )
    iso = next(iter(runs.values()))
    print(f"{len(cases)} cases measured by every run\n")
    print("| method | chunk KV | mean KL | minus isolated [95% CI] | closer | first tokens kept |")
    print("|---|---|---:|---|---:|---:|")
    for m in methods:
        base = [iso[c][m]["kl_mean"] for c in cases]
        kept = sum(int(iso[c][m]["first_token"]) for c in cases)
        print(f"| {m} | isolated | {statistics.fmean(base):.3f} | | | {kept}/{len(cases)} |")
        for v, run in runs.items():
            kl = [run[c][f"{m}+{suffix(v)}"]["kl_mean"] for c in cases]
            diffs = [a - b for a, b in zip(kl, base, strict=True)]
            lo, hi = bootstrap_ci(diffs)
            kept = sum(int(run[c][f"{m}+{suffix(v)}"]["first_token"]) for c in cases)
            closer = sum(d < 0 for d in diffs)
            print(f"| {m} | {label_name(v)} | {statistics.fmean(kl):.3f} | {statistics.fmean(diffs):+.3f} "
                  f"[{lo:+.3f}, {hi:+.3f}] | {closer}/{len(cases)} | {kept}/{len(cases)} |")  # fmt: skip
    sets: dict[str, list[str]] = defaultdict(list)
    for c in cases:
        sets[iso[c]["full"]["dataset"] if "full" in iso[c] else c.rsplit("-", 1)[0]].append(c)
    names = ["isolated", *(label_name(v) for v in runs)]
    for m in methods:
        print(f"\nPer set, {m}: mean KL (first tokens kept), worst case's KL\n")
        print("| set | cases | " + " | ".join(names) + " |")
        print("|---|---:|" + "---|" * len(names))
        for name, group in sorted(sets.items()):
            cells = []
            for run, key in [(iso, m), *((run, f"{m}+{suffix(v)}") for v, run in runs.items())]:
                kl = [run[c][key]["kl_mean"] for c in group]
                kept = sum(int(run[c][key]["first_token"]) for c in group)
                cells.append(f"{statistics.fmean(kl):.3f} ({kept}/{len(group)}), max {max(kl):.2f}")
            print(f"| {name} | {len(group)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
