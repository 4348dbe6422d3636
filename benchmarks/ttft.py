"""Time to first token of each prefill mode, side by side in one run (the TTFT table of docs/benchmarks.md).

A request is a shared prefix, K chunks of about T tokens each, and a question; the chunks' KV is precomputed
(warm, in-memory store) before timing, as in the paper's steady state. TTFT is measured from the call with the
built prompt to the first generated token (cache loads included); medians over repeats.

    python benchmarks/ttft.py                       # default model, fp32 and bf16, 6 x 512 tokens
    python benchmarks/ttft.py --model smollm2-135m-instruct --dtypes float32 --repeats 2 --out /tmp/ttft
    python benchmarks/ttft.py --random-weights --model-shape 7b --device cuda   # GPU timing, no weights needed

Writes OUT/ttft.json (default benchmarks/results/ttft/).

Chunk text comes from MuSiQue passages when `--data-dir` (default: $CACHEBLEND_RAG_DATA) holds them, else from a
fixed pseudo-random word list; the timing does not depend on the words.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from benchlib.cli import add_out_argument  # noqa: E402
from benchlib.timing import (  # noqa: E402
    RANDOM_SHAPES,
    add_data_dir_argument,
    build_engine,
    make_prompt,
    measure,
    model_label,
    timed_runs,
    warm_up,
)

from cacheblend_rag.config import RULE_NAMES, blend_rule  # noqa: E402
from cacheblend_rag.errors import ConfigError  # noqa: E402


def run(args) -> dict:
    data_dir = Path(args.data_dir) if args.data_dir else None
    report: dict = {
        "model": model_label(args),
        "device": args.device,
        "chunks": args.chunks,
        "chunk_tokens": args.chunk_tokens,
        "results": {},
    }
    for dtype in args.dtypes:
        t = time.perf_counter()
        engine = build_engine(args, dtype)
        print(
            f"\n== {report['model']} {dtype} on {args.device} (loaded in {time.perf_counter() - t:.1f}s, "
            f"{torch.get_num_threads()} CPU threads)",
            flush=True,
        )
        prompt = make_prompt(engine, args, args.chunks, args.chunk_tokens, data_dir)
        warm_up(engine, prompt)
        measured = measure(engine, prompt, timed_runs(args.ratios, args.rules), args.repeats)
        rows = {}
        for name, ms in measured.items():
            rows[name] = statistics.median(m.ttft_s for m in ms)
            print(f"  {name:<12} TTFT {rows[name] * 1000:8.0f} ms   ({ms[-1].summary()})", flush=True)
        print(
            f"  prompt: {prompt.num_tokens} tokens ({len(prompt.chunk_ids)} chunks of "
            f"{[len(c) for c in prompt.chunk_ids]} tokens), medians of {args.repeats} interleaved runs"
        )
        default_rule = engine.config.blend.rule
        for r in args.ratios:
            print(f"  ratio full / blend(r={r:.2f}) = {rows['full'] / rows[f'blend r={r:.2f}']:.2f}   [{default_rule}]")
        for rule in args.rules:
            for r in args.ratios:
                print(f"  ratio full / {rule}(r={r:.2f}) = {rows['full'] / rows[f'{rule} r={r:.2f}']:.2f}")
        report["results"][dtype] = {k: round(v, 5) for k, v in rows.items()}
        report["results"][dtype]["prompt_tokens"] = prompt.num_tokens
        del engine
    return report


def rule_name(text: str) -> str:
    """A --rules item, checked as `blend_rule` reads it."""
    try:
        blend_rule(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="preset name or local checkpoint (default: the default preset)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.15, 0.30])
    p.add_argument("--rules", nargs="*", default=["paper"], type=rule_name,
                   help=f"named selection rules to time at each ratio too, beside the engine's default rule "
                   f"(default: paper): {', '.join(RULE_NAMES)}, or attention:D (a first pass over the share D of "
                   "the layers)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3)
    add_data_dir_argument(p)
    p.add_argument("--random-weights", action="store_true", help="random weights of --model-shape (GPU timing)")
    p.add_argument("--model-shape", default="7b", choices=sorted(RANDOM_SHAPES))
    add_out_argument(p, "ttft", "folder for ttft.json")
    args = p.parse_args(argv)
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ttft.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out / 'ttft.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
