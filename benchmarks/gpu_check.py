"""The GPU evidence in one short run: decode speed and prefill TTFT of a random-weight model of a real shape.

    python benchmarks/gpu_check.py --model-shape 7b --dtype bfloat16 --out /tmp/gpu

Prints, for one warm request (K chunks of T tokens, stored): TTFT of full / reuse / blend at each ratio, and
decode tokens/s of a `--new-tokens` answer after the blend's prefill (greedy, eos never stops it: the random
model's answer is not read). Writes OUT/gpu_check.json. The timing does not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from benchlib.cli import add_out_argument
from benchlib.timing import RANDOM_SHAPES, build_engine, make_prompt, warm_up


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def profile(engine, prompt, args) -> None:
    """Where one prefill's time goes, for full and blend r=0.15: the prefill timed alone (synchronized, on this
    thread, so the scheduler is not in it), torch.profiler's top ops (self CPU and device time) and cProfile's top
    Python functions by own time."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    for mode, opts in (("full", {}), ("blend r=0.15", {"recompute_ratio": 0.15})):
        name = mode.split()[0]
        times = []
        for _ in range(3):
            sync(args.device)
            t = time.perf_counter()
            engine.prefill(prompt, name, **opts)
            sync(args.device)
            times.append(time.perf_counter() - t)
        print(f"-- prefill {mode} alone: {min(times) * 1000:.1f} ms (best of 3)")
        sync(args.device)
        with torch_profile(activities=activities) as prof:
            engine.prefill(prompt, name, **opts)
            sync(args.device)
        events = prof.key_averages()
        print(f"-- profile {mode}: top by self CPU time")
        print(events.table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=40))
        if args.device.startswith("cuda"):
            print(f"-- profile {mode}: top by device time")
            print(events.table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=40))
        py = cProfile.Profile()
        sync(args.device)
        py.enable()
        engine.prefill(prompt, name, **opts)
        sync(args.device)
        py.disable()
        print(f"-- cProfile {mode}: top by own time")
        pstats.Stats(py).sort_stats("tottime").print_stats(18)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model-shape", default="7b", choices=sorted(RANDOM_SHAPES))
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.15, 0.30])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--memory-gb", type=float, default=16.0, help="in-process chunk KV budget (all chunks must fit)")
    p.add_argument("--profile", action="store_true", help="print torch.profiler's top ops of one full and one blend")
    add_out_argument(p, "gpu_check", "folder for gpu_check.json")
    args = p.parse_args(argv)
    args.random_weights = True
    engine = build_engine(args, args.dtype, memory_budget_bytes=int(args.memory_gb * 1024**3))
    prompt = make_prompt(engine, args, args.chunks, args.chunk_tokens, None)
    warm_up(engine, prompt)
    runs = [("full", {"mode": "full"}), ("reuse", {"mode": "reuse"})]
    runs += [(f"blend r={r:.2f}", {"mode": "blend", "recompute_ratio": r}) for r in args.ratios]
    ttft: dict[str, list[float]] = {name: [] for name, _ in runs}
    for _ in range(args.repeats):
        for name, opts in runs:
            sync(args.device)
            out = engine.generate(prompt, max_new_tokens=1, **opts)
            sync(args.device)
            ttft[name].append(out.metrics.ttft_s)
    rows = {name: statistics.median(v) for name, v in ttft.items()}
    print(f"== {args.model_shape} random weights, {args.dtype} on {device_name(args.device)}; "
          f"prompt {prompt.num_tokens} tokens; medians of {args.repeats}")  # fmt: skip
    for name, s in rows.items():
        print(f"  {name:<12} TTFT {s * 1000:8.1f} ms   full/this = {rows['full'] / s:5.2f}x")
    if args.profile:
        profile(engine, prompt, args)
    decode = []
    for _ in range(3):
        sync(args.device)
        t = time.perf_counter()
        out = engine.generate(prompt, mode="blend", max_new_tokens=args.new_tokens, stop=())
        sync(args.device)
        m = out.metrics
        decode.append((m.generated_tokens, m.decode_s, time.perf_counter() - t))
    tok, dec_s, wall = min(decode, key=lambda d: d[1])
    per_s = (tok - 1) / dec_s if dec_s > 0 and tok > 1 else float("nan")
    print(f"  decode: {tok} tokens, {dec_s:.3f}s after the first ({per_s:.1f} tok/s), request wall {wall:.3f}s")
    report = {
        "device": device_name(args.device),
        "torch": torch.__version__,
        "shape": args.model_shape,
        "dtype": args.dtype,
        "prompt_tokens": prompt.num_tokens,
        "ttft_s": {k: round(v, 5) for k, v in rows.items()},
        "decode_tokens": tok,
        "decode_s": round(dec_s, 5),
        "decode_tok_per_s": round(per_s, 2),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
