"""`cacheblend-rag bench fidelity`: teacher-forced fidelity of each selection rule to full recompute."""

from __future__ import annotations

import argparse
import sys

from ..config import RULE_NAMES
from ..errors import CacheBlendError
from .fidelity import DEFAULT_RATIOS


def _parse_ratios(text: str) -> list[float]:
    try:
        ratios = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CacheBlendError(f"--ratios must be comma-separated numbers in (0, 1], got {text!r}") from None
    if not ratios or any(not 0.0 < r <= 1.0 for r in ratios):
        raise CacheBlendError(f"--ratios must be comma-separated numbers in (0, 1], got {text!r}")
    return list(dict.fromkeys(ratios))


def cmd_bench_fidelity(args: argparse.Namespace) -> int:
    from ..cli import _bench_dataset_names, _load_bench_engine, _require_eval_deps
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
        settings = {"model": args.model or "default", "dtype": args.dtype, "device": args.device}
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
    f.add_argument("--data-dir", help="folder with musique/, wikimqa/, multi_news/, samsum/ (default ../shared/data)")
    f.add_argument("--model", help="preset name or local checkpoint (default: the default preset)")
    f.add_argument("--device", default="cpu")
    f.add_argument("--dtype", default="float32", help="float32 (default): deviations and fidelity are measured "
                   "in full precision")  # fmt: skip
    f.set_defaults(func=cmd_bench_fidelity)
