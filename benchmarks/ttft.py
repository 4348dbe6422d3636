"""Time to first token of each prefill mode, side by side in one run (the TTFT table of docs/benchmarks.md).

A request is a shared prefix, K chunks of about T tokens each, and a question; the chunks' KV is precomputed
(warm, in-memory store) before timing, as in the paper's steady state. TTFT is measured from the call with the
built prompt to the first generated token (cache loads included); medians over repeats.

    python benchmarks/ttft.py                       # default model, fp32 and bf16, 6 x 512 tokens
    python benchmarks/ttft.py --model smollm2-135m-instruct --dtypes float32 --repeats 2
    python benchmarks/ttft.py --random-weights --model-shape 7b --device cuda   # GPU timing, no weights needed

Chunk text comes from MuSiQue passages when `--data-dir` (default ../shared/data) holds them, else from a
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

import torch

from cacheblend_rag import CacheBlendEngine, EngineConfig, TokenizedPrompt
from cacheblend_rag.config import RULE_NAMES, blend_rule, rule_name

MODES = ("full", "prefix", "reuse")


def chunk_texts(tokenizer, count: int, tokens: int, data_dir: Path | None) -> list[str]:
    """`count` texts of exactly `tokens` tokens each (as the engine tokenizes them, separator excluded)."""
    source = ""
    musique = data_dir / "musique" / "musique_s.json" if data_dir else None
    if musique and musique.exists():
        cases = json.loads(musique.read_text())
        source = " ".join(c["text"] for case in cases[:5] for c in case["ctxs"])
    else:
        g = torch.Generator().manual_seed(0)
        vocab = "the of and to in a is that for it as was with be by on not he this are or his from at".split()
        source = " ".join(vocab[int(i)] for i in torch.randint(0, len(vocab), (count * tokens * 2,), generator=g))
    ids = tokenizer.encode(source, add_special_tokens=False)
    if len(ids) < count * tokens:
        raise SystemExit(f"not enough text for {count} chunks of {tokens} tokens")
    texts = []
    for i in range(count):
        piece = ids[i * tokens : (i + 1) * tokens]
        texts.append(tokenizer.decode(piece))
    return texts


RANDOM_SHAPES = {
    # Llama-2-7B / Mistral-7B-like shapes for GPU timing with random weights (timing does not depend on values).
    "7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
    ),
    "mistral-7b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
    ),
}


def build_engine(args, dtype: str, **config_fields) -> CacheBlendEngine:
    """The engine of `args` (a preset/checkpoint, or random weights of a shape); `config_fields` go to EngineConfig."""
    config = EngineConfig(device=args.device, dtype=dtype, **config_fields)
    if not args.random_weights:
        return CacheBlendEngine.from_pretrained(args.model, config=config, show_progress=False)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    shape = RANDOM_SHAPES[args.model_shape]
    cfg = LlamaConfig(**{"vocab_size": 32000, "max_position_embeddings": 8192, "rope_theta": 10000.0, **shape})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    # One token per word "w2".."w31999". The special tokens get names no word contains: the tokenizer matches
    # special tokens inside words too, so an eos named "w1" would split "w12" into two tokens.
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, 32000)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    return CacheBlendEngine(model, tokenizer, config=config)


QUESTION = "Which of these passages mentions a city, and what is its name?"


def make_prompt(engine: CacheBlendEngine, args, count: int, tokens: int, data_dir: Path | None) -> TokenizedPrompt:
    """The timed request: a prefix, `count` chunks of `tokens` tokens, a question (all random words with
    --random-weights, whose word-level tokenizer makes each word one token)."""
    if args.random_weights:
        g = torch.Generator().manual_seed(1)
        texts = [" ".join(f"w{int(i)}" for i in torch.randint(2, 32000, (tokens,), generator=g)) for _ in range(count)]
        return engine.build_prompt(texts, prefix="w5 w6 w7 w8", suffix=" ".join(["w9"] * 24))
    return engine.build_prompt(chunk_texts(engine.tokenizer, count, tokens, data_dir), QUESTION)


def warm_up(engine: CacheBlendEngine, prompt: TokenizedPrompt) -> None:
    """One untimed pass per mode: stores every chunk's KV (the warm cache timed next) and warms each code path."""
    for mode in MODES:
        engine.generate(prompt, mode=mode, max_new_tokens=1)
    engine.generate(prompt, mode="blend", max_new_tokens=1)


def timed_runs(ratios, rules=()) -> list[tuple[str, dict]]:
    """(name, `engine.prefill` arguments) of each timed run: every mode of MODES, blend with the engine's own
    rule at each ratio ("blend r=0.15"), then each named rule at each ratio ("paper r=0.15")."""
    runs = [(mode, {"mode": mode}) for mode in MODES]
    runs += [(f"blend r={r:.2f}", {"mode": "blend", "recompute_ratio": r}) for r in ratios]
    return runs + [
        (f"{rule} r={r:.2f}", {"mode": "blend", "blend": blend_rule(rule, r)}) for rule in rules for r in ratios
    ]


def measure(engine: CacheBlendEngine, prompt, runs, repeats: int) -> dict[str, list]:
    """TTFT of each run (the call with the built prompt to the first token, as `engine.generate` times it),
    interleaved (run 1, run 2, ..., run 1, ...) so that machine noise hits all alike."""
    out: dict[str, list] = {name: [] for name, _ in runs}
    for _ in range(repeats):
        for name, kw in runs:
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            pre = engine.prefill(prompt, **kw)
            int(pre.logits.argmax())  # the first token (greedy), synchronizing a GPU
            pre.metrics.ttft_s = time.perf_counter() - t0
            out[name].append(pre.metrics)
    return out


def run(args) -> dict:
    from cacheblend_rag.models import DEFAULT_PRESET

    data_dir = Path(args.data_dir) if args.data_dir else None
    report: dict = {
        "model": f"random-{args.model_shape}" if args.random_weights else (args.model or DEFAULT_PRESET),
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
        default_rule = rule_name(engine.config.blend) or "custom"
        for r in args.ratios:
            print(f"  ratio full / blend(r={r:.2f}) = {rows['full'] / rows[f'blend r={r:.2f}']:.2f}   [{default_rule}]")
        for rule in args.rules:
            for r in args.ratios:
                print(f"  ratio full / {rule}(r={r:.2f}) = {rows['full'] / rows[f'{rule} r={r:.2f}']:.2f}")
        report["results"][dtype] = {k: round(v, 5) for k, v in rows.items()}
        report["results"][dtype]["prompt_tokens"] = prompt.num_tokens
        del engine
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="preset name or local checkpoint (default: the default preset)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.15, 0.30])
    p.add_argument("--rules", nargs="*", default=["paper"], choices=RULE_NAMES,
                   help="named selection rules to time at each ratio too, beside the engine's default rule "
                   "(default: paper)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3)
    default_data = Path(__file__).resolve().parents[2] / "shared" / "data"
    p.add_argument("--data-dir", default=str(default_data) if default_data.exists() else None)
    p.add_argument("--random-weights", action="store_true", help="random weights of --model-shape (GPU timing)")
    p.add_argument("--model-shape", default="7b", choices=sorted(RANDOM_SHAPES))
    p.add_argument("--json", help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    report = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
