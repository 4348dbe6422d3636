"""Answer quality of each method on each data set (the paper's §7, Fig. 12 and 16): F1 or Rouge-L and TTFT.

Runs data sets x methods x cases on one model, appending a record per case to OUT/results.jsonl (rerun the same
command to resume), then writes OUT/summary.md, summary.json and the figures (`python benchmarks/report.py`
redraws them from the records).

    python benchmarks/quality.py --datasets musique,wikimqa --limit 50 --data-dir ../shared/data
    python benchmarks/quality.py --datasets samsum --methods full,attention@0.15,reuse --limit 1 \\
        --model smollm2-135m-instruct --max-new-tokens 8 --out /tmp/quality      # a quick smoke run
"""

from __future__ import annotations

import argparse
import sys

from benchlib.cli import checked_datasets, dataset_benchmark, load_engine, report_written, run_guarded, run_settings_of
from benchlib.methods import DEFAULT_METHODS, parse_methods
from benchlib.quality import run_quality, write_and_show

from cacheblend_rag.errors import CacheBlendError
from cacheblend_rag.evaluation import load_dataset


def run(args: argparse.Namespace) -> int:
    # Check names, files, numbers and packages before the model loads (that takes a while).
    names = checked_datasets(args)
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise CacheBlendError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    methods = parse_methods(args.methods)
    datasets = [
        load_dataset(n, args.data_dir, args.limit, **({"shots": args.samsum_shots} if n == "samsum" else {}))
        for n in names
    ]
    engine = load_engine(args)
    settings = run_settings_of(args, samsum_shots=args.samsum_shots)
    records = run_quality(engine, datasets, methods, args.out, max_new_tokens=args.max_new_tokens, settings=settings)
    report_written(write_and_show(args.out, records))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = dataset_benchmark(
        __doc__, "quality", datasets="musique,wikimqa,multi_news,samsum", datasets_help="comma-separated",
        methods=DEFAULT_METHODS, methods_help="comma-separated: full, prefix, reuse, blend@R (the engine's rule), "
        "RULE@R (a named rule, e.g. gradual@0.15), mapreduce, maprerank",
        out_help="output folder (results.jsonl, summary, PNGs)", folders="musique/, wikimqa/, multi_news/, samsum/",
    )  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, help="answer budget for every data set (default: 32 for QA, "
                   "128 for summaries)")  # fmt: skip
    p.add_argument("--samsum-shots", type=int, default=10, help="validation examples per SAMSum case")
    return run_guarded(run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
