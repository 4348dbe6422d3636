"""Cold and warm requests against full prefill, side by side on the same prompts.

A cold request finds none (or only some) of its chunks stored. With the miss policy "blend" it prefills each
missing chunk on its own, stores it, then blends; with "full" it answers with a full prefill and stores the missing
chunks after the answer; "auto" (the default) picks per request from the compute model `cold_cost_share`. A warm
request finds every chunk stored. Every figure is the time from the call to the first token (chunk prefill
included), median over the prompts; each prompt has chunks no other prompt has.

    python benchmarks/cold.py                      # default model, fp32, 4 prompts of 6 x 512 tokens
    python benchmarks/cold.py --model smollm2-135m-instruct --prompts 2 --chunk-tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.engine.prefill.planning import cold_cost_share


def prompt_chunks(tokenizer, data_dir: Path, prompts: int, count: int, tokens: int) -> list[list[str]]:
    """`prompts` lists of `count` texts of `tokens` tokens, cut from MuSiQue passages, none repeated."""
    cases = json.loads((data_dir / "musique" / "musique_s.json").read_text())
    ids = tokenizer.encode(" ".join(c["text"] for case in cases for c in case["ctxs"]), add_special_tokens=False)
    need = prompts * count * tokens
    if len(ids) < need:
        raise SystemExit(f"not enough text: {len(ids)} tokens for {need}")
    pieces = [tokenizer.decode(ids[i * tokens : (i + 1) * tokens]) for i in range(prompts * count)]
    return [pieces[p * count : (p + 1) * count] for p in range(prompts)]


def ttft(engine: CacheBlendEngine, chunks: list[str], question: str, **options) -> tuple[float, object]:
    t = time.perf_counter()
    stream = engine.stream(chunks, question, max_new_tokens=1, **options)
    next(iter(stream), None)
    elapsed = time.perf_counter() - t
    for _ in stream:  # let a deferred chunk fill finish before the next timing
        pass
    return elapsed, stream.result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="preset, local folder or hub id (default: the default preset)")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts, each with its own chunks (default: 4)")
    parser.add_argument("--chunks", type=int, default=6, help="chunks per prompt (default: %(default)s)")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="tokens per chunk (default: %(default)s)")
    data_env = os.environ.get("CACHEBLEND_RAG_DATA")
    parser.add_argument("--data-dir", type=Path, default=data_env, required=not data_env,
                        help="folder with musique/ (default: $CACHEBLEND_RAG_DATA)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cold"), help="(default: %(default)s)")
    args = parser.parse_args()

    base = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig(dtype=args.dtype), show_progress=False)
    engines = {
        policy: CacheBlendEngine(base.model, base.tokenizer, config=EngineConfig(dtype=args.dtype, miss_policy=policy))
        for policy in ("blend", "full", "auto")
    }
    question = "Which of these passages mentions a year, and what happened then?"
    sets = prompt_chunks(base.tokenizer, args.data_dir, args.prompts, args.chunks, args.chunk_tokens)
    ttft(base, sets[0], question, mode="full")  # warm-up: allocator, threads

    rows: dict[str, list[float]] = {}
    predicted: dict[str, list[float]] = {}
    for chunks in sets:
        half = chunks[: len(chunks) // 2]
        prompt = base.build_prompt(chunks, question)
        layers = base.lm.shape.num_layers
        ids_half = [prompt.chunk_ids[i] for i in range(len(half), len(chunks))]
        predicted.setdefault("all missing", []).append(
            cold_cost_share(prompt, prompt.chunk_ids, base.config.blend, layers)
        )
        predicted.setdefault("half missing", []).append(cold_cost_share(prompt, ids_half, base.config.blend, layers))
        timings = {"full": ttft(base, chunks, question, mode="full")[0]}
        for policy, engine in engines.items():
            engine.clear_store()
            timings[f"cold, policy {policy}"] = ttft(engine, chunks, question)[0]
            engine.clear_store()
            engine.precompute(half, question)
            timings[f"half cold, policy {policy}"] = ttft(engine, chunks, question)[0]
        timings["warm blend"] = ttft(engines["blend"], chunks, question)[0]
        for name, seconds in timings.items():
            rows.setdefault(name, []).append(seconds)
        print(" ".join(f"{k}={v:.2f}s" for k, v in timings.items()), flush=True)

    full = statistics.median(rows["full"])
    lines = [
        f"model {base.config_name if hasattr(base, 'config_name') else args.model or 'default preset'}, {args.dtype}, "
        f"{args.prompts} prompts of {args.chunks} x {args.chunk_tokens} tokens",
        "",
        "| request | median TTFT (s) | full / this |",
        "|---|---|---|",
    ]
    for name, values in rows.items():
        med = statistics.median(values)
        lines.append(f"| {name} | {med:.2f} | {full / med:.2f} |")
    lines += [
        "",
        "compute model (cold_cost_share: token-layers of a cold blend over a full prefill; above 1, auto runs full):",
    ]
    for name, values in predicted.items():
        lines.append(f"- {name}: {statistics.median(values):.2f}")
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
