"""`cacheblend-rag bench ...`: the paper's evaluation (quality, throughput) and the fidelity benchmark."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from ..config import LEAD_IN_DEFAULT, LEAD_IN_HELP, RULE_NAMES
from ..errors import CacheBlendError
from .fidelity import DEFAULT_RATIOS

if TYPE_CHECKING:
    from ..engine import CacheBlendEngine


# -- bench: the paper's §7 evaluation (quality per data set and method) ----------------------------------------


def _require_eval_deps() -> None:
    import importlib.util

    missing = [m for m in ("rouge_score", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        raise CacheBlendError(f"bench needs {', '.join(missing)}: pip install 'cacheblend-rag[eval]'")


def _bench_dataset_names(args: argparse.Namespace) -> list[str]:
    """The canonical, de-duplicated names of --datasets, after checking --limit (both before any model loads)."""
    from .datasets import canonical_dataset_name

    if args.limit is not None and args.limit < 1:
        raise CacheBlendError(f"--limit must be >= 1, got {args.limit}")
    names = list(dict.fromkeys(canonical_dataset_name(n) for n in args.datasets.split(",") if n.strip()))
    if not names:
        raise CacheBlendError("--datasets names no data set; e.g. musique,wikimqa")
    return names


def _load_bench_engine(args: argparse.Namespace) -> CacheBlendEngine:
    """The engine of --model/--device/--dtype, its load time reported on stderr."""
    from ..config import EngineConfig, resolve_lead_in
    from ..engine import CacheBlendEngine

    t = time.perf_counter()
    config = EngineConfig(device=args.device, dtype=args.dtype, lead_in=resolve_lead_in(args.lead_in))
    engine = CacheBlendEngine.from_pretrained(args.model, config=config)
    print(f"model {args.model or 'default preset'} ready in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    return engine


def _run_settings(args: argparse.Namespace, **extra: object) -> dict[str, object]:
    """What a run's results depend on besides its methods and cases (--model, --dtype, --device, --lead-in): kept
    with the results, so that a resumed run cannot mix setups (`check_run_settings`)."""
    settings = {"model": args.model or "default", "dtype": args.dtype, "device": args.device}
    return {**settings, "lead_in": args.lead_in, **extra}


def cmd_bench_quality(args: argparse.Namespace) -> int:
    from . import load_dataset, parse_methods, run_quality, summarize, summary_markdown, write_report

    # Check names, files, numbers and packages before the model loads (that takes a while).
    _require_eval_deps()
    names = _bench_dataset_names(args)
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise CacheBlendError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    methods = parse_methods(args.methods)
    datasets = [
        load_dataset(n, args.data_dir, args.limit, **({"shots": args.samsum_shots} if n == "samsum" else {}))
        for n in names
    ]
    engine = _load_bench_engine(args)
    settings = _run_settings(args, samsum_shots=args.samsum_shots)
    records = run_quality(engine, datasets, methods, args.out, max_new_tokens=args.max_new_tokens, settings=settings)
    files = write_report(args.out, records)
    print(summary_markdown(summarize(records)))
    print("wrote " + ", ".join(str(p) for p in files.values()), file=sys.stderr)
    return 0


def cmd_bench_report(args: argparse.Namespace) -> int:
    from . import load_records, summarize, summary_markdown, write_report

    _require_eval_deps()
    records = load_records(args.out)
    files = write_report(args.out, records)
    print(summary_markdown(summarize(records)))
    print("wrote " + ", ".join(str(p) for p in files.values()), file=sys.stderr)
    return 0


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from . import (
        ThroughputSettings,
        load_dataset,
        parse_rates,
        parse_throughput_methods,
        run_throughput,
        throughput_markdown,
    )
    from .datasets import SPECS

    # Names, numbers, files and packages are checked before the model loads.
    _require_eval_deps()
    names = _bench_dataset_names(args)
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
    engine = _load_bench_engine(args)
    info = _run_settings(args, limit=args.limit)
    result = run_throughput(engine, datasets, methods, args.out, settings, info=info)
    print(throughput_markdown(result))
    print(f"wrote {args.out}/results.json, summary.md and ttft_vs_rate.png", file=sys.stderr)
    return 0


def _add_engine_arguments(parser: argparse.ArgumentParser, folders: str, *, dtype_help: str | None = None) -> None:
    """--data-dir, --model, --device, --dtype and --lead-in, the arguments every bench command shares."""
    parser.add_argument("--data-dir", help=f"folder with {folders} (default ../shared/data)")
    parser.add_argument("--model", help="preset name or local checkpoint (default: the default preset)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help=dtype_help)
    parser.add_argument("--lead-in", default=LEAD_IN_DEFAULT, help=LEAD_IN_HELP)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """`bench quality` runs the paper's quality comparison; `bench report` redraws its table and figures."""
    from .methods import DEFAULT_METHODS
    from .throughput import DEFAULT_RATES, DEFAULT_THROUGHPUT_METHODS

    bench = sub.add_parser("bench", help="benchmarks of the paper's evaluation (quality per data set and method)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)

    q = bench_sub.add_parser(
        "quality",
        help="score each method on each data set; resumable (one JSONL record per case in --out)",
        description="Runs data sets x methods x cases on one model, appending a record per case to "
        "OUT/results.jsonl (rerun the same command to resume), then writes OUT/summary.md and figures.",
    )
    q.add_argument("--datasets", default="musique,wikimqa,multi_news,samsum", help="comma-separated")
    q.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated: full, prefix, reuse, blend@R "
                   "(the default rule), RULE@R (a named rule, e.g. gradual@0.15), mapreduce, maprerank")  # fmt: skip
    q.add_argument("--limit", type=int, help="first N cases of each data set (default: all)")
    q.add_argument("--out", default="bench-results/quality", help="output folder (results.jsonl, summary, PNGs)")
    _add_engine_arguments(q, "musique/, wikimqa/, multi_news/, samsum/")
    q.add_argument("--max-new-tokens", type=int, help="answer budget for every data set (default: 32 for QA, "
                   "128 for summaries)")  # fmt: skip
    q.add_argument("--samsum-shots", type=int, default=10, help="validation examples per SAMSum case")
    q.set_defaults(func=cmd_bench_quality)

    r = bench_sub.add_parser("report", help="rebuild summary.md and the figures from OUT/results.jsonl")
    r.add_argument("--out", default="bench-results/quality", help="the folder `bench quality` wrote")
    r.set_defaults(func=cmd_bench_report)

    t = bench_sub.add_parser(
        "throughput",
        help="TTFT and completed requests/s under Poisson arrivals, chunks reused across requests (Fig. 14)",
        description="Builds the paper's 'extended' sets (the contexts of the first --limit cases split into "
        "--chunk-tokens chunks, each question asked --repeats times with its top-k chunks in a new random order; "
        "repeated, not paraphrased as the paper did with GPT-4), serves them with each method from an empty store, "
        "and queues them at each rate on one FIFO server. Writes OUT/results.json, summary.md and a figure.",
    )
    t.add_argument("--datasets", default="musique,wikimqa", help="comma-separated QA data sets")
    t.add_argument("--methods", default=DEFAULT_THROUGHPUT_METHODS, help="comma-separated: full, prefix, reuse, "
                   "blend@R")  # fmt: skip
    t.add_argument("--rates", default=",".join(f"{r:g}" for r in DEFAULT_RATES), help="request rates (req/s), "
                   "comma-separated")  # fmt: skip
    t.add_argument("--mode", default="replay", choices=["replay", "live"], help="replay: one pass per method, "
                   "exact FIFO queue computed per rate; live: real arrivals, one pass per method and rate")  # fmt: skip
    t.add_argument("--limit", type=int, help="first N cases of each data set (default: all)")
    t.add_argument("--repeats", type=int, default=4, help="times each question is asked")
    t.add_argument("--top-k", type=int, default=6, help="chunks retrieved per request")
    t.add_argument("--chunk-tokens", type=int, default=512, help="chunk size of the chunk database")
    t.add_argument("--warmup", type=int, help="first requests served but not measured (default: a sixth)")
    t.add_argument("--max-new-tokens", type=int, default=16, help="answer budget; service lasts until it ends")
    t.add_argument("--ttft-slo", type=float, help="TTFT target (s): report the highest rate whose p90 meets it")
    t.add_argument("--store-mb", type=float, help="memory store budget per method (default: the engine's)")
    t.add_argument("--seed", type=int, default=0, help="chunk orders, request order and arrival gaps")
    t.add_argument("--out", default="bench-results/throughput", help="output folder")
    _add_engine_arguments(t, "musique/ and wikimqa/")
    t.set_defaults(func=cmd_bench_throughput)

    add_fidelity_parser(bench_sub)


