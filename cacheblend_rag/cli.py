"""Command line: `cacheblend-rag ask --docs DIR "question"` and friends.

`ask` reads the text files of a folder, splits them into chunks, indexes them (FAISS + all-MiniLM-L6-v2),
retrieves the top-k chunks for each question and answers with the chosen prefill mode on the chosen model,
printing the answer and the request's metrics. A chunk's KV is computed by the first request that retrieves it
(and counted in that request's TTFT); later questions in one call, or later calls with --kv-dir / --redis-url,
show chunk hits. The arguments are in `cli_args.py`, where the chunks come from in `cli_sources.py`.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from collections.abc import Sequence

from .cli_args import build_parser, check_kv_dir, check_model_name, check_numbers, cpu_has_bf16, guard_from_args
from .cli_calibrate import cmd_calibrate
from .cli_sources import build_index, check_index_folder, choose_documents, read_sources, record_index_contexts
from .errors import CacheBlendError

__all__ = ["build_parser", "main"]


def _engine_config(args: argparse.Namespace):
    from .config import BlendConfig, EngineConfig

    blend = BlendConfig(recompute_ratio=args.ratio) if args.ratio is not None else BlendConfig()
    check_model_name(args.model)
    check_kv_dir(args)
    if args.device == "cpu" and str(args.dtype).lower() in ("bfloat16", "bf16") and cpu_has_bf16() is False:
        print("warning: this CPU has no bf16 matrix instructions (amx_bf16 / avx512_bf16): bfloat16 runs several "
              "times slower than float32 here; drop --dtype bfloat16", file=sys.stderr)  # fmt: skip
    return EngineConfig(
        device=args.device,
        dtype=args.dtype,
        blend=blend,
        disk_dir=args.kv_dir,
        redis_url=args.redis_url,
        miss_policy=args.miss_policy,
        guard=guard_from_args(args),
        context_neighbours=args.context_neighbours,
        decode_weights=args.decode_weights,
    )


def cmd_ask(args: argparse.Namespace) -> int:
    from .engine import CacheBlendEngine
    from .retrieval import MIN_CHUNK_TOKENS

    # Arguments, paths and documents first: loading the model takes seconds, a typo should not.
    check_numbers(
        ("--top-k", args.top_k, 1),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--chunk-tokens", args.chunk_tokens, MIN_CHUNK_TOKENS),
        ("--temperature", args.temperature, 0),
        ("--ratio", args.ratio, 0),
        ("--min-ratio", args.min_ratio, 0),
        ("--max-doc-mb", args.max_doc_mb, 0),
    )
    config = _engine_config(args)
    fidelity, min_ratio = None, args.min_ratio
    if args.fidelity_profile:
        from .cli_calibrate import apply_fidelity_profile

        # The fidelity choice sets r and the guard; with a loading profile it is the floor: r = max(it, r_load).
        config, fidelity = apply_fidelity_profile(args, config)
        min_ratio = fidelity.choice.min_ratio
    controller = None
    if args.profile:
        from .controller import LoadingController, LoadingProfile

        # --ratio, when given, pins r: the engine then uses it as is and the controller stays out of the way.
        controller = LoadingController(LoadingProfile.load(args.profile), min_ratio=min_ratio)
    sources = read_sources(args)
    t = time.perf_counter()
    engine = CacheBlendEngine.from_pretrained(args.model, config=config, controller=controller)
    print(f"model {args.model or 'default preset'} ready in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    if fidelity is not None:
        fidelity.profile.check_model(engine.fingerprint, engine.config.dtype)
    index = sources.index
    if index is None:
        assert sources.record is not None, "documents come with the record of their index"
        index = build_index(args, sources.documents, engine.tokenizer, sources.record, args.index)
    # Contextual chunk KV: each chunk's entry is prefilled after its nearest chunks in the index, whether now
    # (--precompute-all) or when a request first misses it.
    context = record_index_contexts(engine, index)
    if args.precompute_all:
        t = time.perf_counter()
        hits, misses = engine.precompute([c.text for c in index.chunks], context=context, show_progress=True)
        print(
            f"precomputed the KV of {len(index)} chunks in {time.perf_counter() - t:.1f}s "
            f"({hits} already cached, {misses} computed)",
            file=sys.stderr,
        )
    for question in args.questions:
        hits = index.search(question, k=args.top_k)
        print(f"\nQ: {question}")
        if args.show_sources:
            for h in hits:
                print(f"   [{h.score:.3f}] {h.chunk.source} #{h.chunk.index}")
        print("A: ", end="", flush=True)
        # No warm-up before the request: the KV of chunks missing from the store is computed inside it, so the
        # printed TTFT of a cold question is what a user waits. The stream is `generate` printed as it comes.
        stream = engine.stream(
            [h.chunk.text for h in hits],
            question,
            mode=args.mode,
            recompute_ratio=args.ratio if args.mode == "blend" else None,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
        )
        try:
            for piece in stream:
                print(piece, end="", flush=True)
        finally:
            print(flush=True)  # the answer's line ends, even when Ctrl-C cuts it short
        assert stream.result is not None, "a finished stream holds its result"
        print(f"   {stream.result.metrics.summary()}")
    engine.wait_for_fills()  # chunks cold questions were answered without: stored after each answer, in the background
    engine.store.flush()  # chunk KV written to disk/Redis in the background must land before the process exits
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    import tempfile

    from .config import EngineConfig
    from .controller import profile_engine
    from .engine import CacheBlendEngine
    from .store import DiskStore, MemoryStore

    check_model_name(args.model)
    check_kv_dir(args)
    engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig(device=args.device, dtype=args.dtype))
    with tempfile.TemporaryDirectory(prefix="cacheblend-profile-") as scratch:
        # Time the tiers the deployment will use: its disk folder (a scratch namespace inside it) and its Redis.
        disk_dir = os.path.join(args.kv_dir, ".profile") if args.kv_dir else scratch
        tiers: dict = {"memory": MemoryStore(), "disk": DiskStore(disk_dir)}
        if args.redis_url:
            from .store import RedisStore

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


def cmd_index(args: argparse.Namespace) -> int:
    from .models import load_model
    from .retrieval import MIN_CHUNK_TOKENS, read_documents

    # The documents first: a wrong path or encoding is reported before the model loads.
    check_numbers(("--chunk-tokens", args.chunk_tokens, MIN_CHUNK_TOKENS), ("--max-doc-mb", args.max_doc_mb, 0))
    check_model_name(args.model)
    check_index_folder(args.out, "--out")
    files, record = choose_documents(args)
    documents = read_documents(files, encoding=args.encoding)
    _, tokenizer = load_model(args.model) if args.model else load_model()
    index = build_index(args, documents, tokenizer, record, args.out)
    print(f"indexed {len(index)} chunks from {args.docs} into {args.out}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from .models import DEFAULT_PRESET, PRESETS

    for name, preset in PRESETS.items():
        mark = " (default)" if name == DEFAULT_PRESET else ""
        print(f"{name}{mark}: {preset.description}")
    return 0


COMMANDS = {
    "ask": cmd_ask,
    "calibrate": cmd_calibrate,
    "profile": cmd_profile,
    "index": cmd_index,
    "models": cmd_models,
}


def main(argv: Sequence[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):
        # A file name that is not valid UTF-8 reaches Python as lone surrogates: print it escaped, not crash.
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        return COMMANDS[args.command](args)
    except CacheBlendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback (128 + SIGINT, as shells report it)
        sys.stdout.flush()
        print("interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
