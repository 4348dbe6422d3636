"""The GPU evidence in one short run: prefill TTFT per mode at several prompt lengths, and decode steps, on random
weights of a real shape.

    python benchmarks/gpu_check.py --model-shape 7b --dtype bfloat16 --out /tmp/gpu

For each chunk length in `--lengths` (`--chunks` chunks, stored): each mode's prefill alone (synchronized, on this
thread, best of `--repeats`) and its TTFT through `generate` (the scheduler's thread, median of `--repeats`): full,
reuse, blend at each ratio, and the blends of `--rules` (default `paper`, which needs no first pass) at the same
ratios; and reuse, blend and `paper` at r = 0.15 again on an engine with `prefill_graphs=True` (each layer's
row-wise work replayed as CUDA graphs; on a CPU the padded rows run eagerly, a smoke run). Then decode steps
after the longest prompt: one request, and a batch of `--batch` requests whose caches all have different lengths
(as under load), best of 16 steps; and the decode rate of one `--new-tokens` answer through `generate`. Beside
them: reuse and blend with pipelined loading on and off (load, wait and compute time of `generate`), and a full
prefill kept off cuDNN attention. `--profile` adds torch.profiler's top ops and cProfile's
top Python functions of one full and one blend prefill. Writes OUT/gpu_check.json, and with `--latest` the headline
figures (first after the prefills, then again at the end). The timing does not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from benchlib.cli import add_out_argument
from benchlib.floor import DeviceRates, Shape, measure_rates, prefill_bytes, prefill_flops
from benchlib.timing import RANDOM_SHAPES, build_engine, make_prompt, warm_up

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.config import StoreConfig, blend_rule
from cacheblend_rag.engine.serving.batch_decode import BatchDecoder, DecodeCache
from cacheblend_rag.engine.serving.graphs import GraphedSteps
from cacheblend_rag.engine.serving.slots import SlotPool
from cacheblend_rag.fusion import GraphedLayerSteps, budget
from cacheblend_rag.models.attention import attention_kernels


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best_of(fn, device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return min(times)


def profile(engine, prompt, args) -> None:
    """torch.profiler's top ops (self CPU and device time) and cProfile's top Python functions by own time, of one
    full and one blend r=0.15 prefill on this thread."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    for name, opts in (("full", {}), ("blend", {"recompute_ratio": 0.15})):
        sync(args.device)
        with torch_profile(activities=activities) as prof:
            engine.prefill(prompt, name, **opts)
            sync(args.device)
        events = prof.key_averages()
        print(f"-- profile {name}: top by self CPU time")
        print(events.table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=40))
        if args.device.startswith("cuda"):
            print(f"-- profile {name}: top by device time")
            print(events.table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=40))
        py = cProfile.Profile()
        sync(args.device)
        py.enable()
        engine.prefill(prompt, name, **opts)
        sync(args.device)
        py.disable()
        print(f"-- cProfile {name}: top by own time")
        pstats.Stats(py).sort_stats("tottime").print_stats(18)


GRAPHED_MODES = ("reuse", "blend r=0.15", "paper r=0.15")  # timed again with the prefill's layers as CUDA graphs


def ttft_rows(engine, prompt, args, only: tuple[str, ...] | None = None) -> dict[str, dict[str, float]]:
    """{mode: {"prefill_ms", "generate_ttft_ms"}} for one prompt, chunk KV warm (`only`: these modes)."""
    runs = [("full", "full", {}), ("reuse", "reuse", {})]
    runs += [(f"blend r={r:.2f}", "blend", {"recompute_ratio": r}) for r in args.ratios]
    # other rules: no first pass over the question's attention, every token recomputed up to the check layers
    runs += [(f"{rule} r={r:.2f}", "blend", {"blend": blend_rule(rule, r)}) for rule in args.rules for r in args.ratios]
    runs = [run for run in runs if only is None or run[0] in only]
    rows, repeats = {}, args.repeats
    for name, mode, opts in runs:
        alone = best_of(lambda mode=mode, opts=opts: engine.prefill(prompt, mode, **opts), args.device, args.repeats)
        ttft = [engine.generate(prompt, mode=mode, max_new_tokens=1, **opts).metrics.ttft_s for _ in range(repeats)]
        rows[name] = {"prefill_ms": round(1000 * alone, 1),
                      "generate_ttft_ms": round(1000 * statistics.median(ttft), 1)}  # fmt: skip
    return rows


