"""How the timing benchmarks (`ttft.py`, `sweep.py`, `tiers.py`, `controller.py`) build a request and time it:
chunk texts of an exact token length, an engine of a preset or of random weights of a known shape, the warm-up
that fills the store, and interleaved TTFT runs of each prefill mode."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

import torch

from benchlib.cli import model_name
from cacheblend_rag import CacheBlendEngine, EngineConfig, RequestMetrics, TokenizedPrompt
from cacheblend_rag.config import blend_rule
from cacheblend_rag.store import ChunkStore, TieredStore

K = TypeVar("K")


def add_data_dir_argument(parser: argparse.ArgumentParser) -> None:
    """--data-dir: MuSiQue passages give the chunk texts when present (default: $CACHEBLEND_RAG_DATA)."""
    default = os.environ.get("CACHEBLEND_RAG_DATA") or None
    parser.add_argument("--data-dir", default=default, help="folder with musique/ for the chunk texts")


def model_label(args: argparse.Namespace) -> str:
    """The model a timing run names in its report and figure: the preset's real name, or the random shape."""
    return f"random-{args.model_shape}" if args.random_weights else model_name(args.model)


MODES = ("full", "prefix", "reuse")


def median_ms(fn, repeats: int = 20, warmup: int = 1) -> float:
    """Median wall time of `fn()` in ms over `repeats` calls, after `warmup` calls that are not timed."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


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
    # Gemma-3 1B's shape: a sliding-window family (5 layers of 512-token windows to 1 global layer, two RoPE bases,
    # per-head q/k norms, norms around each branch), built from its own config class.
    "gemma3-1b": dict(
        model_type="gemma3_text",
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
    ),
}


def build_engine(args, dtype: str, **config_fields) -> CacheBlendEngine:
    """The engine of `args` (a preset/checkpoint, or random weights of a shape); `config_fields` go to EngineConfig."""
    config = EngineConfig(device=args.device, dtype=dtype, **config_fields)
    if not args.random_weights:
        return CacheBlendEngine.from_pretrained(args.model, config=config, show_progress=False)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    shape = dict(RANDOM_SHAPES[args.model_shape])
    model_type = shape.pop("model_type", "llama")
    defaults = {"vocab_size": 32000, "max_position_embeddings": 8192, "rope_theta": 10000.0}
    cfg = AutoConfig.for_model(model_type, **{**defaults, **shape})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
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


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the store-tier benchmarks (`tiers.py`, `controller.py`): the model and the timed request."""
    parser.add_argument("--model", default=None, help="preset name or local checkpoint (default: the default preset)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    add_data_dir_argument(parser)


def warm_request(args: argparse.Namespace) -> tuple[CacheBlendEngine, TokenizedPrompt]:
    """The engine of --model/--dtype and the timed request (--chunks of --chunk-tokens), its KV precomputed into
    the engine's memory store: the source every tier is filled from (`fill_tier`)."""
    engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig(dtype=args.dtype), show_progress=False)
    texts = chunk_texts(
        engine.tokenizer, args.chunks, args.chunk_tokens, Path(args.data_dir) if args.data_dir else None
    )
    engine.precompute(texts, QUESTION)
    return engine, engine.build_prompt(texts, QUESTION)


def fill_tier(source: CacheBlendEngine, prompt: TokenizedPrompt, tier: ChunkStore, name: str) -> TieredStore:
    """A store of `tier` alone (no memory tier in front), holding the prompt's KV copied from `source`'s store, so
    that every request reads its chunks from that tier."""
    store = TieredStore([tier], [name])
    for key in source.prompt_keys(prompt):
        store.put(source.store.get(key))
    store.flush()
    return store


def interleaved_tier_ttft(
    engines: Mapping[K, tuple[CacheBlendEngine, str]], prompt: TokenizedPrompt, ratio: float, repeats: int
) -> tuple[dict[K, float], dict[K, RequestMetrics]]:
    """Blend TTFT of each setup, `engines[setup] = (engine, the one tier its chunks must come from)`: a warm-up
    request each, then `repeats` rounds over every setup in turn. -> (median TTFT per setup, last metrics)."""
    for engine, _ in engines.values():
        engine.generate(prompt, mode="blend", recompute_ratio=ratio, max_new_tokens=1)
    times: dict[K, list[float]] = {setup: [] for setup in engines}
    last: dict[K, RequestMetrics] = {}
    loaded = len(prompt.chunk_ids)  # the prefix is kept aside, so every chunk comes from the tier
    for _ in range(repeats):
        for setup, (engine, tier) in engines.items():
            m = engine.generate(prompt, mode="blend", recompute_ratio=ratio, max_new_tokens=1).metrics
            assert m.hits_by_tier == {tier: loaded}, f"{setup}: expected {loaded} hits in {tier}, {m.hits_by_tier}"
            times[setup].append(m.ttft_s)
            last[setup] = m
    return {setup: statistics.median(t) for setup, t in times.items()}, last
