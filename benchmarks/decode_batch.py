"""One decode step of B requests: attention per request over its own cache, against one call over the slot pool.

The two ways the engine has had to run a batched step, side by side on the same prefilled prompts:
- `per-request`: `BatchDecoder.step` over one `DecodeCache` per request (one attention call per request per layer);
- `slot pool`: `BatchDecoder.step_slots` over one `SlotPool` (one attention call per layer for the batch, each row
  masked to its length): what the scheduler runs.
The B prompts have distinct lengths around --tokens (request b has b * --spread more), so the pool pads to the
longest. For each B of --batches, the two are timed in alternation, --steps steps each, --repeats times; the table
gives the median step time and the ratio, and each step's logits are checked to agree (1e-3 in fp32).

    python benchmarks/decode_batch.py --batches 1,4,8,16 --tokens 3000 --out benchmarks/results/decode-batch
    python benchmarks/decode_batch.py --count-ops      # aten ops per layer of each step (tiny llama; deterministic)

`--count-ops` counts, on the tiny random 6-layer llama of `cacheblend_rag.testing`, the aten ops one step of each
kind issues per layer (a `TorchDispatchMode`; about one kernel launch each on a GPU) at batch sizes 1, 2, 8, 32.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from benchlib.cli import add_out_argument, cpu_name, model_name, write_results  # noqa: E402

from cacheblend_rag import CacheBlendEngine, EngineConfig  # noqa: E402
from cacheblend_rag.engine.serving.batch_decode import BatchDecoder, DecodeCache  # noqa: E402
from cacheblend_rag.engine.serving.slots import SlotPool  # noqa: E402


def prefilled(engine: CacheBlendEngine, n: int, seed: int, room: int):
    """A prompt of `n` random tokens prefilled in full: its own DecodeCache and its per-layer KV."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, engine.tokenizer.vocab_size - 100, (n,), generator=g)
    from transformers import DynamicCache

    cache = DynamicCache(config=engine.model.config)
    engine.prefiller.forward(ids, 0, cache)
    layers = [layer.keys[0] for layer in cache.layers], [layer.values[0] for layer in cache.layers]
    return DecodeCache(cache, n, n + room), layers


def timed(fn, steps: int) -> float:
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t) / steps


def run(args: argparse.Namespace) -> dict:
    engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig(dtype=args.dtype), show_progress=False)
    decoder = BatchDecoder(engine.lm)
    room = args.steps * (args.repeats + 1) * 2 + 8
    rows = []
    for batch in args.batches:
        lengths = [args.tokens + b * args.spread for b in range(batch)]
        own, layers = zip(*(prefilled(engine, n, b, room) for b, n in enumerate(lengths)), strict=True)
        pool = SlotPool(engine.lm.shape, engine.lm.dtype, engine.lm.device, batch, max(lengths) + room)
        slots = [pool.admit(*kv, n, room) for kv, n in zip(layers, lengths, strict=True)]
        tokens = [5] * batch
        check = (decoder.step(tokens, list(own)) - decoder.step_slots(tokens, pool, slots)).abs().max().item()
        times = {"per-request": [], "slot pool": []}
        for _ in range(args.repeats):
            times["per-request"].append(timed(lambda: decoder.step(tokens, list(own)), args.steps))  # noqa: B023
            times["slot pool"].append(timed(lambda: decoder.step_slots(tokens, pool, slots), args.steps))  # noqa: B023
        row = dict(batch=batch, max_logit_diff=check, **{k: statistics.median(v) for k, v in times.items()},
                   runs=times)  # fmt: skip
        row["ratio"] = row["per-request"] / row["slot pool"]
        rows.append(row)
        print(f"B={batch:3d}: per-request {1000 * row['per-request']:8.1f} ms  slot pool {1000 * row['slot pool']:8.1f}"
              f" ms  per-request / pool {row['ratio']:.2f}x  (logits within {check:.1e})", file=sys.stderr)  # fmt: skip
    engine.close()
    return dict(model=model_name(args.model), dtype=args.dtype, cpu=cpu_name(), threads=torch.get_num_threads(),
                tokens=args.tokens, spread=args.spread, steps=args.steps, repeats=args.repeats, rows=rows)  # fmt: skip


def markdown(report: dict) -> str:
    lines = [f"{report['model']}, {report['dtype']}, {report['cpu']}, {report['threads']} threads; prompts of "
             f"{report['tokens']} + b x {report['spread']} tokens; median of {report['repeats']} x {report['steps']} "
             "steps", "", "| requests | per-request attention (ms/step) | slot pool (ms/step) | ratio |",
             "|---:|---:|---:|---:|"]  # fmt: skip
    for r in report["rows"]:
        lines.append(f"| {r['batch']} | {1000 * r['per-request']:.1f} | {1000 * r['slot pool']:.1f} | "
                     f"{r['ratio']:.2f}x |")  # fmt: skip
    return "\n".join(lines)


def count_ops(batches: list[int]) -> list[dict]:
    """Aten ops per layer of one step of each kind, on the tiny llama (prompts of 20 + b tokens)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import DynamicCache

    from cacheblend_rag.models.adapter import LayerwiseModel
    from cacheblend_rag.testing import make_tiny_model

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    lm = LayerwiseModel(make_tiny_model("llama").eval())
    decoder, rows = BatchDecoder(lm), []
    for batch in batches:
        pool, own, slots = SlotPool(lm.shape, torch.float32, "cpu"), [], []
        for b in range(batch):
            cache = DynamicCache(config=lm.model.config)
            with torch.inference_mode():
                lm.model(input_ids=torch.arange(3, 23 + b)[None], cache=cache, use_cache=True)
            own.append(DecodeCache(cache, 20 + b, 30 + b))
            layers = [layer.keys[0] for layer in cache.layers], [layer.values[0] for layer in cache.layers]
            slots.append(pool.admit(*layers, 20 + b, 10))
        tokens = [1] * batch
        counted = {}
        for name, step in (("per-request", lambda: decoder.step(tokens, own)),  # noqa: B023
                           ("slot pool", lambda: decoder.step_slots(tokens, pool, slots))):  # noqa: B023  # fmt: skip
            step()  # warm
            with Count() as mode:
                step()
            counted[name] = mode.n / lm.shape.num_layers
        rows.append(dict(batch=batch, **counted))
        print(f"B={batch:3d}: per-request {counted['per-request']:.1f} ops/layer, slot pool "
              f"{counted['slot pool']:.1f}")  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", default="1,4,8,16", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--tokens", type=int, default=3000, help="the shortest prompt's tokens")
    p.add_argument("--spread", type=int, default=64, help="tokens more per request of a batch")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--count-ops", action="store_true", help="only count each step's ops on the tiny llama")
    add_out_argument(p, "decode-batch", "results.json and summary.md")
    args = p.parse_args(argv)
    if args.count_ops:
        count_ops([1, 2, 8, 32])
        return 0
    report = run(args)
    write_results(args.out, report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