def floor_rows(engine, prompt, rows: dict[str, dict[str, float]], rates: DeviceRates) -> None:
    """Beside each mode's measured prefill: its FLOPs, the fewest bytes it must move, the floor time at the device's
    measured rates (`benchlib.floor`) and measured / floor."""
    shape = Shape.of(engine.model.config, engine.lm.dtype)
    n, q = prompt.num_tokens, len(prompt.suffix_ids)
    chunk_tokens = sum(e - s for s, e in prompt.chunk_spans)
    stored = n - q
    for name, row in rows.items():
        if name == "full":
            flops, nbytes = prefill_flops(shape, n, n), prefill_bytes(shape, n, 0)
        elif name == "reuse":
            flops, nbytes = prefill_flops(shape, n, q), prefill_bytes(shape, n, stored)
        else:
            rule, ratio = name.split(" r=")[0], float(name.split(" r=")[1])
            picks = budget(chunk_tokens, ratio)
            cfg = engine.config.blend if rule == "blend" else blend_rule(rule, ratio)
            if cfg.uses_attention_pass:  # a question-only pass (over the first layers when shallow), then the blend
                depth = cfg.probe_layers(shape.layers) / shape.layers
                flops = prefill_flops(shape, n, q, picks, probe=q, probe_share=depth)
                nbytes = prefill_bytes(shape, n, stored, passes=1 + depth)
            else:  # a check-layer rule: every chunk token up to its first check layer
                first = cfg.check_layers[0] + 1
                extra = chunk_tokens * first // shape.layers
                flops, nbytes = prefill_flops(shape, n, q, picks + extra), prefill_bytes(shape, n, stored)
        floor = rates.floor_ms(flops, nbytes)
        row.update(tflop=float(f"{flops / 1e12:.4g}"), min_gb=float(f"{nbytes / 1e9:.4g}"),
                   floor_ms=float(f"{floor:.4g}"), over_floor=round(row["prefill_ms"] / floor, 2))  # fmt: skip


