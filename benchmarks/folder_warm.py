"""Warm requests over a real folder: chunk KV read from the disk tier against the same request from memory.

The folder is indexed as `cacheblend-rag ask --docs` indexes it; each question retrieves its top --top-k chunks,
whose KV is precomputed into an engine with a disk tier (`--kv-dir` in a temporary folder, the default int8 codec)
in front of which sits the memory tier. Then, --repeats rounds: each question with the memory tier cleared first
(disk-warm: its chunks read from disk), then again at once (memory-warm: the disk reads put them in memory). The
table gives each one's median TTFT, the ratio, and the share of the hits read from disk.

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
        from_disk: dict[str, list[float]] = {"memory": [], "disk": []}  # share of the hits read from disk
        for _ in range(args.repeats):
            for chunks, q in asks:
                for tier in ("disk", "memory"):  # the disk read promotes the chunks: then memory-warm
                    if tier == "disk":
                        engine.clear_store(["memory"])
                    m = engine.generate(chunks, q, max_new_tokens=1).metrics
                    assert m.chunks_missed == 0, f"a warm request missed {m.chunks_missed} chunks"
                    times[tier].append(m.ttft_s)
                    from_disk[tier].append(m.hits_by_tier.get("disk", 0) / max(m.chunks_hit, 1))
        engine.close()
    mem, disk = statistics.median(times["memory"]), statistics.median(times["disk"])
    report = dict(model=model_name(args.model), dtype=config.dtype, cpu=cpu_name(), docs=str(args.docs),
                  questions=questions, times=times, from_disk=from_disk, ratio=disk / mem)  # fmt: skip
    shares = {t: statistics.mean(v) for t, v in from_disk.items()}
    text = (f"{len(questions)} questions x {args.repeats} rounds over {args.docs}, top {args.top_k}; {report['model']} "
            f"{config.dtype} on {report['cpu']}\n\n| warm from | median TTFT (s) |\n|---|---:|\n"
            f"| memory | {mem:.3f} |\n| disk (int8) | {disk:.3f} |\n\ndisk / memory: {disk / mem:.3f}x; chunks read "
            f"from disk: {shares['disk']:.0%} of the disk-warm requests' hits, {shares['memory']:.0%} of the "
            "memory-warm ones'")  # fmt: skip
    write_results(args.out, report, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
