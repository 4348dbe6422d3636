"""Where a CPU decode step's time goes: torch.profiler over a warm blend request, per op, prefill subtracted.

Runs one warm blend request (6 x 512-token chunks) twice under the profiler: once answering with 1 token (the
prefill and the first token) and once with up to 1 + --steps tokens. The difference, divided by the steps the
answer took, is one decode step: each aten op's calls and self CPU time per step, the top ops
by time, and the step's total. The engine's own scheduler thread runs the steps, so all threads are recorded.

    python research/decode_profile.py                       # int8 decode weights, fp32, 64 steps
    python research/decode_profile.py --decode-weights native --steps 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import torch  # noqa: E402
from benchlib.cli import cpu_name  # noqa: E402
from benchlib.load_requests import QUESTIONS  # noqa: E402
from benchlib.timing import chunk_texts  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from cacheblend_rag import CacheBlendEngine, EngineConfig, ServingConfig  # noqa: E402


def profiled(engine: CacheBlendEngine, chunks: list[str], tokens: int) -> tuple[dict[str, list[float]], float, int]:
    """Per op name: [calls, self CPU us] over one request answering with up to `tokens` tokens; its wall s and
    the tokens it generated."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        result = engine.generate(chunks, QUESTIONS[0], max_new_tokens=tokens)
        wall = time.perf_counter() - t0
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in prof.key_averages():
        ops[event.key][0] += event.count
        ops[event.key][1] += event.self_cpu_time_total
    return ops, wall, len(result.token_ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--decode-weights", default="int8")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None, help="write the per-op table as JSON here")
    args = p.parse_args()
    base = CacheBlendEngine.from_pretrained(args.model, show_progress=False)
    config = EngineConfig(serving=ServingConfig(decode_weights=args.decode_weights))
    engine = CacheBlendEngine(base.model, base.tokenizer, config=config, store=base.store)
    chunks = chunk_texts(engine.tokenizer, 6, 512, None)
    engine.precompute(chunks, QUESTIONS[0])
    engine.generate(chunks, QUESTIONS[0], max_new_tokens=4)  # warm the path
    short, wall_short, _ = profiled(engine, chunks, 1)
    long, wall_long, tokens = profiled(engine, chunks, 1 + args.steps)
    args.steps = tokens - 1  # an answer that ends early at end of turn has fewer steps
    per_step = {}
    for name, (calls, us) in long.items():
        calls0, us0 = short.get(name, (0.0, 0.0))
        per_step[name] = ((calls - calls0) / args.steps, (us - us0) / args.steps / 1000.0)
    rows = sorted(((n, c, ms) for n, (c, ms) in per_step.items() if c > 0 or ms > 0.01), key=lambda r: -r[2])
    aten = {n: v for n, v in per_step.items() if n.startswith("aten::") or n.startswith("quantized::")}
    print(
        f"{cpu_name()}, {torch.get_num_threads()} threads, decode_weights={args.decode_weights}, "
        f"{engine.build_prompt(chunks, QUESTIONS[0]).num_tokens}-token prompt, {args.steps} steps"
    )
    print(
        f"wall per step (profiled): {(wall_long - wall_short) / args.steps * 1000:.1f} ms; "
        f"op calls per step (aten + quantized, nested included): {sum(c for c, _ in aten.values()):.0f}; "
        f"self CPU per step: {sum(ms for _, ms in per_step.values()):.1f} ms"
    )
    print(f"{'op':<48} {'calls/step':>10} {'self ms/step':>12}")
    for name, calls, ms in rows[: args.top]:
        print(f"{name[:48]:<48} {calls:>10.1f} {ms:>12.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(cpu=cpu_name(), steps=args.steps, per_step=per_step), indent=1))


if __name__ == "__main__":
    main()