def graphed_rows(graphed, prompt, args, full_ms: float) -> dict[str, dict[str, float]] | dict[str, str]:
    """`GRAPHED_MODES` on the engine with prefill graphs (the first runs capture them), printed beside the full
    prefill; a failure is printed and recorded, and the rest of the check goes on."""
    t = time.perf_counter()
    try:
        warm_up(graphed, prompt)
        captured_s = time.perf_counter() - t
        rows = ttft_rows(graphed, prompt, args, only=GRAPHED_MODES)
    except Exception as exc:  # noqa: BLE001 - the evidence of the other steps must survive a failed capture
        print(f"  {prompt.num_tokens:>6} tokens  prefill graphs FAILED: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}
    for name, row in rows.items():
        print(
            f"  {prompt.num_tokens:>6} tokens  {name + ', graphed':<22} prefill {row['prefill_ms']:8.1f} ms  "
            f"(full/this {full_ms / row['prefill_ms']:5.2f}x)  generate TTFT {row['generate_ttft_ms']:8.1f} ms"
        )
    print(f"  {prompt.num_tokens:>6} tokens  warm-up with graph capture {captured_s:.1f} s, buckets "
          f"{graphed.prefiller.steps.bucket_sizes}")  # fmt: skip
    rows["warm_up_s"] = round(captured_s, 1)
    return rows


def pipeline_rows(engine, prompt, args) -> dict[str, dict[str, float]]:
    """The same prefills on a second engine over the same model without pipelined loading (chunk KV loaded on the
    calling thread, no prefetch thread: `prefiller.pipelined = False`), a full prefill kept off cuDNN attention like
    the fusor, and each mode's `generate` metrics split into load, wait and compute time (median of `--repeats`)."""
    inline = CacheBlendEngine(engine.model, engine.tokenizer, config=engine.config)
    inline.prefiller.pipelined = False
    warm_up(inline, prompt)
    rows = {}
    for name, mode, opts in [("reuse", "reuse", {}), ("blend r=0.15", "blend", {"recompute_ratio": 0.15})]:
        for label, eng in (("pipelined", engine), ("inline", inline)):
            alone = best_of(lambda eng=eng, mode=mode, opts=opts: eng.prefill(prompt, mode, **opts), args.device,
                            args.repeats)  # fmt: skip
            ms = [eng.generate(prompt, mode=mode, max_new_tokens=1, **opts).metrics for _ in range(args.repeats)]
            rows[f"{name}, {label}"] = {
                "prefill_ms": round(1000 * alone, 1),
                **{f"generate_{k}_ms": round(1000 * statistics.median(getattr(m, f"{k}_s") for m in ms), 1)
                   for k in ("ttft", "load", "wait", "compute")},
            }  # fmt: skip
    with attention_kernels(torch.device(args.device)):
        alone = best_of(lambda: engine.prefill(prompt, "full"), args.device, args.repeats)
    rows["full, no cuDNN attention"] = {"prefill_ms": round(1000 * alone, 1)}
    inline.clear_store()  # its chunk KV: memory the next steps need
    return rows


def decode_steps(engine, prompt, args) -> dict[str, float]:
    """Best-of-16 decode step times after `prompt`: one request, and `--batch` requests of distinct cache lengths,
    each over its own cache (attention per request) and over one slot pool (attention batched: what the engine's
    scheduler runs)."""
    pre = engine.prefill(prompt, "blend")
    decoder = BatchDecoder(engine.lm)
    room = pre.num_tokens + args.batch + 100  # the steps timed below write into it
    one = DecodeCache(pre.cache, pre.num_tokens, room)
    caches = [DecodeCache(pre.cache, pre.num_tokens, room) for _ in range(args.batch)]
    layers = [layer.keys[0] for layer in pre.cache.layers], [layer.values[0] for layer in pre.cache.layers]
    pool = SlotPool(engine.lm.shape, engine.lm.dtype, engine.lm.device, args.batch + 2, room)  # + scratch
    alone = pool.admit(*layers, pre.num_tokens, room - pre.num_tokens)
    slots = [pool.admit(*layers, pre.num_tokens, room - pre.num_tokens) for _ in range(args.batch)]
    for b, cache in enumerate(caches):  # cache b is b tokens longer: every request of the batch has its own length
        for _ in range(b):
            decoder.step([5], [cache])
            decoder.step_slots([5], pool, [slots[b]])
    for _ in range(3):
        decoder.step([5], [one])
        decoder.step_slots([5], pool, [alone])
    one_s = best_of(lambda: decoder.step([5], [one]), args.device, 16)
    batch_s = best_of(lambda: decoder.step([5] * len(caches), caches), args.device, 16)
    slot_one_s = best_of(lambda: decoder.step_slots([5], pool, [alone]), args.device, 16)
    slot_batch_s = best_of(lambda: decoder.step_slots([5] * len(slots), pool, slots), args.device, 16)
    steps = {"one_request_ms": round(1000 * one_s, 2), f"{args.batch}_requests_ms": round(1000 * batch_s, 2),
             "slots_one_request_ms": round(1000 * slot_one_s, 2),
             f"slots_{args.batch}_requests_ms": round(1000 * slot_batch_s, 2)}  # fmt: skip
    if torch.device(args.device).type == "cuda":  # the same steps replayed as CUDA graphs (captured on first use)
        graphed = GraphedSteps(engine.lm)
        for _ in range(2):
            graphed.step([5], pool, [alone]), graphed.step([5] * len(slots), pool, slots)
        steps["graphed_one_request_ms"] = round(1000 * best_of(lambda: graphed.step([5], pool, [alone]),
                                                               args.device, 16), 2)  # fmt: skip
        steps[f"graphed_{args.batch}_requests_ms"] = round(
            1000 * best_of(lambda: graphed.step([5] * len(slots), pool, slots), args.device, 16), 2
        )
    return steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model-shape", default="7b", choices=sorted(RANDOM_SHAPES))
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--lengths", default="512,1280", help="chunk lengths in tokens, comma-separated")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.15])
    p.add_argument("--rules", nargs="*", default=["paper", "attention:0.25"],
                   help="rules timed beside the default (attention): by default `paper` (one pass) and the default "
                   "rule with its first pass over a quarter of the layers")  # fmt: skip
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="requests of the batched decode step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--memory-gb", type=float, default=40.0, help="in-process chunk KV budget (all chunks must fit)")
    p.add_argument("--profile", action="store_true", help="print the top ops of one full and one blend prefill")
    add_out_argument(p, "gpu_check", "folder for gpu_check.json")
    p.add_argument("--latest", type=Path, default=None, help="also write the headline figures here (latest.json)")
    p.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"), help="the commit measured (env COMMIT)")
    args = p.parse_args(argv)
    args.random_weights = True
    engine = build_engine(args, args.dtype, store=StoreConfig(memory_budget_bytes=int(args.memory_gb * 1024**3)))
    report = {"device": device_name(args.device), "torch": torch.__version__, "shape": args.model_shape,
              "dtype": args.dtype, "lengths": {}}  # fmt: skip
    print(f"== {args.model_shape} random weights, {args.dtype} on {report['device']}; prefill alone: best of "
          f"{args.repeats}, synchronized; generate TTFT: median of {args.repeats}")  # fmt: skip
    rates = measure_rates(args.device, engine.lm.dtype)
    report["rates"] = {"tflop_per_s": round(rates.flops_per_s / 1e12, 2),
                       "copy_gb_per_s": round(rates.bytes_per_s / 1e9)}  # fmt: skip
    print(f"  measured: matmul {report['rates']['tflop_per_s']} TFLOP/s, copy {report['rates']['copy_gb_per_s']} GB/s")
    prompt = None
    # the same model with each prefill layer's row-wise work replayed as CUDA graphs (`EngineConfig.prefill_graphs`)
    # (on a CPU, a smoke run: the same rows padded to their buckets, run eagerly)
    on_cuda = args.device.startswith("cuda")
    graphed = CacheBlendEngine(engine.model, engine.tokenizer, config=replace(engine.config, prefill_graphs=on_cuda))
    if not on_cuda:
        graphed.prefiller.steps = GraphedLayerSteps(graphed.lm, capture=False)
    report["graphed"] = {}
    for length in (int(x) for x in args.lengths.split(",")):
        prompt = make_prompt(engine, args, args.chunks, length, None)
        warm_up(engine, prompt)
        rows = ttft_rows(engine, prompt, args)
        floor_rows(engine, prompt, rows, rates)
        report["lengths"][prompt.num_tokens] = rows
        full = rows["full"]["prefill_ms"]
        for name, row in rows.items():
            speedup = full / row["prefill_ms"]
            print(f"  {prompt.num_tokens:>6} tokens  {name:<12} prefill {row['prefill_ms']:8.1f} ms  "
                  f"(full/this {speedup:5.2f}x)  generate TTFT {row['generate_ttft_ms']:8.1f} ms  "
                  f"floor {row['floor_ms']:7.2f} ms ({row['tflop']} TFLOP, {row['min_gb']} GB)  "
                  f"measured/floor {row['over_floor']:5.1f}")  # fmt: skip
        report["graphed"][prompt.num_tokens] = graphed_rows(graphed, prompt, args, full)
    graphed.clear_store()  # its chunk KV: memory the next steps need
    if args.latest is not None:  # the prefill figures now, in case a later step runs past the check's time limit
        write_latest(args.latest, report, args.commit)
    assert prompt is not None
    report["pipeline"] = pipeline_rows(engine, prompt, args)
    for name, row in report["pipeline"].items():
        print(f"  {prompt.num_tokens:>6} tokens  {name:<26} " + "  ".join(f"{k} {v}" for k, v in row.items()))
    if args.profile:
        profile(engine, prompt, args)
    report["decode_step"] = decode_steps(engine, prompt, args)
    print(f"  decode step after {prompt.num_tokens} tokens: {report['decode_step']}")
    out = engine.generate(prompt, mode="blend", max_new_tokens=args.new_tokens, stop=())
    m = out.metrics
    per_s = (m.generated_tokens - 1) / m.decode_s if m.decode_s > 0 and m.generated_tokens > 1 else float("nan")
    print(f"  generate: {m.generated_tokens} tokens, {m.decode_s:.3f}s after the first ({per_s:.1f} tok/s)")
    report["generate_decode_tok_per_s"] = round(per_s, 2)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    if args.latest is not None:
        write_latest(args.latest, report, args.commit)
    return 0


