"""Command line: `cacheblend-rag ask --docs DIR "question"` and friends.

`ask` reads the text files of a folder, splits them into chunks, indexes them (FAISS + all-MiniLM-L6-v2),
retrieves the top-k chunks for each question and answers with the chosen prefill mode on the chosen model,
printing the answer and the request's metrics. Several questions in one call share the chunk KV cache, so
later questions show chunk hits.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .config import LEAD_IN_DEFAULT, LEAD_IN_HELP
from .errors import CacheBlendError

if TYPE_CHECKING:
    pass


def _engine_config(args: argparse.Namespace):
    from .config import BlendConfig, EngineConfig, resolve_lead_in

    blend = BlendConfig(recompute_ratio=args.ratio) if args.ratio is not None else BlendConfig()
    _check_kv_dir(args)
    return EngineConfig(
        device=args.device,
        dtype=args.dtype,
        blend=blend,
        disk_dir=args.kv_dir,
        redis_url=args.redis_url,
        lead_in=resolve_lead_in(args.lead_in),
    )


def _check_kv_dir(args: argparse.Namespace) -> None:
    """A --kv-dir that is a file, not writable or damaged: one `error:` line (exit 2) before any model loads."""
    if args.kv_dir:
        from .store import check_disk_dir

        check_disk_dir(args.kv_dir)


def _check_at_least(*checks: tuple[str, float, float]) -> None:
    """(flag, value, lowest allowed) of numeric flags, checked before anything loads."""
    for flag, value, low in checks:
        if value < low:
            raise CacheBlendError(f"{flag} must be >= {low}, got {value}")


def _read_sources(args: argparse.Namespace):
    """The saved index of --index, or the documents of --docs: read (and checked) before any model loads."""
    from .retrieval import ChunkIndex, load_documents

    if args.index and os.path.isdir(args.index) and os.listdir(args.index):
        index = ChunkIndex.load(args.index)
        print(f"loaded index of {len(index)} chunks from {args.index}", file=sys.stderr)
        return index
    if not args.docs:
        raise CacheBlendError("give --docs DIR (the text files to answer from), or --index of a saved index")
    return load_documents(args.docs, suffixes=_suffixes(args), encoding=args.encoding)


def _index_documents(args: argparse.Namespace, documents, tokenizer):
    """Split the documents with the model's tokenizer and index the chunks (FAISS + all-MiniLM-L6-v2)."""
    from .retrieval import ChunkIndex, split_documents

    chunks = split_documents(documents, tokenizer, chunk_tokens=args.chunk_tokens)
    index = ChunkIndex.build(chunks, show_progress=True)
    print(f"indexed {len(index)} chunks from {args.docs}", file=sys.stderr)
    if args.index:
        index.save(args.index)
        print(f"saved the index to {args.index}", file=sys.stderr)
    return index


def _suffixes(args: argparse.Namespace) -> tuple[str, ...]:
    from .retrieval import DEFAULT_SUFFIXES

    return tuple(args.suffix) if args.suffix else DEFAULT_SUFFIXES


