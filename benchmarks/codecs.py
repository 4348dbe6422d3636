"""Stored chunk KV per codec, side by side: bytes per token, 512-token chunks per 20 GiB, encode and decode time
per chunk, and blend TTFT with the chunks in the disk tier vs the memory tier (each tier alone, both in the codec).

    OMP_NUM_THREADS=2 python benchmarks/codecs.py            # default model, fp32, 6 x 512 tokens, r = 0.15
    python benchmarks/codecs.py --no-ttft                     # sizes and encode/decode times only (no model)

Sizes come from the codecs' payload shapes plus the entry header, for the default model's shape (24 layers,
2 KV heads, head dim 64) and a 7B shape (32 layers, 8 KV heads, head dim 128); only shapes matter there, so the
7B chunk is random. TTFT: warm stores, requests interleaved across the setups, medians; the disk tier reads
through the OS page cache once warm.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from cacheblend_rag import CacheBlendEngine, EngineConfig  # noqa: E402
from cacheblend_rag.store import ChunkKV, DiskStore, MemoryStore, TieredStore  # noqa: E402
from cacheblend_rag.store.codec import CODECS  # noqa: E402
from cacheblend_rag.store.serialize import deserialize_chunk, serialize_chunk  # noqa: E402
from cacheblend_rag.testing import random_words  # noqa: E402

SHAPES = {  # name -> (layers, KV heads, head dim, the dtype such a model usually runs in)
    "default (0.5B)": (24, 2, 64, torch.float32),
    "7B-class": (32, 8, 128, torch.bfloat16),
}
BUDGET = 20 * 1024**3
TOKENS = 512


def random_chunk(layers: int, heads: int, head_dim: int, dtype: torch.dtype) -> ChunkKV:
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(layers, heads, TOKENS, head_dim, generator=g).to(dtype)
    keys[..., 6] += 20.0  # an outlier channel, as pre-RoPE keys have
    return ChunkKV("bench", keys, torch.randn(layers, heads, TOKENS, head_dim, generator=g).to(dtype))


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def sizes_and_codec_times(codecs: list[str]) -> None:
    print(f"stored bytes per token and {TOKENS}-token chunks per 20 GiB (entry header included)")
    for label, (layers, heads, head_dim, model_dtype) in SHAPES.items():
        for dtype in dict.fromkeys((torch.float32, model_dtype, torch.bfloat16)):
            kv = random_chunk(layers, heads, head_dim, dtype)
            dname = str(dtype).removeprefix("torch.")
            timed = dtype == model_dtype
            print(f"  {label}, {dname} model:")
            for name in codecs:
                codec = CODECS[name]
                data = serialize_chunk(kv, codec=codec)
                line = (
                    f"    {name:<7} {len(data) / TOKENS:9,.0f} B/token  {len(data) / 2**20:7.2f} MiB/chunk  "
                    f"{BUDGET // len(data):7,d} chunks/20 GiB  x{kv.nbytes / len(data):4.1f} smaller than native"
                )
                if timed:  # encode (+ checksums, as a tier's put does) and decode, per chunk, one thread's worth
                    put = best_of(lambda: serialize_chunk(kv, codec=codec))  # noqa: B023
                    get = best_of(lambda: deserialize_chunk(data, "bench", codec=codec))  # noqa: B023
                    line += f"  encode {put * 1000:6.0f} ms  decode {get * 1000:6.0f} ms"
                print(line)


def ttft(args: argparse.Namespace, codecs: list[str]) -> None:
    base = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig(dtype=args.dtype), show_progress=False)
    texts = [random_words(100 + i, args.chunk_tokens) for i in range(args.chunks)]
    ids = [base.tokenizer(t, add_special_tokens=False)["input_ids"][: args.chunk_tokens] for t in texts]
    texts = [base.tokenizer.decode(x) for x in ids]
    question = "Which of these passages mentions a city, and what is its name?"
    prompt = base.build_prompt(texts, question)
    t = time.perf_counter()
    base.precompute(texts, question)
    print(f"\nprecompute of {args.chunks} chunks (compute, no codec): {time.perf_counter() - t:.1f} s")
    keys = base.prompt_keys(prompt)
    chunks = [base.store.get(k) for k in keys]
    disk_root = tempfile.mkdtemp(prefix="cacheblend-bench-codecs-")
    try:
        engines = {}
        for name in codecs:
            tiers = {"memory": MemoryStore(codec=name), "disk": DiskStore(os.path.join(disk_root, name), codec=name)}
            for tier, store in tiers.items():
                stack = TieredStore([store], [tier])
                for kv in chunks:
                    stack.put(kv)
                stack.flush()
                engine = CacheBlendEngine(base.model, base.tokenizer, config=base.config, store=stack)
                engine.generate(prompt, mode="blend", recompute_ratio=args.ratio, max_new_tokens=1)  # warm-up
                engines[name, tier] = engine
        times: dict[tuple[str, str], list[float]] = {setup: [] for setup in engines}
        last = {}
        for _ in range(args.repeats):
            for (name, tier), engine in engines.items():
                r = engine.generate(prompt, mode="blend", recompute_ratio=args.ratio, max_new_tokens=1)
                assert r.metrics.hits_by_tier == {tier: args.chunks}, r.metrics.hits_by_tier  # the prefix is kept aside
                times[name, tier].append(r.metrics.ttft_s)
                last[name, tier] = r.metrics
        print(
            f"blend TTFT, r={args.ratio}, {prompt.num_tokens} tokens, {args.chunks} chunks, {args.dtype}, pipelined, "
            f"{torch.get_num_threads()} threads, medians of {args.repeats} interleaved runs"
        )
        med = {setup: statistics.median(v) for setup, v in times.items()}
        for name in codecs:
            cells = []
            for tier in ("memory", "disk"):
                m = last[name, tier]
                cells.append(
                    f"{tier} {med[name, tier] * 1000:6.0f} ms (load {m.load_s * 1000:5.0f}, "
                    f"waited {m.wait_s * 1000:4.0f}, {m.bytes_loaded / 2**20:5.1f} MiB)"
                )
            ratio = med[name, "disk"] / med[name, "memory"]
            vs_native = med[name, "disk"] / med["native", "memory"]
            print(f"  {name:<7} {'  '.join(cells)}  disk/memory {ratio:.3f}  disk/native-memory {vs_native:.3f}")
    finally:
        shutil.rmtree(disk_root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--codecs", default=",".join(CODECS), help="comma-separated codec names")
    p.add_argument("--no-ttft", action="store_true", help="sizes and codec times only")
    args = p.parse_args(argv)
    codecs = args.codecs.split(",")
    unknown = [c for c in codecs if c not in CODECS]
    if unknown:
        p.error(f"--codecs: unknown {unknown}; choose from {sorted(CODECS)}")
    sizes_and_codec_times(codecs)
    if not args.no_ttft:
        ttft(args, codecs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