def write_latest(path, report: dict, commit: str) -> None:
    """The headline figures (`benchmarks/results/gpu-h200/latest.json`): prefill ms per mode and prompt length,
    the floor of each, and decode tokens/s by concurrent clients (1 here; the load run adds 8 and 32)."""
    lengths = report["lengths"]

    def by_length(mode: str, key: str = "prefill_ms") -> dict[str, float]:
        return {str(n): rows[mode][key] for n, rows in lengths.items() if mode in rows}

    latest = {
        "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": report["device"],
        "shape": report["shape"], "dtype": report["dtype"], "rates": report["rates"],
        "full_ms": by_length("full"), "reuse_ms": by_length("reuse"), "blend_ms": by_length("blend r=0.15"),
        "paper_ms": by_length("paper r=0.15"), "shallow_probe_ms": by_length("attention:0.25 r=0.15"),
        "blend_generate_ttft_ms": by_length("blend r=0.15", "generate_ttft_ms"),
        "floor_ms": {mode: by_length(mode, "floor_ms") for mode in ("full", "reuse", "blend r=0.15")},
        "decode_step_ms": report.get("decode_step"),
        "decode_tps": {"1": report["generate_decode_tok_per_s"]} if "generate_decode_tok_per_s" in report else {},
    }  # fmt: skip
    graphed = report.get("graphed", {})  # prefill with prefill_graphs=True: mode -> prompt tokens -> ms
    if graphed:
        latest["graphed_prefill_ms"] = {
            mode: {str(n): rows[mode]["prefill_ms"] for n, rows in graphed.items() if mode in rows}
            for mode in GRAPHED_MODES
        }
        latest["graphed_errors"] = {str(n): rows["error"] for n, rows in graphed.items() if "error" in rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(latest, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