def cmd_ask(args: argparse.Namespace) -> int:
    from .engine import CacheBlendEngine
    from .retrieval import MIN_CHUNK_TOKENS, ChunkIndex

    # Arguments, paths and documents first: loading the model takes seconds, a typo should not.
    _check_at_least(
        ("--top-k", args.top_k, 1),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--chunk-tokens", args.chunk_tokens, MIN_CHUNK_TOKENS),
        ("--temperature", args.temperature, 0),
    )
    config = _engine_config(args)
    controller = None
    if args.profile:
        from .controller import LoadingController, LoadingProfile

        # --ratio, when given, pins r: the engine then uses it as is and the controller stays out of the way.
        controller = LoadingController(LoadingProfile.load(args.profile), min_ratio=args.min_ratio)
    sources = _read_sources(args)
    t = time.perf_counter()
    engine = CacheBlendEngine.from_pretrained(args.model, config=config, controller=controller)
    print(f"model {args.model or 'default preset'} ready in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    index = sources if isinstance(sources, ChunkIndex) else _index_documents(args, sources, engine.tokenizer)
    if args.precompute_all:
        hits, misses = engine.precompute([c.text for c in index.chunks], show_progress=True)
        print(f"chunk KV: {hits} already cached, {misses} computed", file=sys.stderr)
    for question in args.questions:
        hits = index.search(question, k=args.top_k)
        texts = [h.chunk.text for h in hits]
        if args.mode != "full" and not args.precompute_all:
            # Make the retrieved chunks' KV ready first (with a progress bar): this is the one-off indexing cost,
            # kept out of the request so its metrics show the steady state.
            cached, computed = engine.precompute(texts, question, show_progress=True)
            print(f"chunk KV: {cached} from the store, {computed} computed now", file=sys.stderr)
        print(f"\nQ: {question}")
        if args.show_sources:
            for h in hits:
                print(f"   [{h.score:.3f}] {h.chunk.source} #{h.chunk.index}")
        print("A: ", end="", flush=True)
        stream = engine.stream(
            texts,
            question,
            mode=args.mode,
            recompute_ratio=args.ratio if args.mode == "blend" else None,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
        )
        for piece in stream:
            print(piece, end="", flush=True)
        print()
        assert stream.result is not None
        print(f"   {stream.result.metrics.summary()}")
    engine.store.flush()  # chunk KV written to disk/Redis in the background must land before the process exits
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    import tempfile

    from .config import EngineConfig
    from .controller import profile_engine
    from .engine import CacheBlendEngine
    from .store import DiskStore, MemoryStore

    _check_kv_dir(args)
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
    from .retrieval import MIN_CHUNK_TOKENS, ChunkIndex, load_documents, split_documents

    # The documents first: a wrong path or encoding is reported before the model loads.
    _check_at_least(("--chunk-tokens", args.chunk_tokens, MIN_CHUNK_TOKENS))
    documents = load_documents(args.docs, suffixes=_suffixes(args), encoding=args.encoding)
    _, tokenizer = load_model(args.model) if args.model else load_model()
    chunks = split_documents(documents, tokenizer, chunk_tokens=args.chunk_tokens)
    index = ChunkIndex.build(chunks, show_progress=True)
    index.save(args.out)
    print(f"indexed {len(index)} chunks from {args.docs} into {args.out}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from .models import DEFAULT_PRESET, PRESETS

    for name, preset in PRESETS.items():
        mark = " (default)" if name == DEFAULT_PRESET else ""
        aliases = f" [alias: {', '.join(preset.aliases)}]" if preset.aliases else ""
        print(f"{name}{mark}{aliases}: {preset.description}")
    return 0


def _add_document_arguments(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """--docs and how its files are read (`ask` and `index`)."""
    parser.add_argument("--docs", required=required, help="folder (or file) of .txt/.md/.rst documents")
    parser.add_argument("--encoding", default="utf-8", help="text encoding of the files, e.g. latin-1 (default utf-8)")
    parser.add_argument("--suffix", action="append", metavar=".EXT", help="read the files ending in .EXT instead "
                        "of .txt/.md/.rst; repeat for several")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cacheblend-rag", description="CacheBlend RAG on Hugging Face models")
    sub = p.add_subparsers(dest="command", required=True)

    ask = sub.add_parser("ask", help="answer questions over a folder of text files")
    ask.add_argument("questions", nargs="+", help="one or more questions")
    _add_document_arguments(ask, required=False)
    ask.add_argument("--index", help="folder to save the index to, or to load it from if it exists")
    ask.add_argument("--model", help="preset name, local checkpoint or hub id (default: the default preset)")
    ask.add_argument("--mode", default="blend", choices=["full", "prefix", "reuse", "blend"])
    ask.add_argument("--ratio", type=float, help="recompute ratio for blend (default 0.15)")
    ask.add_argument("--top-k", type=int, default=6, help="chunks retrieved per question")
    ask.add_argument("--chunk-tokens", type=int, default=512)
    ask.add_argument("--max-new-tokens", type=int, default=128)
    ask.add_argument("--temperature", type=float, default=0.0)
    ask.add_argument("--device", default="cpu")
    ask.add_argument("--dtype", default="float32")
    ask.add_argument("--lead-in", default=LEAD_IN_DEFAULT, help=LEAD_IN_HELP)
    ask.add_argument("--precompute-all", action="store_true", help="precompute KV of every chunk up front")
    ask.add_argument("--show-sources", action="store_true", help="print the retrieved chunks' sources")
    ask.add_argument("--kv-dir", help="keep chunk KV on disk in this folder, so later runs reuse it")
    ask.add_argument("--redis-url", help="share chunk KV through this Redis, e.g. redis://127.0.0.1:6379/0")
    ask.add_argument("--profile", help="a loading profile (`cacheblend-rag profile`): r is chosen per request")
    ask.add_argument("--min-ratio", type=float, default=0.15, help="with --profile: the quality floor r_min")
    ask.set_defaults(func=cmd_ask)

    prof = sub.add_parser("profile", help="measure blend compute and tier read speeds for the loading controller")
    prof.add_argument("--out", required=True, help="where to write the profile (JSON)")
    prof.add_argument("--model", help="preset name, local checkpoint or hub id (default: the default preset)")
    prof.add_argument("--device", default="cpu")
    prof.add_argument("--dtype", default="float32")
    prof.add_argument("--kv-dir", help="the disk tier's folder, to time the disk that will serve")
    prof.add_argument("--redis-url", help="the Redis tier to time, e.g. redis://127.0.0.1:6379/0")
    prof.add_argument("--token-counts", type=int, nargs="+", default=[1024, 2048, 4096])
    prof.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.15, 0.5])
    prof.add_argument("--chunk-tokens", type=int, default=512)
    prof.add_argument("--repeats", type=int, default=2)
    prof.set_defaults(func=cmd_profile)

    idx = sub.add_parser("index", help="build and save a chunk index of a folder")
    _add_document_arguments(idx, required=True)
    idx.add_argument("--out", required=True)
    idx.add_argument("--model", help="whose tokenizer measures chunk sizes (default: the default preset)")
    idx.add_argument("--chunk-tokens", type=int, default=512)
    idx.set_defaults(func=cmd_index)

    models = sub.add_parser("models", help="list the packaged model presets")
    models.set_defaults(func=cmd_models)

    from .evaluation.bench_cli import add_bench_parser

    add_bench_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CacheBlendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
