"""What the per-case benchmark scripts (`benchmarks/answer_drift.py`, `probe_depth.py`, `selection_headroom.py`)
share: their common options, the case list they take, and their resumable records file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .records import load_records


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
