"""What one request costs the host before and around the model: tokenizing, planning, assembling the prompt's KV.

On a GPU these costs add to the time to first token one for one: the host tokenizes the chunks, works out which
entry each reads, lays their KV into the prompt's buffer and issues the kernels, and a warm blend at 7.7k tokens
is meant to take 30-40 ms there. They can be measured on a CPU with a model whose arithmetic costs nothing: a
random-weight Qwen2 model of the default model's vocabulary and layer count but a tiny width, with the default
model's own tokenizer, chunks of real text (6 and 15 chunks of 512 tokens), every chunk stored (warm).

Per prompt and mode (full KV reuse, the default blend, `paper`) it reports, median over --repeats alternated runs:
- `generate` from the chunks' text with the engine's token cache (a chunk seen before is not tokenized again) and
  with the cache emptied before every call (every chunk tokenized, as before the cache);
- `generate` from a prebuilt prompt, and the prefill alone: what is left is the serving around the prefill;
- the pieces: tokenizing the chunks, the near-copy check of the placement, the transformers cache over the prompt's
  buffers (which the engine no longer builds for its own decoding).

    python benchmarks/host_costs.py                         # the default model's tokenizer, 24 layers
    python benchmarks/host_costs.py --modes reuse --layers 32 --repeats 15 --out /tmp/host-costs
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from benchlib.cli import add_out_argument, cpu_name, model_name, write_results  # noqa: E402
from benchlib.timing import add_data_dir_argument, chunk_texts  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from cacheblend_rag import BlendConfig, CacheBlendEngine, EngineConfig  # noqa: E402
from cacheblend_rag.engine.chunks.context import copies_before  # noqa: E402
from cacheblend_rag.engine.prefill.state import decode_cache  # noqa: E402
from cacheblend_rag.engine.request.prompt import tokenize_chunks  # noqa: E402
from cacheblend_rag.models import default_model, load_model  # noqa: E402

MODES = {"reuse": dict(mode="reuse"), "blend": {}, "paper": dict(blend=BlendConfig(rule="paper", recompute_ratio=0.15))}
QUESTION = "Which of the passages above names a date, and what happened then?"


def thin_model(vocab_size: int, layers: int, max_positions: int) -> torch.nn.Module:
    """A random Qwen2 model of the given vocabulary and depth, 64 wide: its arithmetic costs next to nothing."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         tie_word_embeddings=True)  # fmt: skip
    config._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(config).eval()


def ms(fn, *args, calls: int = 1, **kwargs) -> float:
    """Milliseconds per call of `fn(*args, **kwargs)`, over `calls` calls."""
    t = time.perf_counter()
    for _ in range(calls):
        fn(*args, **kwargs)
    return (time.perf_counter() - t) / calls * 1e3


def pieces(engine: CacheBlendEngine, chunks: list[str], repeats: int) -> dict[str, float]:
    """The host's pieces of one request over `chunks`, median of `repeats` (ms)."""
    prompt = engine.build_prompt(chunks, QUESTION)
    pre = engine.prefill(prompt, "blend")
    sep, tokenizer = engine.config.chunk_separator, engine.tokenizer
    return dict(
        prompt_tokens=prompt.num_tokens,
        tokenize_ms=statistics.median(ms(tokenize_chunks, tokenizer, chunks, sep) for _ in range(repeats)),
        build_prompt_cached_ms=statistics.median(ms(engine.build_prompt, chunks, QUESTION) for _ in range(repeats)),
        near_copies_ms=statistics.median(ms(copies_before, prompt.chunk_ids, calls=5) for _ in range(repeats)),
        transformers_cache_ms=statistics.median(ms(decode_cache, engine.model.config, pre.kv) for _ in range(repeats)),
    )


def requests(engine: CacheBlendEngine, chunks: list[str], mode: str, repeats: int) -> dict[str, float]:
    """A warm request over `chunks` in `mode`, four ways, alternated so that the machine's drift falls on each alike;
    median of `repeats` (ms)."""
    options = MODES[mode]
    prompt = engine.build_prompt(chunks, QUESTION)
    prefill_options = {k: v for k, v in options.items() if k != "mode"}
    for _ in range(2):  # warm
        engine.generate(chunks, QUESTION, max_new_tokens=1, **options)
    runs: dict[str, list[float]] = {"text": [], "text_uncached": [], "prompt": [], "prefill": []}
    for _ in range(repeats):
        runs["text"].append(ms(engine.generate, chunks, QUESTION, max_new_tokens=1, **options))
        engine.token_cache.clear()
        runs["text_uncached"].append(ms(engine.generate, chunks, QUESTION, max_new_tokens=1, **options))
        runs["prompt"].append(ms(engine.generate, prompt, max_new_tokens=1, **options))
        runs["prefill"].append(ms(engine.prefill, prompt, options.get("mode", "blend"), **prefill_options))
    return {f"{k}_ms": statistics.median(v) for k, v in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="whose tokenizer and vocabulary (default: the default model)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--chunks", type=int, nargs="+", default=[6, 15])
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--modes", default="reuse,blend,paper", help=f"comma-separated, of {', '.join(MODES)}")
    add_out_argument(p, "host-costs", "where results.json and summary.md go")
    add_data_dir_argument(p)
    args = p.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in MODES]:
        raise SystemExit(f"unknown --modes {unknown}: choose among {', '.join(MODES)}")
    torch.set_num_threads(1)  # host work is one thread; the thin model's few FLOPs gain nothing from a second
    _, tokenizer = load_model(args.model or default_model(), show_progress=False)
    pool = chunk_texts(tokenizer, max(args.chunks), args.chunk_tokens, Path(args.data_dir) if args.data_dir else None)
    model = thin_model(len(tokenizer), args.layers, 32768)
    engine = CacheBlendEngine(model, tokenizer, config=EngineConfig(dtype="float32"))
    engine.precompute(pool, QUESTION, context=None)
    results = dict(model=model_name(args.model), cpu=cpu_name(), layers=args.layers, repeats=args.repeats, rows=[])
    for count in args.chunks:
        chunks = pool[:count]
        parts = pieces(engine, chunks, args.repeats)
        print(count, "chunks", {k: round(v, 2) for k, v in parts.items()}, flush=True)
        for mode in modes:
            row = dict(chunks=count, mode=mode, **parts, **requests(engine, chunks, mode, args.repeats))
            results["rows"].append(row)
            print(mode, {k: round(v, 2) for k, v in row.items() if k.endswith("_ms")}, flush=True)
    engine.close()
    lines = [f"Tokenizer and vocabulary of {results['model']}, a random model {args.layers} layers deep and 64 wide, "
             f"{results['cpu']}, one thread; median of {args.repeats} alternated runs (ms).", "",
             "| prompt | mode | `generate`, text, token cache | text, no cache | prebuilt prompt | prefill alone | "
             "tokenize the chunks | near copies | transformers cache |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results["rows"]:
        lines.append(f"| {r['chunks']} x {args.chunk_tokens} ({r['prompt_tokens']} tokens) | {r['mode']} | "
                     f"{r['text_ms']:.1f} | {r['text_uncached_ms']:.1f} | {r['prompt_ms']:.1f} | "
                     f"{r['prefill_ms']:.1f} | {r['tokenize_ms']:.1f} | {r['near_copies_ms']:.2f} | "
                     f"{r['transformers_cache_ms']:.2f} |")  # fmt: skip
    write_results(Path(args.out), results, "\n".join(lines))


if __name__ == "__main__":
    main()
