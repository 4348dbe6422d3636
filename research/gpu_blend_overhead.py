"""Where a blend's time goes on a GPU, and whether attending the selected queries in one masked call helps.

    python research/gpu_blend_overhead.py --model-shape 7b --lengths 512,1280 --out /tmp/overhead

Random weights of a real shape (the timing does not depend on the values). For each chunk length (6 chunks):
the prefill alone, synchronized, best of `--repeats` (full, reuse, blend r=0.15 with queries attended in
position blocks of 512, and in one masked call), then `generate` TTFT of full and blend (the scheduler in the
path), then cProfile's top functions of 16 decode steps. The block size is switched by wrapping the fusor the
prefiller calls: a research switch, not an engine option.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from benchlib.timing import build_engine, make_prompt, warm_up  # noqa: E402
from gpu_check import best_of, sync  # noqa: E402

import cacheblend_rag.engine.prefill.prefiller as prefill_module  # noqa: E402
from cacheblend_rag.engine.serving.batch_decode import BatchDecoder, DecodeCache  # noqa: E402
from cacheblend_rag.fusion import fuse  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model-shape", default="7b")
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--lengths", default="512,1280", help="chunk lengths in tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("/tmp/gpu-blend-overhead"))
    args = p.parse_args()
    args.random_weights = True
    engine = build_engine(args, args.dtype, memory_budget_bytes=40 << 30)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        args.chunk_tokens = length
        prompt = make_prompt(engine, args, args.chunks, length, None)
        warm_up(engine, prompt)
        row = {"chunk_tokens": length, "prompt_tokens": prompt.num_tokens}
        for name, mode, blocks in (
            ("full", "full", None),
            ("reuse", "reuse", None),
            ("blend blocks=512", "blend", 512),
            ("blend one call", "blend", 0),
        ):
            prefill_module.fuse = fuse if blocks is None else functools.partial(fuse, block_size=blocks)
            opts = {"recompute_ratio": 0.15} if mode == "blend" else {}
            engine.prefill(prompt, mode, **opts)  # warm this path
            run = functools.partial(engine.prefill, prompt, mode, **opts)
            row[f"prefill {name} ms"] = round(1000 * best_of(run, args.device, args.repeats), 1)
        prefill_module.fuse = fuse
        for mode, opts in (("full", {}), ("blend", {"recompute_ratio": 0.15})):
            ttft = [engine.generate(prompt, mode=mode, max_new_tokens=1, **opts).metrics.ttft_s for _ in range(3)]
            row[f"generate {mode} TTFT ms"] = round(1000 * statistics.median(ttft), 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    # decode steps on this thread (the scheduler runs them on its own, where cProfile does not see them)
    pre = engine.prefill(prompt, "blend")
    decoder = BatchDecoder(engine.lm)
    cache = DecodeCache(pre.cache, pre.num_tokens, pre.num_tokens + 64)
    for _ in range(4):
        decoder.step([5], [cache])
    step_s = best_of(lambda: decoder.step([5], [cache]), args.device, 16)
    caches = [DecodeCache(pre.cache, pre.num_tokens, pre.num_tokens + 64) for _ in range(8)]
    step8_s = best_of(lambda: decoder.step([5] * 8, caches), args.device, 8)
    print(f"decode step, best of 16: {1000 * step_s:.1f} ms for 1 request, {1000 * step8_s:.1f} ms for 8", flush=True)
    profiler = cProfile.Profile()
    sync(args.device)
    profiler.enable()
    for _ in range(16):
        decoder.step([5], [cache])
    sync(args.device)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(22)
    rows.append({"decode_step_ms": round(1000 * step_s, 2), "decode_step_8_ms": round(1000 * step8_s, 2)})
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    report = {"device": device, "torch": torch.__version__, "shape": args.model_shape, "rows": rows}
    (args.out / "gpu_blend_overhead.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
