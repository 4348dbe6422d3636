"""Teacher-forced fidelity to full recompute (KL, top-1 agreement) of each selection rule at each ratio.

Per case, full recompute writes the reference answer greedily; every method then prefills the same prompt and is
fed that answer, and its next-token distributions are compared with full's (`cacheblend_rag.evaluation.fidelity`).
Appends one record per (case, method) to OUT/fidelity.jsonl (rerun to resume), then writes OUT/summary.md,
summary.json and one Pareto figure per data set; `--report-only` rebuilds those from the records.

    python benchmarks/fidelity.py --limit 50 --data-dir ../shared/data           # every rule, every ratio
    python benchmarks/fidelity.py --rules attention,paper --ratios 0.05,0.15 --limit 8 --out /tmp/fidelity
    python benchmarks/fidelity.py --report-only --out benchmarks/results/fidelity

`--kv-codec int8,int4` measures every method again with its chunk KV stored through each codec (the memory tier's
`memory_codec`), on the same model and against the same reference, named e.g. `attention@0.15+int8`; the summary
then gets a table of each codec's paired difference to the uncompressed store (`benchlib.fidelity_codecs`).

    python benchmarks/fidelity.py --rules attention --ratios 0.15,0.05 --kv-codec int8,int4 --limit 3 \
        --out benchmarks/results/fidelity-codecs

With `--chunk-context` too, the variant is read through each codec as well (`attention@0.15+grp+int4`, paired
against `attention@0.15+grp`): what a codec costs on entries cached in context.

    python benchmarks/fidelity.py --rules attention --ratios 0.15 --kv-codec int8,int4 --chunk-context grouped \
        --limit 3 --take-records benchmarks/results/fidelity-grouped-apart \
        --out benchmarks/results/fidelity-grouped-codecs
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
    parse_ratios,
    report_written,
    require_eval_deps,
    run_guarded,
    run_settings_of,
)
from benchlib.fidelity_codecs import codec_differences, codec_markdown  # noqa: E402
from benchlib.fidelity_context import (  # noqa: E402
    CAPTURED,
    CAPTURED_MIXED,
    CONTEXT,
    CONTEXT_INTRO,
    GROUPED,
    CapturePreparer,
    ContextPreparer,
    GroupPreparer,
    MixedCapturePreparer,
    VariantThroughCodec,
    capture_engine,
    context_engine,
    context_verdict,
    precompute_cost,
    split_context_rows,
    variant_cases,
)
from benchlib.fidelity_report import fidelity_markdown, summarize_fidelity, write_fidelity_report  # noqa: E402
from benchlib.fidelity_run import (  # noqa: E402
    DEFAULT_RATIOS,
    RESULTS_FILE,
    codec_engines,
    fidelity_methods,
    parse_codecs,
    run_fidelity,
)
from benchlib.records import load_records, take_records  # noqa: E402

from cacheblend_rag.config import DEFAULT_GROUP_TOKENS, RULE_NAMES  # noqa: E402
from cacheblend_rag.evaluation import load_dataset  # noqa: E402
from cacheblend_rag.store.codec import CODECS  # noqa: E402


def run(args: argparse.Namespace) -> int:
    # Names, numbers, files and packages are checked before the model loads.
    require_eval_deps()
    if args.report_only:
        records = load_records(args.out, filename=RESULTS_FILE)
    else:
        names = dataset_names(args.datasets, args.limit)
        rules = [r.strip() for r in args.rules.split(",") if r.strip()]
        methods = fidelity_methods(rules, parse_ratios(args.ratios), reuse=not args.no_reuse)
        codecs = parse_codecs(args.kv_codec)
        datasets = [load_dataset(n, args.data_dir, args.limit) for n in names]
        engine = load_engine(args)
        engines = codec_engines(engine, codecs)
        prepare = {}
        if args.chunk_context == "neighbours":
            engines[CONTEXT] = context_engine(engine, args.context_neighbours)
            full_sets = {
                ds.spec.name: load_dataset(n, args.data_dir, None) for n, ds in zip(names, datasets, strict=True)
            }
            prepare[CONTEXT] = ContextPreparer(full_sets, args.context_neighbours, args.context_order == "acyclic")
        elif args.chunk_context == "captured":
            engines[CAPTURED] = capture_engine(engine)
            prepare[CAPTURED] = CapturePreparer()
        elif args.chunk_context == "captured-mixed":
            engines[CAPTURED_MIXED] = capture_engine(engine)
            pools = {ds.spec.name: [c for case in load_dataset(n, args.data_dir, None).cases for c in case.chunks]
                     for n, ds in zip(names, datasets, strict=True)}  # fmt: skip
            prepare[CAPTURED_MIXED] = MixedCapturePreparer(pools)
        elif args.chunk_context == "grouped":
            engines[GROUPED] = capture_engine(engine)
            full_sets = {
                ds.spec.name: load_dataset(n, args.data_dir, None) for n, ds in zip(names, datasets, strict=True)
            }
            prepare[GROUPED] = GroupPreparer(full_sets, args.group_tokens)
        variants = list(prepare)  # the chunk-context variant, if any: through each codec too ('grp+int4')
        for variant in variants:
            through = VariantThroughCodec(engines[variant], prepare[variant])
            prepare[variant] = through.fill_variant
            for codec, codec_engine in codec_engines(engines[variant], codecs[1:]).items():
                engines[f"{variant}+{codec}"], prepare[f"{variant}+{codec}"] = codec_engine, through
        if args.take_records:
            wanted = {m.name for m in methods} | {f"{m.name}+{v}" for m in methods for v in variants} | {"full"}
            cases = {(ds.spec.name, c.id) for ds in datasets for c in ds.cases}
            taken = take_records(args.take_records, args.out, run_settings_of(args), RESULTS_FILE,
                                 lambda r: r["method"] in wanted and (r["dataset"], r["case_id"]) in cases)  # fmt: skip
            print(f"took {taken} records of {args.take_records}", file=sys.stderr)
        codec_ratios = parse_ratios(args.codec_ratios) if args.codec_ratios else None
        coded = [m for m in methods if m.ratio is None or codec_ratios is None or m.ratio in codec_ratios]
        records = run_fidelity(engine, datasets, methods, args.out, codecs=engines, codec_methods=coded,
                               prepare=prepare, settings=run_settings_of(args))  # fmt: skip
    records = variant_cases(records)  # every method on the same cases
    files = write_fidelity_report(args.out, records)
    print(fidelity_markdown(summarize_fidelity(records), records))
    codec_rows, context_rows = split_context_rows(codec_differences(records))
    print(codec_markdown(codec_rows))
    print(codec_markdown(context_rows, CONTEXT_INTRO, context_verdict))
    print("\n".join(precompute_cost(records)))
    report_written(files)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", default="musique,wikimqa,multi_news,samsum", help="comma-separated")
    p.add_argument("--rules", default=",".join(RULE_NAMES), help=f"comma-separated: {', '.join(RULE_NAMES)}; "
                   "attention:D reads the question's attention on the first share D of the layers only")  # fmt: skip
    p.add_argument("--ratios", default=",".join(f"{r:g}" for r in DEFAULT_RATIOS), help="recompute ratios, "
                   "comma-separated")  # fmt: skip
    p.add_argument("--no-reuse", action="store_true", help="leave full KV reuse out")
    p.add_argument("--kv-codec", default="native", help="stored-KV codecs to measure every method with, "
                   "comma-separated (the uncompressed 'native' is always measured): " + ", ".join(CODECS))  # fmt: skip
    p.add_argument("--codec-ratios", help="with --kv-codec: the ratios measured through the other codecs "
                   "(default: every ratio; full reuse always)")  # fmt: skip
    p.add_argument("--chunk-context", choices=["none", "neighbours", "captured", "captured-mixed", "grouped"],
                   default="none",
                   help="neighbours: "
                   "measure every method (or --codec-ratios' ones) again on contextual chunk KV ('+ctx'), each chunk "
                   "prefilled after its nearest passages of the data set's whole pool; captured: on chunk KV cut from "
                   "an earlier request's full prefill of the same passages in another order ('+cap'); captured-mixed: "
                   "from two earlier requests of half the passages each among other cases' ('+capmix'); grouped: "
                   "from full prefills of groups of similar passages of the pool, as precompute(context='groups') "
                   "stores a corpus ('+grp')")  # fmt: skip
    p.add_argument("--group-tokens", type=int, default=DEFAULT_GROUP_TOKENS, help="with --chunk-context grouped: "
                   "the most tokens of a group")  # fmt: skip
    p.add_argument("--context-neighbours", type=int, default=2, help="with --chunk-context: neighbours per chunk")
    p.add_argument("--context-order", choices=["nearest", "acyclic"], default="nearest", help="with --chunk-context "
                   "neighbours: the nearest passages, or the nearest among those earlier in a fixed order of the "
                   "pool, so that no two passages are in each other's context (use its own --out)")  # fmt: skip
    p.add_argument("--take-records", metavar="DIR", help="copy DIR's records of this run's methods and cases (same "
                   "model, dtype, device) instead of measuring them again: e.g. only '+cap' is new")  # fmt: skip
    p.add_argument("--limit", type=int, help="first N cases of each data set (default: all)")
    add_out_argument(p, "fidelity", "output folder")
    p.add_argument("--report-only", action="store_true", help="only rebuild summary.md and figures from OUT")
    add_engine_arguments(p, "musique/, wikimqa/, multi_news/, samsum/", dtype_help="float32 (default): "
                         "deviations and fidelity are measured in full precision")  # fmt: skip
    return run_guarded(run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
