# A study, kept for reading. It runs at the git tag lab-2026-11-25, where it is
# benchmarks/probe_depth.py: see research/README.md.
"""How deep must the attention probe go? Fidelity to full recompute of the attention rules at several
`BlendConfig.probe_depth` values, beside `paper` at r = 0.15 and `gradual` at r = 0.05, on the same cases.

The attention rules first run the question over all loaded chunk KV and average the attention it pays to each
chunk token. Stopping that pass after a share of the layers saves part of its cost (~0.3 s on 6 x 512 tokens
for the default model on 2 CPU cores); this measures what it costs in fidelity (teacher-forced mean KL to full
recompute and top-1 agreement, as `cacheblend-rag bench fidelity` measures them).

    python benchmarks/probe_depth.py --cases 45,46 --out benchmarks/results/probe_depth

Appends one JSON line per (case, method) to OUT/probe_depth.jsonl and prints a table of means per data set.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import sys

from cacheblend_rag import BlendConfig, CacheBlendEngine, EngineConfig, blend_rule
from cacheblend_rag.evaluation.case_scripts import case_script_parser, no_records, open_records, parse_cases
from cacheblend_rag.evaluation.datasets import load_dataset
from cacheblend_rag.evaluation.fidelity import measure_blend, prepare_case
from cacheblend_rag.evaluation.records import append_record

DATASETS = ("multi_news", "samsum", "musique", "wikimqa")
RESULTS_FILE = "probe_depth.jsonl"


def methods(depths: list[float]) -> dict[str, BlendConfig]:
    out = {}
    for rule, r in (("attention", 0.05), ("attention-deviation", 0.05), ("attention-deviation", 0.15)):
        for d in depths:
            out[f"{rule}@{r}/d{d}"] = dataclasses.replace(blend_rule(rule, r), probe_depth=d)
    out["paper@0.15"] = blend_rule("paper", 0.15)
    out["gradual@0.05"] = blend_rule("gradual", 0.05)
    return out


def table(records: list[dict]) -> str:
    by: dict[str, dict[str, list[dict]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in records:
        by[r["method"]][r["dataset"]].append(r)
    lines = ["mean KL / top-1 (cases) per data set, then mean compute share", "method".ljust(32)
             + "".join(d.rjust(18) for d in DATASETS) + "   share"]  # fmt: skip
    for method, per in by.items():
        cells = []
        for d in DATASETS:
            rs = per.get(d, [])
            kl = statistics.fmean(x["kl_mean"] for x in rs) if rs else None
            cell = f"{kl:.3f}/{statistics.fmean(x['top1'] for x in rs):.2f} ({len(rs)})" if rs else "-"
            cells.append(cell.rjust(18))
        share = statistics.fmean(x["compute_share"] for d in per.values() for x in d)
        lines.append(method.ljust(32) + "".join(cells) + f"   {share:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = case_script_parser(__doc__, cases="45,46", datasets=",".join(DATASETS), out="bench-results/probe_depth")
    p.add_argument("--depths", default="1.0,0.5,0.25", help="probe depths, comma-separated")
    args = p.parse_args(argv)
    out, records = open_records(args.out, RESULTS_FILE)
    if not args.report_only:
        indices = parse_cases(args.cases)
        plan = methods([float(x) for x in args.depths.split(",")])
        engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig())
        for name in args.datasets.split(","):
            ds = load_dataset(name, args.data_dir, limit=max(indices) + 1)
            for i in indices:
                case = ds.cases[i]
                prompt, ref = prepare_case(engine, ds.spec, case)
                for method, blend in plan.items():
                    rec = measure_blend(engine, prompt, ref, blend)
                    rec.update(dataset=name, case=case.id, method=method)
                    append_record(out / RESULTS_FILE, rec)
                    records.append(rec)
                print(name, case.id, file=sys.stderr, flush=True)
    if no_records(records, out / RESULTS_FILE):
        return 2
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
