"""Which thread should compute a lone request on a CPU? Paired A/B of the thread that serves it.

    python research/serving_thread.py --repeats 5 --out research/results/serving_thread

PyTorch's CPU wheels run their threads on GNU OpenMP, which keeps a pool of threads per thread that runs torch
operations; once the pools hold more threads than there are cores, every pool sleeps between operations instead of
spinning. The engine used to serve every request on its worker thread, beside the pool of the thread that loaded
the model. Three ways to serve the same warm blend request (6 chunks of 512 tokens, 128-token greedy answer,
`decode_weights="int8"`), alternated in each repeat so that drifts of the machine fall on all three alike:
- `caller`: `engine.generate` on the main thread, which loaded the model (what a lone request does now);
- `second thread`: the same call from a new thread while the main thread keeps its pool (what every request did
  before: two pools on the machine's cores);
- `second thread, pool released`: the same, after the main thread let its pool go (`release_thread_pool`, what
  the engine now does on a thread that hands its work to the worker).
Reports the median TTFT, decode tokens/s and time per decode step of each, and the answers' equality. Writes
OUT/results.json and OUT/summary.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from benchlib.cli import cpu_name  # noqa: E402
from benchlib.load_requests import QUESTIONS  # noqa: E402
from benchlib.timing import chunk_texts  # noqa: E402

from cacheblend_rag import CacheBlendEngine, EngineConfig, ServingConfig  # noqa: E402
from cacheblend_rag.engine.serving.thread_pools import release_thread_pool  # noqa: E402

WAYS = ("caller", "second thread", "second thread, pool released")


def serve(engine: CacheBlendEngine, way: str, chunks: list[str], question: str, new_tokens: int):
    if way == "caller":
        return engine.generate(chunks, question, max_new_tokens=new_tokens)
    torch.ones(256, 256) @ torch.ones(256, 256)  # the main thread's pool exists, as after loading the model
    if way == "second thread, pool released":
        release_thread_pool()
    box = {}
    worker = threading.Thread(target=lambda: box.update(r=engine.generate(chunks, question, max_new_tokens=new_tokens)))
    worker.start()
    worker.join()
    return box["r"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--decode-weights", default="int8")
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--out", default="research/results/serving_thread")
    args = p.parse_args()
    engine = CacheBlendEngine.from_pretrained(
        args.model, config=EngineConfig(serving=ServingConfig(decode_weights=args.decode_weights)), show_progress=False
    )
    pool = chunk_texts(engine.tokenizer, 6, 512, Path(args.data_dir) if args.data_dir else None)
    engine.precompute(pool, QUESTIONS[0])
    engine.generate(pool, QUESTIONS[0], max_new_tokens=4)  # warm
    runs: dict[str, list[dict]] = {w: [] for w in WAYS}
    answers: dict[str, list[list[int]]] = {w: [] for w in WAYS}
    for r in range(args.repeats):
        question = QUESTIONS[r % len(QUESTIONS)]
        for way in WAYS[r % 3 :] + WAYS[: r % 3]:  # each way goes first in turn
            m = (res := serve(engine, way, pool, question, args.new_tokens)).metrics
            steps = max(m.generated_tokens - 1, 1)
            runs[way].append(dict(ttft_s=m.ttft_s, tokens_per_s=steps / m.decode_s, step_ms=1e3 * m.decode_s / steps))
            answers[way].append(res.token_ids)
            print(r, way, runs[way][-1], flush=True)
    rows = {w: {k: statistics.median(run[k] for run in runs[w]) for k in runs[w][0]} for w in WAYS}
    same = all(answers[w] == answers["caller"] for w in WAYS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = dict(cpu=cpu_name(), threads=torch.get_num_threads(), decode_weights=args.decode_weights,
                   repeats=args.repeats, rows=rows, runs=runs, same_answers=same)  # fmt: skip
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [f"{results['cpu']}, {results['threads']} torch threads, decode weights {args.decode_weights}; warm blend "
             f"of 6 x 512-token chunks, {args.new_tokens}-token answers, median of {args.repeats} alternated repeats.",
             "", "| served on | TTFT (s) | decode tokens/s | ms per decode step |", "|---|---:|---:|---:|"]  # fmt: skip
    for w, row in rows.items():
        lines.append(f"| {w} | {row['ttft_s']:.2f} | {row['tokens_per_s']:.1f} | {row['step_ms']:.1f} |")
    lines.append(f"\nSame greedy answers in every way: {same}.")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
