"""Warm requests over a real folder: chunk KV read from the disk tier against the same request from memory.

The folder is indexed as `cacheblend-rag ask --docs` indexes it; each question retrieves its top --top-k chunks,
whose KV is precomputed into an engine with a disk tier (`--kv-dir` in a temporary folder, the default int8 codec)
in front of which sits the memory tier. Then, --repeats rounds, alternated: the question with its chunks in memory
(memory-warm), and with the memory tier cleared first (disk-warm: every chunk read from disk). The table gives each
one's median TTFT and the ratio.

    python benchmarks/folder_warm.py --docs /tmp/realdocs --glob '**/copyright' --out benchmarks/results/folder-warm
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchlib.cli import add_out_argument, cpu_name, model_name, write_results  # noqa: E402

from cacheblend_rag import CacheBlendEngine, EngineConfig, StoreConfig  # noqa: E402
from cacheblend_rag.retrieval import build_index_from_folder  # noqa: E402

QUESTIONS = ["Under which license is diffutils distributed?", "Who holds the copyright of the GNU Privacy Guard?"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=Path, required=True)
    p.add_argument("--glob", action="append", default=[])
    p.add_argument("--question", action="append", help=f"(default: {QUESTIONS})")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--repeats", type=int, default=5)
    add_out_argument(p, "folder-warm", "results.json and summary.md")
    args = p.parse_args(argv)
    questions = args.question or QUESTIONS
    with tempfile.TemporaryDirectory() as kv_dir:
        config = EngineConfig(dtype=args.dtype, store=StoreConfig(disk_dir=kv_dir))
        engine = CacheBlendEngine.from_pretrained(args.model, config=config, show_progress=False)
        index = build_index_from_folder(args.docs, engine.tokenizer, globs=args.glob)
        asks = [([h.chunk.text for h in index.search(q, k=args.top_k)], q) for q in questions]
        for chunks, q in asks:
            engine.precompute(chunks, q)
        engine.store.flush()
        times: dict[str, list[float]] = {"memory": [], "disk": []}
        for _ in range(args.repeats):
            for chunks, q in asks:
                for tier in ("memory", "disk"):
                    if tier == "disk":
                        engine.clear_store(["memory"])
                    m = engine.generate(chunks, q, max_new_tokens=1).metrics
                    assert m.chunks_missed == 0 and set(m.hits_by_tier) == {tier}, m.hits_by_tier
                    times[tier].append(m.ttft_s)
        engine.close()
    mem, disk = statistics.median(times["memory"]), statistics.median(times["disk"])
    report = dict(model=model_name(args.model), dtype=config.dtype, cpu=cpu_name(), docs=str(args.docs),
                  questions=questions, times=times, ratio=disk / mem)  # fmt: skip
    text = (f"{len(questions)} questions x {args.repeats} rounds over {args.docs}, top {args.top_k}; {report['model']} "
            f"{config.dtype} on {report['cpu']}\n\n| warm from | median TTFT (s) |\n|---|---:|\n"
            f"| memory | {mem:.3f} |\n| disk (int8) | {disk:.3f} |\n\ndisk / memory: {disk / mem:.3f}x")  # fmt: skip
    write_results(args.out, report, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
