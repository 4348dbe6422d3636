"""Two runs of contextual chunk KV compared case by case: the second against the first, and against isolated
entries, on the cases both runs measured (paired 95% bootstrap intervals over cases). By default the first is
nearest neighbours and the second the acyclic rule; `--names` labels other pairs (e.g. the same order before and
after a change of which entry the engine reads), and `--variants` runs of other kinds (e.g. contextual against
captured entries, `--variants ctx,capmix`).

    python research/context_order_paired.py benchmarks/results/fidelity-context \
        benchmarks/results/fidelity-context-acyclic
    python research/context_order_paired.py benchmarks/results/fidelity-context \
        benchmarks/results/fidelity-context-later --names "nearest before,nearest, later isolated"
    python research/context_order_paired.py benchmarks/results/fidelity-captured-mixed \
        benchmarks/results/fidelity-context-later --names "captured,contextual" --variants capmix,ctx

Reads the two folders' `fidelity.jsonl` (from `benchmarks/fidelity.py --chunk-context neighbours`, or another
`--chunk-context` for `--variants`); the isolated records are the second run's (taken from the main fidelity run;
pairs whose full recompute answers differ are left out). Loads no model.
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


def records(folder: Path) -> dict[str, dict[str, dict]]:
    """{case: {method: record}} of a fidelity run's folder."""
    by_case: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in load_records(folder, filename="fidelity.jsonl"):
        by_case[r["case_id"]][r["method"]] = r
    return by_case


def same_reference(a: dict[str, dict], b: dict[str, dict]) -> bool:
    """Whether two runs' records of a case were measured against the same full recompute answer."""
    return "full" not in a or "full" not in b or a["full"].get("reference") == b["full"].get("reference")


def paired(diffs: list[float]) -> tuple[float, float, float]:
    """Mean of `diffs` and its 95% bootstrap interval over cases (the fidelity benchmark's)."""
    return (statistics.fmean(diffs), *bootstrap_ci(diffs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("first", type=Path, help="a contextual run's folder (default label: nearest)")
    p.add_argument("second", type=Path, help="another run's folder, compared with the first (default: acyclic)")
    p.add_argument("--names", default="nearest,acyclic", help="labels of the two runs, comma-separated")
    p.add_argument("--variants", default="ctx,ctx", help="the method suffixes of the two runs' records "
                   "(ctx: neighbours, cap: captured, capmix: captured-mixed), comma-separated")  # fmt: skip
    args = p.parse_args()
    a_name, b_name = args.names.split(",", 1)
    a_var, b_var = (f"+{v}" for v in args.variants.split(","))
    near, acyc = records(args.first), records(args.second)
    common = [c for c in acyc if all(f"{m}{b_var}" in acyc[c] and f"{m}{a_var}" in near.get(c, {}) for m in METHODS)
              and same_reference(acyc[c], near[c])]  # fmt: skip
    print(f"{len(common)} cases measured by both runs\n")
    print(f"| method | KL isolated | KL {a_name} | KL {b_name} | {b_name} minus isolated | closer | {b_name} minus "
          f"{a_name} | closer | first tokens isolated / {a_name} / {b_name} |")  # fmt: skip
    print("|---|---:|---:|---:|---|---:|---|---:|---|")
    for m in METHODS:
        iso = [acyc[c][m]["kl_mean"] for c in common]
        nea = [near[c][f"{m}{a_var}"]["kl_mean"] for c in common]
        acy = [acyc[c][f"{m}{b_var}"]["kl_mean"] for c in common]
        vs_iso = paired([a - b for a, b in zip(acy, iso, strict=True)])
        vs_near = paired([a - b for a, b in zip(acy, nea, strict=True)])
        closer_iso = sum(a < b for a, b in zip(acy, iso, strict=True))
        closer_near = sum(a < b for a, b in zip(acy, nea, strict=True))
        first = [sum(int(d[c][k]["first_token"]) for c in common) for d, k in ((acyc, m), (near, f"{m}{a_var}"),
                                                                                   (acyc, f"{m}{b_var}"))]  # fmt: skip
        n = len(common)
        print(f"| {m} | {sum(iso) / n:.3f} | {sum(nea) / n:.3f} | {sum(acy) / n:.3f} | "
              f"{vs_iso[0]:+.3f} [{vs_iso[1]:+.3f}, {vs_iso[2]:+.3f}] | {closer_iso}/{n} | "
              f"{vs_near[0]:+.3f} [{vs_near[1]:+.3f}, {vs_near[2]:+.3f}] | {closer_near}/{n} | "
              f"{first[0]} / {first[1]} / {first[2]} |")  # fmt: skip
    print(f"\nPer set, mean KL isolated / {a_name} / {b_name}:\n")
    sets: dict[str, list[str]] = defaultdict(list)
    for c in common:
        sets[acyc[c]["full"]["dataset"] if "full" in acyc[c] else c.rsplit("-", 1)[0]].append(c)
    print("| set | cases | " + " | ".join(METHODS) + " |")
    print("|---|---:|" + "---|" * len(METHODS))
    for name, cases in sorted(sets.items()):
        cells = []
        for m in METHODS:
            means = [sum(d[c][k]["kl_mean"] for c in cases) / len(cases)
                     for d, k in ((acyc, m), (near, f"{m}{a_var}"), (acyc, f"{m}{b_var}"))]  # fmt: skip
            cells.append(" / ".join(f"{x:.3f}" for x in means))
        print(f"| {name} | {len(cases)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
