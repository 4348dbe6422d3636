"""What bf16 costs the blend: each dtype's blend against its own full recompute, and bf16 against fp32.

Two engines of one model, fp32 and bf16, on the same CPU. Per case (interleaved over the data sets, chunk KV
stored alone after the prefix in each engine, teacher forced as in `benchmarks/fidelity.py`):
- `fp32 blend | fp32 full`: the fp32 blend along fp32 full recompute's greedy answer;
- `bf16 blend | bf16 full`: the bf16 blend along bf16 full recompute's own greedy answer;
- `bf16 full | fp32 full`: bf16 full recompute along fp32's answer: the noise floor under every first-token
  figure measured in one dtype against another;
- `bf16 blend | fp32 full`: what a bf16 user gets, against the exact answer.
The blend is the default (`BlendConfig()`: "attention" at r = 0.15). The summary pairs the first two per case:
the bf16 blend's KL to its reference minus the fp32 blend's, and the same for first-token and top-1 agreement,
with 95% bootstrap intervals over cases. Records go to OUT/dtype_fidelity.jsonl (rerun to resume).

    python benchmarks/dtype_fidelity.py --limit 13 --out benchmarks/results/dtype-fidelity
    python benchmarks/dtype_fidelity.py --report-only --out benchmarks/results/dtype-fidelity
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchlib.cli import add_out_argument, cpu_name, dataset_names, model_name, run_guarded  # noqa: E402
from benchlib.dtype_fidelity import case_record, dtype_markdown  # noqa: E402
from benchlib.fidelity_run import interleave  # noqa: E402
from benchlib.records import append_record, check_run_settings, load_records  # noqa: E402

from cacheblend_rag import CacheBlendEngine, EngineConfig  # noqa: E402
from cacheblend_rag.errors import CacheBlendError  # noqa: E402
from cacheblend_rag.evaluation import load_dataset  # noqa: E402

RESULTS_FILE = "dtype_fidelity.jsonl"


def run(args: argparse.Namespace) -> int:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        names = dataset_names(args.datasets, args.limit)
        datasets = [load_dataset(n, args.data_dir, args.limit) for n in names]
        check_run_settings(out, {"model": model_name(args.model), "device": "cpu", "dtypes": "float32,bfloat16"})
        done = {(r["dataset"], r["case_id"]) for r in load_records(out, repair=True, filename=RESULTS_FILE)}
        work = [(s, c) for s, c in interleave(datasets) if (s.name, c.id) not in done]
        t = time.perf_counter()
        engines = {
            dtype: CacheBlendEngine.from_pretrained(args.model, config=EngineConfig(dtype=dtype), show_progress=False)
            for dtype in ("float32", "bfloat16")
        }
        print(f"two engines ready in {time.perf_counter() - t:.1f}s; {len(work)} cases to run", file=sys.stderr)
        from tqdm.auto import tqdm

        for spec, case in tqdm(work, desc="dtype fidelity", unit="case"):
            try:
                rec = case_record(engines["float32"], engines["bfloat16"], spec, case)
            except CacheBlendError as e:
                rec = {"dataset": spec.name, "case_id": case.id, "error": f"{type(e).__name__}: {e}"}
            append_record(out / RESULTS_FILE, rec)
            for engine in engines.values():
                engine.clear_store()
        for engine in engines.values():
            engine.close()
    records = [r for r in load_records(out, filename=RESULTS_FILE) if "error" not in r]
    text = dtype_markdown(records, machine=f"{model_name(args.model)} on {cpu_name()}")
    (out / "summary.md").write_text(text + "\n")
    print(text)
    print(f"wrote {out / 'summary.md'}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", default="musique,wikimqa,multi_news,samsum", help="comma-separated")
    p.add_argument("--limit", type=int, help="first N cases of each data set (default: all)")
    p.add_argument("--data-dir", help="folder with the data sets (default: $CACHEBLEND_RAG_DATA)")
    p.add_argument("--model", help="preset name or local checkpoint (default: the default preset)")
    p.add_argument("--report-only", action="store_true", help="only rebuild summary.md from OUT's records")
    add_out_argument(p, "dtype-fidelity", f"records and summary ({RESULTS_FILE}, summary.md)")
    args = p.parse_args(argv)
    return run_guarded(run, args)


if __name__ == "__main__":
    sys.exit(main())
