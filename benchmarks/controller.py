"""The loading controller per tier: the ratio it picks and the TTFT it gets, against a fixed r = 0.15 (paper §5.1).

For each tier (memory, local disk, Redis, and emulated slow links: a disk or network read at a fixed byte
rate), chunk KV is served from that tier alone with pipelined loading, and two engines answer the same
6 x 512-token prompt interleaved: one whose controller picks r per request, one pinned at r = 0.15. Where
loading is faster than recompute at the floor, the controller keeps r = 0.15 and both match; where loading is
slower, it recomputes more (better quality) while TTFT stays what loading costs anyway.

    python benchmarks/controller.py                       # default model, fp32; profiles first (~2-4 min)
    python benchmarks/controller.py --profile p.json      # reuse a profile written by `cacheblend-rag profile`
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchlib.cli import Transcript, add_out_argument, model_name  # noqa: E402
from benchlib.redis_server import private_server  # noqa: E402
from benchlib.timing import add_tier_arguments, fill_tier, warm_request  # noqa: E402

from cacheblend_rag import CacheBlendEngine  # noqa: E402
from cacheblend_rag.controller import LoadingController, LoadingProfile, profile_engine  # noqa: E402
from cacheblend_rag.store import ChunkKV, ChunkStore, DiskStore, Hit, MemoryStore, RedisStore  # noqa: E402


class ThrottledDisk(DiskStore):
    """A disk tier whose layer reads take at least bytes / `bytes_per_s`: a slower disk or a network link."""

    def __init__(self, directory: str, bytes_per_s: float, name: str) -> None:
        super().__init__(directory)
        self.bytes_per_s = bytes_per_s
        self.name = name

    def open(self, key: str) -> Hit | None:
        hit = super().open(key)
        if hit is None:
            return None
        lazy = hit.kv
        read = lazy._read_ranges  # a benchmark's throttle on the file reads of this one entry

        def slow_read(ranges: Sequence[tuple[int, int]]):
            t = time.perf_counter()
            out = read(ranges)
            due = sum(b - a for a, b in ranges) / self.bytes_per_s
            time.sleep(max(0.0, due - (time.perf_counter() - t)))
            return out

        lazy._read_ranges = slow_read
        return hit

    def get(self, key: str) -> ChunkKV | None:
        hit = self.open(key)
        return None if hit is None else hit.kv.materialize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_tier_arguments(p)
    p.add_argument("--min-ratio", type=float, default=0.15)
    p.add_argument("--profile", default=None, help="a profile JSON from `cacheblend-rag profile` (else: measure)")
    p.add_argument("--slow-mbps", type=float, nargs="*", default=[200.0, 50.0], help="emulated slow tiers, MB/s")
    add_out_argument(p, "controller", "folder for summary.txt, the table printed")
    args = p.parse_args(argv)
    say = Transcript()
    with tempfile.TemporaryDirectory(prefix="cacheblend-bench-controller-") as work, private_server() as server:
        base, prompt = warm_request(args)
        tiers: dict[str, ChunkStore] = {"memory": MemoryStore(), "disk": DiskStore(os.path.join(work, "disk"))}
        if server is not None:
            tiers["redis"] = RedisStore(server.url, namespace=f"bench-{os.getpid()}")
        for mbps in args.slow_mbps:
            name = f"slow-{mbps:g}MB/s"
            tiers[name] = ThrottledDisk(os.path.join(work, name.replace("/", "")), mbps * 1e6, name)

        if args.profile:
            profile = LoadingProfile.load(args.profile)
        else:
            say("profiling recompute and tier reads ...")
            total = args.chunks * args.chunk_tokens
            counts = sorted({max(args.chunk_tokens, total // 2), total})
            profile = profile_engine(base, token_counts=counts, tiers=tiers, chunk_tokens=args.chunk_tokens)
            profile.save(os.path.join(work, "profile.json"))
        missing = [t for t in tiers if t not in profile.tiers]
        if missing:
            raise SystemExit(f"the profile has no read speed for tiers {missing}; profile them or drop them")

        keys = base.prompt_keys(prompt)
        controller = LoadingController(profile, min_ratio=args.min_ratio)
        nbytes = sum(base.store.get(k).nbytes for k in keys[1:])

        say(
            f"{model_name(args.model)}: blend, {prompt.num_tokens} tokens, {args.chunks} chunks "
            f"({nbytes / 2**20:.0f} MiB of KV), {args.dtype}, pipelined loading, medians of {args.repeats} "
            f"interleaved runs; controller floor r_min={args.min_ratio}"
        )
        say(f"{'tier':<16} {'read MB/s':>9} {'r picked':>8} {'TTFT ctrl':>10} {'TTFT r=0.15':>11} {'est. load':>9}")
        for name, tier in tiers.items():
            store = fill_tier(base, prompt, tier, name)
            auto = CacheBlendEngine(base.model, base.tokenizer, config=base.config, store=store, controller=controller)
            fixed = CacheBlendEngine(base.model, base.tokenizer, config=base.config, store=store)
            runs: dict[str, list[float]] = {"auto": [], "fixed": []}
            picked = []
            for _ in range(args.repeats):
                a = auto.generate(prompt, max_new_tokens=1)
                f = fixed.generate(prompt, recompute_ratio=0.15, max_new_tokens=1)
                assert a.metrics.hits_by_tier == {name: args.chunks}, a.metrics.hits_by_tier
                runs["auto"].append(a.metrics.ttft_s)
                runs["fixed"].append(f.metrics.ttft_s)
                picked.append(a.metrics.recompute_ratio)
            est = controller.load_time({name: nbytes}, {name: args.chunks})
            say(
                f"{name:<16} {profile.tiers[name].bytes_per_s / 1e6:9.0f} {statistics.median(picked):8.2f} "
                f"{statistics.median(runs['auto']) * 1000:8.0f}ms {statistics.median(runs['fixed']) * 1000:9.0f}ms "
                f"{est * 1000:7.0f}ms"
            )
        cheapest = controller.cheapest_tier(prompt.num_tokens, nbytes, args.chunks, ratio=0.15)
        say(f"cheapest tier that adds no delay at r=0.15 (cost order {', '.join(controller.tier_costs)}): {cheapest}")
        budget = profile.recompute_time(prompt.num_tokens, 0.15)
        for name in tiers:
            est = controller.load_time({name: nbytes}, {name: args.chunks})
            say(f"  {name:<16} load {est * 1000:6.0f} ms vs recompute at r=0.15 {budget * 1000:6.0f} ms")
    say.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
