# A study, kept for reading. It runs at the git tag lab-2026-11-25, where it is
# cacheblend_rag/evaluation/case_scripts.py: see research/README.md.
"""What the per-case benchmark scripts (`benchmarks/answer_drift.py`, `probe_depth.py`, `selection_headroom.py`,
`chunk_context.py`) share: their common options, the case list they take, their resumable records file, and the
paired KL table they print."""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..config import EngineConfig
from ..engine import CacheBlendEngine
from .datasets import load_dataset
from .fidelity_report import paired_difference
from .records import load_records
from .report import bootstrap_ci


def parse_cases(text: str) -> list[int]:
    """'0-7' or '0,3,5' (or both, '0-2,5') -> case indices, in the order given."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def case_script_parser(description: str | None, *, cases: str, datasets: str, out: str) -> argparse.ArgumentParser:
    """A parser with the options every per-case script takes (--cases, --datasets, --out, --data-dir, --model,
    --report-only), given their defaults; a script adds its own."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=cases, help="case indices of every data set: '0-7' or '0,3,5'")
    p.add_argument("--datasets", default=datasets, help="comma-separated")
    p.add_argument("--out", default=out)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--report-only", action="store_true")
    return p


def open_records(out_dir: str, filename: str) -> tuple[Path, list[dict[str, Any]]]:
    """The output folder (made if missing) and the records already in it, a torn last line cut off."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out, load_records(out, repair=True, filename=filename)


def no_records(records: list[dict[str, Any]], path: Path) -> bool:
    """True, after telling stderr what to run, when a report finds no records at `path` to build on."""
    if records:
        return False
    print(f"no records in {path}; run without --report-only first", file=sys.stderr)
    return True


def paired_kl_table(
    records: Sequence[Mapping[str, Any]],
    order: Callable[[set[str]], list[str]],
    baseline_of: Callable[[str], str | None],
    *,
    first_column: str = "method",
    diff_column: str,
) -> str:
    """Per data set, over the cases on which every method finished: each method's mean KL and top-1 agreement
    with 95% intervals, its compute share, and its paired KL difference to `baseline_of(method)` (None: no
    difference shown). `order` puts the method names found in the order of the rows."""
    lines = []
    for ds in sorted({r["dataset"] for r in records}):
        mine = [r for r in records if r["dataset"] == ds]
        methods = order({r["method"] for r in mine})
        by_case: dict[str, set[str]] = collections.defaultdict(set)
        for r in mine:
            by_case[r["case_id"]].add(r["method"])
        cases = {c for c, ms in by_case.items() if ms >= set(methods)}
        rows = [r for r in mine if r["case_id"] in cases]
        lines += [f"{ds}: {len(cases)} cases with every method", ""]
        lines += [f"| {first_column} | mean KL [95% CI] | top-1 [95% CI] | compute share | {diff_column} [95% CI] |"]
        lines += ["|---|---|---|---|---|"]
        for method in methods:
            rs = [r for r in rows if r["method"] == method]
            if not rs:
                continue
            kl, top1 = [r["kl_mean"] for r in rs], [r["top1"] for r in rs]
            (kl_lo, kl_hi), (t_lo, t_hi) = bootstrap_ci(kl), bootstrap_ci(top1)
            share = statistics.fmean(r["compute_share"] for r in rs)
            baseline = baseline_of(method)
            diff = paired_difference(rows, ds, method, baseline, "kl_mean") if baseline else None
            d = f"{diff[1]:+.4f} [{diff[2][0]:+.4f}, {diff[2][1]:+.4f}]" if diff else "-"
            lines.append(
                f"| {method} | {statistics.fmean(kl):.4f} [{kl_lo:.4f}, {kl_hi:.4f}] | "
                f"{statistics.fmean(top1):.3f} [{t_lo:.3f}, {t_hi:.3f}] | {share:.3f} | {d} |"
            )
        lines.append("")
    return "\n".join(lines)


def cases_in_turn(sets: Mapping[str, Any], indices: Sequence[int]) -> Iterator[tuple[str, Any, int]]:
    """(data set name, data set, case index): case i of every set, then case i + 1, so that a run stopped part
    way covers the sets evenly. Indices past a set's end are skipped."""
    for i in indices:
        for name, ds in sets.items():
            if i < len(ds.cases):
                yield name, ds, i


def run_case_script(
    args: argparse.Namespace,
    results_file: str,
    measure: Callable[[Any, str, Any, int, set[str], Path], list[dict[str, Any]]],
    report: Callable[[list[dict[str, Any]]], str],
) -> int:
    """The body of a per-case script, after its options are parsed: unless `--report-only`, load the model and
    the data sets and call `measure(engine, set name, data set, case index, methods already done, out dir)`
    for each case in turn (it appends and returns its new records); then print `report(records)` and write it
    to OUT/summary.md. -> the exit status (2: no records to report)."""
    out, records = open_records(args.out, results_file)
    if not args.report_only:
        indices = parse_cases(args.cases)
        engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig())
        sets = {name: load_dataset(name, args.data_dir) for name in args.datasets.split(",")}
        for name, ds, i in cases_in_turn(sets, indices):
            case_id = ds.cases[i].id
            done = {r["method"] for r in records if r["dataset"] == name and r["case_id"] == case_id}
            records += measure(engine, name, ds, i, done, out)
            print(name, case_id, file=sys.stderr, flush=True)
    if no_records(records, out / results_file):
        return 2
    text = report(records)
    print(text)
    (out / "summary.md").write_text(text + "\n")
    return 0
