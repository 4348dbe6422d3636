"""Record the base blend's risk signals on cases the fidelity benchmark has already measured.

The guard decides from signals of the base blend alone (`cacheblend_rag.guard.first_token_signals`). On a
case whose fidelity records already hold full recompute, full reuse and the base blend (`benchmarks/fidelity.py`,
deterministic on one machine and model), the signal study and a guard that escalates straight to full recompute
need only those signals: one chunk prefill and one blend per case, a quarter of a fidelity run's compute. Appends
one record per case to OUT/probe.jsonl (rerun to resume), with the blend's first token and the first token of the
recorded reference, so that `benchlib.guard_study` can check that the blend is the one recorded.

    python benchmarks/guard_probe.py --records benchmarks/results/fidelity/fidelity.jsonl --limit 50 \
        --out benchmarks/results/guard --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchlib.cli import (  # noqa: E402
    add_engine_arguments,
    add_out_argument,
    dataset_names,
    load_engine,
    run_guarded,
    run_settings_of,
)
from benchlib.fidelity_run import interleave  # noqa: E402
from benchlib.records import append_record, check_run_settings, load_records  # noqa: E402

from cacheblend_rag.config import blend_rule  # noqa: E402
from cacheblend_rag.evaluation import load_dataset  # noqa: E402

PROBE_FILE = "probe.jsonl"


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    method = f"attention@{args.ratio:.2f}"
    measured: dict[tuple[str, str], dict[str, dict]] = {}
    for r in load_records(args.records.parent, filename=args.records.name):
        if r.get("method") in ("full", method) and "error" not in r:
            measured.setdefault((r["dataset"], r["case_id"]), {})[r["method"]] = r
    datasets = [load_dataset(n, args.data_dir, args.limit) for n in dataset_names(args.datasets, args.limit)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    check_run_settings(out, run_settings_of(args))
    done = {(r["dataset"], r["case_id"]) for r in load_records(out, repair=True, filename=PROBE_FILE)}
    work = [(s, c) for s, c in interleave(datasets) if len(measured.get((s.name, c.id), {})) == 2]
    work = [(s, c) for s, c in work if (s.name, c.id) not in done]
    engine = load_engine(args)
    blend = blend_rule("attention", args.ratio)
    for spec, case in tqdm(work, desc="probe", unit="case"):
        recorded = measured[(spec.name, case.id)]
        prompt = engine.build_prompt(list(case.chunks), case.question, template=spec.template)
        engine.precompute(list(case.chunks), case.question, template=spec.template, context=None)  # as recorded
        t0 = time.perf_counter()
        pre = engine.prefill(prompt, "blend", blend=blend)
        first = int(pre.logits.argmax())
        ttft = time.perf_counter() - t0
        reference = engine.tokenizer.encode(recorded["full"]["reference"], add_special_tokens=False)
        append_record(out / PROBE_FILE, {
            "dataset": spec.name, "case_id": case.id, "method": method, "prompt_tokens": prompt.num_tokens,
            "recorded_prompt_tokens": recorded[method]["prompt_tokens"], "first_token_id": first,
            "reference_first_id": reference[0] if reference else None,
            "recorded_first_token": recorded[method]["first_token"], "risk": pre.metrics.risk, "ttft_s": ttft,
            "compute_share": pre.metrics.compute_share,
        })  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=Path, default=Path(__file__).parent / "results" / "fidelity" / "fidelity.jsonl",
                   help="fidelity records with full recompute and the base blend (default: %(default)s)")  # fmt: skip
    p.add_argument("--datasets", default="musique,wikimqa,multi_news,samsum", help="comma-separated")
    p.add_argument("--ratio", type=float, default=0.15, help="the base blend's ratio (default: %(default)s)")
    p.add_argument("--limit", type=int, help="first N cases of each data set (default: all)")
    add_out_argument(p, "guard", "output folder")
    add_engine_arguments(p, "musique/, wikimqa/, multi_news/, samsum/")
    return run_guarded(run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
