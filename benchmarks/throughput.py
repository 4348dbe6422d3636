"""Throughput under Poisson arrivals with chunks reused across requests (the paper's Fig. 14).

Builds the paper's "extended" sets (the contexts of the first --limit cases split into --chunk-tokens chunks, each
question asked --repeats times with its top-k chunks in a new random order; repeated, not paraphrased as the paper
did with GPT-4), serves them with each method from an empty store, and queues them at each rate on one FIFO
server (`benchlib/throughput.py` has the details). Writes OUT/results.json, summary.md and ttft_vs_rate.png;
`--report-only` rebuilds the last two from results.json.

    python benchmarks/throughput.py --limit 20 --ttft-slo 10            # default model, musique + wikimqa
    python benchmarks/throughput.py --model smollm2-135m-instruct --limit 2 --repeats 2 --rates 0.5,1 \\
        --top-k 3 --chunk-tokens 128 --max-new-tokens 4 --out /tmp/throughput   # a quick smoke run
    python benchmarks/throughput.py --mode live --rates 0.05,0.1 --limit 10   # real arrivals, one pass per rate
"""

from __future__ import annotations

import argparse
import sys

from benchlib.cli import checked_datasets, dataset_benchmark, load_engine, report_written, run_guarded, run_settings_of
from benchlib.throughput import run_throughput
from benchlib.throughput_report import throughput_markdown, write_throughput_report
from benchlib.throughput_settings import (
    DEFAULT_RATES,
    DEFAULT_THROUGHPUT_METHODS,
    ThroughputSettings,
    parse_rates,
    parse_throughput_methods,
)

from cacheblend_rag.errors import CacheBlendError
from cacheblend_rag.evaluation import load_dataset
from cacheblend_rag.evaluation.datasets import SPECS


def run(args: argparse.Namespace) -> int:
    # Names, numbers, files and packages are checked before the model loads.
    names = checked_datasets(args)
    if args.report_only:
        report_written(write_throughput_report(args.out))
        return 0
    if args.store_mb is not None and args.store_mb <= 0:
        raise CacheBlendError(f"--store-mb must be > 0, got {args.store_mb}")
    not_qa = [n for n in names if SPECS[n].task != "qa"]
    if not_qa:
        raise CacheBlendError(f"--datasets: {', '.join(not_qa)} is not a QA data set; use musique and/or wikimqa")
    settings = ThroughputSettings(
        rates=parse_rates(args.rates), chunk_tokens=args.chunk_tokens, top_k=args.top_k, repeats=args.repeats,
        warmup=args.warmup, max_new_tokens=args.max_new_tokens, seed=args.seed, mode=args.mode,
        ttft_slo_s=args.ttft_slo, store_bytes=None if args.store_mb is None else int(args.store_mb * 2**20),
    )  # fmt: skip
    methods = [m.name for m in parse_throughput_methods(args.methods)]
    datasets = [load_dataset(n, args.data_dir, args.limit) for n in names]
    engine = load_engine(args)
    result = run_throughput(engine, datasets, methods, args.out, settings, info=run_settings_of(args, limit=args.limit))
    print(throughput_markdown(result))
    print(f"wrote {args.out}/results.json, summary.md and ttft_vs_rate.png", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = dataset_benchmark(
        __doc__, "throughput", datasets="musique,wikimqa", datasets_help="comma-separated QA data sets",
        methods=DEFAULT_THROUGHPUT_METHODS, methods_help="comma-separated: full, prefix, reuse, blend@R, RULE@R",
        out_help="output folder", folders="musique/ and wikimqa/",
    )  # fmt: skip
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in DEFAULT_RATES), help="request rates (req/s), "
                   "comma-separated")  # fmt: skip
    p.add_argument("--mode", default="replay", choices=["replay", "live"], help="replay: one pass per method, "
                   "exact FIFO queue computed per rate; live: real arrivals, one pass per method and rate")  # fmt: skip
    p.add_argument("--repeats", type=int, default=4, help="times each question is asked")
    p.add_argument("--top-k", type=int, default=6, help="chunks retrieved per request")
    p.add_argument("--chunk-tokens", type=int, default=512, help="chunk size of the chunk database")
    p.add_argument("--warmup", type=int, help="first requests served but not measured (default: a sixth)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="answer budget; service lasts until it ends")
    p.add_argument("--ttft-slo", type=float, help="TTFT target (s): report the highest rate whose p90 meets it")
    p.add_argument("--store-mb", type=float, help="memory store budget per method (default: the engine's)")
    p.add_argument("--seed", type=int, default=0, help="chunk orders, request order and arrival gaps")
    p.add_argument("--report-only", action="store_true", help="only rebuild summary.md and the figure from OUT")
    return run_guarded(run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
