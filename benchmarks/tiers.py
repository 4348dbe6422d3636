"""TTFT of blend with chunk KV served from memory, from local disk and from Redis, with and without layer-wise
pipelined loading, side by side (paper §6).

Each store holds only its own tier (no memory tier in front of disk or Redis), so every request really reads
its chunks from that tier. Requests are interleaved across the six setups and the medians compared.

    python benchmarks/tiers.py                               # default model, fp32, 6 x 512 tokens, r = 0.15
    python benchmarks/tiers.py --redis-url redis://127.0.0.1:6379/0

Without --redis-url a private `redis-server` is started on a free loopback port (skipped if none is installed).
The disk tier reads through the OS page cache once warm, as a local SSD with free memory would.
Last, the check every disk and Redis read makes that a layer's values are finite (`store.serialize.all_finite`) is
timed alone over the request's layers, against the disk tier's TTFT.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchlib.cli import Transcript, add_out_argument, model_name  # noqa: E402
from benchlib.redis_server import tier_url  # noqa: E402
from benchlib.timing import add_tier_arguments, fill_tier, interleaved_tier_ttft, warm_request  # noqa: E402

from cacheblend_rag import CacheBlendEngine  # noqa: E402
from cacheblend_rag.store import ChunkStore, DiskStore, MemoryStore, RedisStore  # noqa: E402
from cacheblend_rag.store.serialize import all_finite  # noqa: E402


def finiteness_check_s(engine: CacheBlendEngine, prompt, repeats: int = 5) -> float:
    """Median seconds to check every layer of the prompt's chunks for finite values, as the loader does per layer."""
    entries = [engine.store.get(key) for key in engine.prompt_keys(prompt, with_prefix=False)]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for kv in entries:
            for layer in range(kv.keys.shape[0]):
                all_finite(kv.keys[layer], kv.values[layer])
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_tier_arguments(p)
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--redis-url", default=None)
    add_out_argument(p, "tiers", "folder for summary.txt, the table printed")
    args = p.parse_args(argv)
    say = Transcript()
    with (
        tempfile.TemporaryDirectory(prefix="cacheblend-bench-disk-") as disk_dir,
        tier_url(args.redis_url) as redis_url,
    ):
        base, prompt = warm_request(args)
        tiers: dict[str, ChunkStore] = {"memory": MemoryStore(), "disk": DiskStore(disk_dir)}
        if redis_url is not None:
            tiers["redis"] = RedisStore(redis_url, namespace=f"bench-{os.getpid()}")
        engines: dict[tuple[str, bool], tuple[CacheBlendEngine, str]] = {}
        for name, tier in tiers.items():
            store = fill_tier(base, prompt, tier, name)  # the same chunk KV in each tier
            for pipelined in (False, True):
                engine = CacheBlendEngine(base.model, base.tokenizer, config=base.config, store=store)
                engine.prefiller.pipelined = pipelined  # False: each layer read when the fusor needs it
                engines[name, pipelined] = engine, name
        med, last = interleaved_tier_ttft(engines, prompt, args.ratio, args.repeats)
        check_s = finiteness_check_s(base, prompt)
    say(
        f"{model_name(args.model)}: blend r={args.ratio}, {prompt.num_tokens} tokens, {args.chunks} chunks, "
        f"{args.dtype}, medians of {args.repeats} interleaved runs"
    )
    for (name, pipelined), m in last.items():
        label = f"{name}, {'pipelined' if pipelined else 'serial'}"
        say(
            f"  {label:<20} TTFT {med[name, pipelined] * 1000:7.0f} ms  load {m.load_s * 1000:6.0f} ms  "
            f"waited {m.wait_s * 1000:6.0f} ms  compute {m.compute_s * 1000:6.0f} ms  "
            f"loaded {m.bytes_loaded / 2**20:.0f} MiB"
        )
    for pipelined in (False, True):
        for name in tiers:
            if name != "memory":
                ratio = med[name, pipelined] / med["memory", pipelined]
                say(f"  ratio {name} / memory, {'pipelined' if pipelined else 'serial'}: {ratio:.3f}")
    say(
        f"  finiteness check of every loaded layer: {check_s * 1000:.1f} ms per request, "
        f"{check_s / med['disk', False]:.2%} of the disk tier's serial TTFT"
    )
    if redis_url is None:
        say("  (redis: no redis-server found; install it to include this tier)")
    say.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
