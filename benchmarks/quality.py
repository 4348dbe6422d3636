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
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchlib.cli import (  # noqa: E402
    add_engine_arguments,
    add_out_argument,
    dataset_names,
    load_engine,
    report_written,
    require_eval_deps,
    run_guarded,
    run_settings_of,
)
from benchlib.methods import DEFAULT_METHODS, parse_methods  # noqa: E402
from benchlib.quality import run_quality, write_and_show  # noqa: E402

from cacheblend_rag.errors import CacheBlendError  # noqa: E402
from cacheblend_rag.evaluation import load_dataset  # noqa: E402


def run(args: argparse.Namespace) -> int:
    # Check names, files, numbers and packages before the model loads (that takes a while).
    require_eval_deps()
    names = dataset_names(args.datasets, args.limit)
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", default="musique,wikimqa,multi_news,samsum", help="comma-separated")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated: full, prefix, reuse, blend@R "
                   "(the engine's rule), RULE@R (a named rule, e.g. gradual@0.15), mapreduce, maprerank")  # fmt: skip
    p.add_argument("--limit", type=int, help="first N cases of each data set (default: all)")
    add_out_argument(p, "quality", "output folder (results.jsonl, summary, PNGs)")
    add_engine_arguments(p, "musique/, wikimqa/, multi_news/, samsum/")
    p.add_argument("--max-new-tokens", type=int, help="answer budget for every data set (default: 32 for QA, "
                   "128 for summaries)")  # fmt: skip
    p.add_argument("--samsum-shots", type=int, default=10, help="validation examples per SAMSum case")
    return run_guarded(run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