def _parse_ratios(text: str) -> list[float]:
    try:
        ratios = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CacheBlendError(f"--ratios must be comma-separated numbers in (0, 1], got {text!r}") from None
    if not ratios or any(not 0.0 < r <= 1.0 for r in ratios):
        raise CacheBlendError(f"--ratios must be comma-separated numbers in (0, 1], got {text!r}")
    return list(dict.fromkeys(ratios))


def cmd_bench_fidelity(args: argparse.Namespace) -> int:
    from .datasets import load_dataset
    from .fidelity import RESULTS_FILE, fidelity_methods, run_fidelity
    from .fidelity_report import fidelity_markdown, summarize_fidelity, write_fidelity_report
    from .records import load_records

    # Names, numbers, files and packages are checked before the model loads.
    _require_eval_deps()
    if args.report_only:
        records = load_records(args.out, filename=RESULTS_FILE)
    else:
        names = _bench_dataset_names(args)
        rules = [r.strip() for r in args.rules.split(",") if r.strip()]
        methods = fidelity_methods(rules, _parse_ratios(args.ratios), reuse=not args.no_reuse)
        datasets = [load_dataset(n, args.data_dir, args.limit) for n in names]
        engine = _load_bench_engine(args)
        settings = _run_settings(args)
        records = run_fidelity(engine, datasets, methods, args.out, settings=settings)
    files = write_fidelity_report(args.out, records)
    print(fidelity_markdown(summarize_fidelity(records), records))
    print("wrote " + ", ".join(str(p) for p in files.values()), file=sys.stderr)
    return 0


