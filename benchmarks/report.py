"""Rebuild the quality benchmark's summary.md, summary.json and figures from OUT/results.jsonl, e.g.
`python benchmarks/report.py --out benchmarks/results/quality-qa`."""

from __future__ import annotations

import argparse
import sys

from benchlib.cli import add_out_argument, report_written, require_eval_deps, run_guarded
from benchlib.quality import load_records, write_and_show


def run(args: argparse.Namespace) -> int:
    require_eval_deps()
    records = load_records(args.out)
    report_written(write_and_show(args.out, records))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_argument(p, "quality", "the folder `benchmarks/quality.py` wrote")
    return run_guarded(run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
