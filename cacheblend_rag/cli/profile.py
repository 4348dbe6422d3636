"""`cacheblend-rag profile`: measure blend compute and tier read speeds for the loading controller."""

from __future__ import annotations

import argparse
import os

from .args import check_kv_dir, check_model_name

__all__ = ["cmd_profile"]


def cmd_profile(args: argparse.Namespace) -> int:
    import tempfile

    from ..config import EngineConfig
    from ..controller import profile_engine
    from ..engine import CacheBlendEngine
    from ..store import DiskStore, MemoryStore

    check_model_name(args.model)
    check_kv_dir(args)
    engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig(device=args.device, dtype=args.dtype))
    with tempfile.TemporaryDirectory(prefix="cacheblend-profile-") as scratch:
        # Time the tiers the deployment will use: its disk folder (a scratch namespace inside it) and its Redis.
        disk_dir = os.path.join(args.kv_dir, ".profile") if args.kv_dir else scratch
        tiers: dict = {"memory": MemoryStore(), "disk": DiskStore(disk_dir)}
        if args.redis_url:
            from ..store import RedisStore

            tiers["redis"] = RedisStore(args.redis_url, namespace=f"cacheblend-profile-{os.getpid()}")
        try:
            profile = profile_engine(
                engine,
                token_counts=args.token_counts,
                ratios=args.ratios,
                chunk_tokens=args.chunk_tokens,
                tiers=tiers,
                repeats=args.repeats,
            )
        finally:
            for name, store in tiers.items():
                if name != "memory":  # the profile's own entries in disk / Redis
                    store.clear()
    profile.save(args.out)
    print(f"profile of {args.model or 'the default preset'} ({args.dtype}, {args.device}) written to {args.out}")
    for point in profile.compute:
        print(
            f"  {point.num_tokens:6d} tokens: blend compute {point.intercept_s * 1000:7.0f} ms + "
            f"{point.slope_s * 1000:7.0f} ms x r  (r=0.15: {point.at(0.15) * 1000:.0f} ms)"
        )
    for name, speed in profile.tiers.items():
        print(f"  {name:<7} reads {speed.bytes_per_s / 1e6:8.0f} MB/s, {speed.latency_s * 1000:.1f} ms per chunk")
    return 0
