"""Stored chunk KV per codec, side by side in one run: bytes per token, 512-token chunks per 20 GiB, encode and
decode time per chunk, and blend TTFT with the chunks in the disk tier and in the Redis tier against the memory
tier (each tier alone, all three in the codec).

    python benchmarks/codecs.py            # default model, fp32, 6 x 512 tokens, r = 0.15, pipelined loading
    python benchmarks/codecs.py --no-ttft  # sizes and encode/decode times only (no model)

Without --redis-url a private `redis-server` is started on a free loopback port (the Redis rows are skipped if
none is installed).

Sizes come from the codecs' payload shapes plus the entry header, for the default model's shape (24 layers,
2 KV heads, head dim 64) and a 7B shape (32 layers, 8 KV heads, head dim 128); only shapes matter there, so the
7B chunk is random. TTFT: warm stores, requests interleaved across the setups, medians; the disk tier reads
through the OS page cache once warm.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from benchlib.cli import Transcript, add_out_argument  # noqa: E402
from benchlib.redis_server import tier_url  # noqa: E402
from benchlib.timing import add_tier_arguments, fill_tier, interleaved_tier_ttft, warm_request  # noqa: E402

from cacheblend_rag import CacheBlendEngine  # noqa: E402
from cacheblend_rag.store import ChunkKV, ChunkStore, DiskStore, MemoryStore, RedisStore  # noqa: E402
from cacheblend_rag.store.codec import CODECS  # noqa: E402
from cacheblend_rag.store.serialize import deserialize_chunk, serialize_chunk  # noqa: E402

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


def sizes_and_codec_times(codecs: list[str], say: Transcript) -> None:
    say(f"stored bytes per token and {TOKENS}-token chunks per 20 GiB (entry header included)")
    for label, (layers, heads, head_dim, model_dtype) in SHAPES.items():
        for dtype in dict.fromkeys((torch.float32, model_dtype, torch.bfloat16)):
            kv = random_chunk(layers, heads, head_dim, dtype)
            dname = str(dtype).removeprefix("torch.")
            timed = dtype == model_dtype
            say(f"  {label}, {dname} model:")
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
                say(line)


def ttft(args: argparse.Namespace, codecs: list[str], say: Transcript) -> None:
    with (
        tempfile.TemporaryDirectory(prefix="cacheblend-bench-codecs-") as disk_root,
        tier_url(args.redis_url) as redis_url,
    ):
        t = time.perf_counter()
        base, prompt = warm_request(args)
        say(f"\nprecompute of {args.chunks} chunks (compute, no codec) and model load: {time.perf_counter() - t:.1f} s")
        tier_names = ["memory", "disk"] + (["redis"] if redis_url is not None else [])
        engines: dict[tuple[str, str], tuple[CacheBlendEngine, str]] = {}
        for name in codecs:
            tiers: dict[str, ChunkStore] = {
                "memory": MemoryStore(codec=name),
                "disk": DiskStore(os.path.join(disk_root, name), codec=name),
            }
            if redis_url is not None:
                tiers["redis"] = RedisStore(redis_url, namespace=f"bench-codecs-{os.getpid()}-{name}", codec=name)
            for tier, store in tiers.items():
                engine = CacheBlendEngine(
                    base.model, base.tokenizer, config=base.config, store=fill_tier(base, prompt, store, tier)
                )
                engines[name, tier] = engine, tier
        med, last = interleaved_tier_ttft(engines, prompt, args.ratio, args.repeats)
    say(
        f"blend TTFT, r={args.ratio}, {prompt.num_tokens} tokens, {args.chunks} chunks, {args.dtype}, pipelined, "
        f"{torch.get_num_threads()} threads, medians of {args.repeats} interleaved runs"
    )
    for name in codecs:
        for tier in tier_names:
            m = last[name, tier]
            line = (
                f"  {name:<7} {tier:<7} TTFT {med[name, tier] * 1000:6.0f} ms  load {m.load_s * 1000:5.0f} ms  "
                f"waited {m.wait_s * 1000:4.0f} ms  loaded {m.bytes_loaded / 2**20:5.1f} MiB"
            )
            if tier != "memory":
                line += f"  {tier}/memory {med[name, tier] / med[name, 'memory']:.3f}"
                if ("native", "memory") in med:
                    line += f"  {tier}/native-memory {med[name, tier] / med['native', 'memory']:.3f}"
            say(line)
    if redis_url is None:
        say("  (redis: no redis-server found; install it to include this tier)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_tier_arguments(p)
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--codecs", default=",".join(CODECS), help="comma-separated codec names")
    p.add_argument("--redis-url", default=None, help="a Redis server for the Redis tier (default: a private one)")
    p.add_argument("--no-ttft", action="store_true", help="sizes and codec times only")
    add_out_argument(p, "codecs", "folder for summary.txt, the tables printed")
    args = p.parse_args(argv)
    codecs = args.codecs.split(",")
    unknown = [c for c in codecs if c not in CODECS]
    if unknown:
        p.error(f"--codecs: unknown {unknown}; choose from {sorted(CODECS)}")
    say = Transcript()
    sizes_and_codec_times(codecs, say)
    if not args.no_ttft:
        ttft(args, codecs, say)
    say.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
