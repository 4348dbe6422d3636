"""Do a blend's risk signals tell which requests drift from full recompute, and what does the guard buy?

Reads fidelity records (`benchmarks/fidelity.py`: full recompute, full KV reuse, the "attention" rule at 0.05 and
0.15, and at 0.5 where measured) and the base blend's risk signals (in the records, or from
`benchmarks/guard_probe.py` for cases measured before the signals existed), and writes OUT/guard.md and Pareto
figures (`benchlib.guard_study`):
- the signal table, per data set and pooled: each signal's Spearman correlation with KL(full || blend@0.15), its
  ROC AUC for "blend's first token differs from full's" and for "blend is further from full than reuse";
- every setting on the same cases: full reuse, fixed r, the guard with each trigger at each threshold
  (`Guard(max_kl=t)`, `Guard(min_margin=m)`), replayed from the records exactly as the engine decides
  (`FidelityProfile.outcome`), with 95% intervals, the cases left further from full than reuse, and TTFT mean
  and p90 next to full's: on every case with the guard escalating straight to full recompute, and with both
  ladders (0.5 then 1.0, or 1.0) on the cases measured at 0.5;
- the held-back check (`FidelityProfile.held_back_check`, as `cacheblend-rag calibrate` does it): the cheapest
  setting meeting a first-token target, chosen on the first two thirds of one data set's cases, measured on the
  rest; and, per data set, how often such a choice on n random questions holds on the others
  (`benchlib.calibration_size`).

    python benchmarks/guard_probe.py --limit 50 --data-dir ../shared/data
    python benchmarks/fidelity.py --datasets multi_news,samsum --rules attention --ratios 0.05,0.15,0.5 \
        --kv-codec int8 --codec-ratios 0.05,0.15 --limit 50 --out benchmarks/results/guard --data-dir ../shared/data
    python benchmarks/guard_signals.py
    python benchmarks/guard_signals.py --records benchmarks/results/guard-1.5b/fidelity.jsonl --probes none \
        --ratios 0.15 --out benchmarks/results/guard-1.5b          # a run that measured only the default ratio
    python benchmarks/guard_signals.py --records benchmarks/results/fidelity-captured/fidelity.jsonl --probes none \
        --variant cap --out benchmarks/results/guard-captured      # the blends on captured chunk KV
    python benchmarks/guard_signals.py --records benchmarks/results/fidelity-captured-mixed/fidelity.jsonl \
        --probes none --variant capmix --out benchmarks/results/guard-captured-mixed
    python benchmarks/guard_signals.py --cases-of benchmarks/results/fidelity-captured-mixed/fidelity.jsonl \
        --out benchmarks/results/guard-captured-mixed/isolated   # the same cases on isolated chunk KV
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from benchlib.calibration_size import calibration_sizes, sizes_markdown
from benchlib.guard_study import (
    BASE,
    load_cases,
    margin_rows,
    markdown_rows,
    plot_pareto,
    probe_consistency,
    profile,
    rows,
    signal_table,
)
from benchlib.records import load_records

from cacheblend_rag.controller.fidelity_profile import DEFAULT_MARGINS

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "guard"
FIDELITY = Path(__file__).parent / "results" / "fidelity" / "fidelity.jsonl"
CALIBRATION_SIZES = (10, 20, 30, 40)


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


def read_jsonl(paths: list[Path]) -> list[dict]:
    """The records of each file that exists (`benchlib.records.load_records`), in order."""
    return [r for path in paths for r in load_records(path.parent, filename=path.name)]


def section(title: str, cases_by_set: dict[str, list[dict]], grid: tuple, ladders: list[tuple], out: Path) -> list[str]:
    """Signal table, settings table and (per data set) Pareto figure of each group of cases."""
    lines = [f"\n# {title}\n"]
    groups = {**cases_by_set, "pooled": [c for cases in cases_by_set.values() for c in cases]}
    for name, cases in groups.items():
        table = rows(profile(cases, grid, ladders[0]))
        for ladder in ladders[1:]:
            table += rows(profile(cases, grid, ladder), fixed=False)
        for ladder in ladders:
            table += margin_rows(profile(cases, grid, ladder))
        lines += [f"\n## {name} ({len(cases)} cases)\n", *signal_markdown(cases), "", *markdown_rows(table)]
        if name != "pooled":
            tag = "-".join(f"{r:g}" for r in grid)
            figure = plot_pareto(table, name, out / f"guard_{name}_r{tag}.png")
            lines.append(f"\n![{name}]({figure.name})")
    return lines


def calibration_section(cases_by_set: dict[str, list[dict]], grid: tuple, target: float, draws: int) -> list[str]:
    """Per data set: how often `calibrate`'s choice on n random questions meets the target on the others."""
    lines = [f"\n# How many questions calibration needs (first-token target {target:g})\n",
             "Per data set, n questions drawn at random, the cheapest setting meeting the target on them chosen as "
             "`cacheblend-rag calibrate` does (fixed ratios, the KL trigger and the margin trigger), then measured "
             "on the questions not drawn (`benchlib.calibration_size`).\n"]  # fmt: skip
    for name, cases in cases_by_set.items():
        prof = replace(profile(cases, grid, (1.0,)), margins=DEFAULT_MARGINS)
        table = calibration_sizes(prof, CALIBRATION_SIZES, draws=draws, target_first_token=target)
        if table:
            lines += [f"\n## {name} ({len(cases)} cases)\n", *sizes_markdown(table, target)]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=Path, nargs="+", default=[RESULTS / "fidelity.jsonl", FIDELITY],
                   help="fidelity records; where two files hold the same (case, method), the later one "
                   "is read")  # fmt: skip
    p.add_argument("--probes", type=Path, default=RESULTS / "probe.jsonl", help="benchmarks/guard_probe.py records")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for guard.md and figures")
    p.add_argument("--held-back", default="musique", help="data set of the held-back check (default: %(default)s)")
    p.add_argument("--target-first-token", type=float, default=0.95)
    p.add_argument("--calibration-draws", type=int, default=100, help="random draws per calibration sample size "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--ratios", default="0.05,0.15", help="the fixed ratios every case needs, the base 0.15 among "
                   "them (default: %(default)s; 0.15 alone for a run that measured only the default)")  # fmt: skip
    p.add_argument("--variant", default="native", help="the chunk KV the blends read: 'native' (isolated entries), "
                   "or a fidelity.py variant such as 'cap' (captured) or 'ctx' (neighbours)")  # fmt: skip
    p.add_argument("--cases-of", type=Path, default=None, help="fidelity records: keep only the cases measured "
                   "there on other chunk KV (a method such as attention@0.15+capmix), to compare the guard on "
                   "isolated and on captured chunk KV over the same cases")  # fmt: skip
    args = p.parse_args(argv)
    grid = tuple(sorted({float(x) for x in args.ratios.split(",") if x.strip()}))
    if BASE not in grid:
        p.error(f"--ratios must include the base blend's {BASE}")
    records, probes = read_jsonl(args.records), read_jsonl([args.probes])
    if args.cases_of is not None:
        if not args.cases_of.is_file():
            p.error(f"--cases-of {args.cases_of}: no such file; give a benchmarks/fidelity.py fidelity.jsonl")
        variants = [r for r in read_jsonl([args.cases_of]) if "+" in r["method"]]  # e.g. attention@0.15+capmix
        keep = {(r["dataset"], r["case_id"]) for r in variants}
        records = [r for r in records if (r["dataset"], r["case_id"]) in keep]
    full_ladder = load_cases(records, probes, grid=grid, variant=args.variant)
    both_ladders = load_cases(records, probes, grid=(*grid, 0.5), variant=args.variant) if 0.5 not in grid else {}
    if not full_ladder:
        print(f"error: no case has full, reuse, attention at {args.ratios} and risk signals; run "
              "benchmarks/fidelity.py and benchmarks/guard_probe.py first (see --help)", file=sys.stderr)  # fmt: skip
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    same, checked = probe_consistency(probes)
    shown = [os.path.relpath(p, REPO) for p in (*args.records, args.probes)]
    lines = [f"Records: {', '.join(shown[:-1])}; probes: {shown[-1]} ({same} of {checked} probes "
             "pick the recorded reference's first token exactly when the recorded blend did).\n"]  # fmt: skip
    lines += section("The guard escalating straight to full recompute (0.15 -> 1)", full_ladder, grid, [(1.0,)],
                     args.out)  # fmt: skip
    if both_ladders:
        lines += section("Both ladders, on the cases measured at r = 0.5 too", both_ladders, (*grid, 0.5),
                         [(0.5, 1.0), (1.0,)], args.out)  # fmt: skip
    cases = full_ladder.get(args.held_back, [])
    if len(cases) >= 3:
        check = profile(cases, grid, (1.0,)).held_back_check(target_first_token=args.target_first_token)
        c, h = check.choice.estimate, check.held_back
        lines += [f"\n# Held-back check on {args.held_back}\n",
                  f"Chosen on the first {c.n} cases for first-token agreement >= {args.target_first_token}: "
                  f"{c.setting.name} (met: {check.choice.met}; first token {c.first_token:.2f}, compute "
                  f"{c.compute_share:.3f}). On the {h.n} held-back cases: first token {h.first_token:.2f} "
                  f"[{h.first_token_ci[0]:.2f}, {h.first_token_ci[1]:.2f}], top-1 {h.top1:.3f}, mean KL "
                  f"{h.kl_mean:.3f}, compute {h.compute_share:.3f}."]  # fmt: skip
    lines += calibration_section(full_ladder, grid, args.target_first_token, args.calibration_draws)
    text = "\n".join(lines) + "\n"
    (args.out / "guard.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
