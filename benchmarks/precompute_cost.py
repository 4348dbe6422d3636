"""What a folder's precompute costs: grouped entries (the default) against each chunk prefilled alone.

The folder is chunked as `cacheblend-rag ask --docs` chunks it. Two fresh engines (memory stores only) run
`precompute(chunks, context=None)` (the isolated pass: every chunk after the prefix alone) and `precompute(chunks)`
(grouped: the later chunks of each group alone, then one full prefill per group); the table gives each one's time,
the tokens it prefilled and the ratio. Run in alternation, --repeats times, each on a fresh engine.

    python benchmarks/precompute_cost.py --docs /tmp/realdocs --out benchmarks/results/precompute-cost
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchlib.cli import add_out_argument, cpu_name, model_name, write_results  # noqa: E402

from cacheblend_rag import CacheBlendEngine, EngineConfig, StoreConfig  # noqa: E402
from cacheblend_rag.retrieval import load_documents, split_documents  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=Path, required=True, help="folder of text documents")
    p.add_argument("--suffix", action="append", help="file suffixes (default: .txt .md .rst)")
    p.add_argument("--glob", action="append", help="file globs, e.g. '**/copyright'")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--memory-gb", type=float, default=2.0, help="the memory tier's budget (entries past it are "
                   "evicted: the time is still every chunk's)")  # fmt: skip
    add_out_argument(p, "precompute-cost", "results.json and summary.md")
    args = p.parse_args(argv)
    options = {k: v for k, v in (("suffixes", args.suffix), ("globs", args.glob)) if v}
    documents = load_documents(args.docs, **options)
    config = EngineConfig(dtype=args.dtype, store=StoreConfig(memory_budget_bytes=int(args.memory_gb * 2**30)))
    base = CacheBlendEngine.from_pretrained(args.model, config=config, show_progress=False)
    chunks = [c.text for c in split_documents(documents, base.tokenizer, chunk_tokens=args.chunk_tokens)]
    tokens = sum(len(base.tokenizer(c + config.chunk_separator)["input_ids"]) for c in chunks)
    runs: dict[str, list[float]] = {"isolated": [], "grouped": []}
    counts = {}
    for _ in range(args.repeats):
        for kind, context in (("isolated", None), ("grouped", "auto")):
            engine = CacheBlendEngine(base.model, base.tokenizer, config=config)  # a fresh, empty memory store
            t = time.perf_counter()
            done = engine.precompute(chunks, context=context)
            runs[kind].append(time.perf_counter() - t)
            counts[kind] = dict(done._asdict(), entries=len(engine.store))
            engine.close()
            print(f"{kind}: {runs[kind][-1]:.1f}s {counts[kind]}", file=sys.stderr)
    iso, grp = statistics.median(runs["isolated"]), statistics.median(runs["grouped"])
    report = dict(model=model_name(args.model), dtype=config.dtype, cpu=cpu_name(), docs=str(args.docs),
                  chunks=len(chunks), chunk_tokens=tokens, runs=runs, counts=counts, ratio=grp / iso)  # fmt: skip
    text = "\n".join([
        f"{len(chunks)} chunks ({tokens} tokens) of {args.docs}; {report['model']} {config.dtype} on {report['cpu']}; "
        f"median of {args.repeats}",
        "",
        "| precompute | seconds | entries stored |",
        "|---|---:|---:|",
        f"| each chunk alone (isolated pass) | {iso:.1f} | {counts['isolated']['entries']} |",
        f"| grouped (the default) | {grp:.1f} | {counts['grouped']['entries']} |",
        "",
        f"grouped / isolated: {grp / iso:.2f}x",
    ])  # fmt: skip
    write_results(args.out, report, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