def add_fidelity_parser(bench_sub: argparse._SubParsersAction) -> None:
    f = bench_sub.add_parser(
        "fidelity",
        help="teacher-forced fidelity to full recompute (KL, top-1 agreement) of each selection rule and ratio",
        description="Per case, full recompute writes the reference answer greedily; every method then prefills "
        "the same prompt and is fed that answer, and its next-token distributions are compared with full's. "
        "Appends one record per (case, method) to OUT/fidelity.jsonl (rerun to resume), then writes "
        "OUT/summary.md and one Pareto figure per data set.",
    )
    f.add_argument("--datasets", default="musique,wikimqa,multi_news,samsum", help="comma-separated")
    f.add_argument("--rules", default=",".join(RULE_NAMES), help=f"comma-separated: {', '.join(RULE_NAMES)}")
    f.add_argument("--ratios", default=",".join(f"{r:g}" for r in DEFAULT_RATIOS), help="recompute ratios, "
                   "comma-separated")  # fmt: skip
    f.add_argument("--no-reuse", action="store_true", help="leave full KV reuse out")
    f.add_argument("--limit", type=int, help="first N cases of each data set (default: all)")
    f.add_argument("--out", default="bench-results/fidelity", help="output folder")
    f.add_argument("--report-only", action="store_true", help="only rebuild summary.md and figures from OUT")
    _add_engine_arguments(f, "musique/, wikimqa/, multi_news/, samsum/", dtype_help="float32 (default): "
                          "deviations and fidelity are measured in full precision")  # fmt: skip
    f.set_defaults(func=cmd_bench_fidelity)
