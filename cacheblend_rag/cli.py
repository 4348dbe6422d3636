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

from .errors import CacheBlendError


def _engine_config(args: argparse.Namespace):
    from .config import BlendConfig, EngineConfig

    blend = BlendConfig(recompute_ratio=args.ratio) if args.ratio is not None else BlendConfig()
    return EngineConfig(
        device=args.device, dtype=args.dtype, blend=blend, disk_dir=args.kv_dir, redis_url=args.redis_url
    )


def _load_index(args: argparse.Namespace, tokenizer):
    from .retrieval import ChunkIndex, build_index_from_folder

    if args.index and os.path.isdir(args.index) and os.listdir(args.index):
        index = ChunkIndex.load(args.index)
        print(f"loaded index of {len(index)} chunks from {args.index}", file=sys.stderr)
        return index
    if not args.docs:
        raise CacheBlendError("give --docs DIR (the text files to answer from), or --index of a saved index")
    index = build_index_from_folder(args.docs, tokenizer, chunk_tokens=args.chunk_tokens, show_progress=True)
    print(f"indexed {len(index)} chunks from {args.docs}", file=sys.stderr)
    if args.index:
        index.save(args.index)
        print(f"saved the index to {args.index}", file=sys.stderr)
    return index


def cmd_ask(args: argparse.Namespace) -> int:
    from .engine import CacheBlendEngine

    t = time.perf_counter()
    engine = CacheBlendEngine.from_pretrained(args.model, config=_engine_config(args))
    print(f"model {args.model or 'default preset'} ready in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    index = _load_index(args, engine.tokenizer)
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
    flush = getattr(engine.store, "flush", None)
    if flush is not None:
        flush()  # chunk KV written to disk/Redis in the background must land before the process exits
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    from .models import load_model
    from .retrieval import build_index_from_folder

    _, tokenizer = load_model(args.model) if args.model else load_model()
    index = build_index_from_folder(args.docs, tokenizer, chunk_tokens=args.chunk_tokens, show_progress=True)
    index.save(args.out)
    print(f"indexed {len(index)} chunks from {args.docs} into {args.out}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from .models import DEFAULT_PRESET, PRESETS

    for name, preset in PRESETS.items():
        mark = " (default)" if name == DEFAULT_PRESET else ""
        print(f"{name}{mark}: {preset.description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cacheblend-rag", description="CacheBlend RAG on Hugging Face models")
    sub = p.add_subparsers(dest="command", required=True)

    ask = sub.add_parser("ask", help="answer questions over a folder of text files")
    ask.add_argument("questions", nargs="+", help="one or more questions")
    ask.add_argument("--docs", help="folder (or file) of .txt/.md/.rst documents")
    ask.add_argument("--index", help="folder to save the index to, or to load it from if it exists")
    ask.add_argument("--model", help="preset name or local checkpoint (default: the default preset)")
    ask.add_argument("--mode", default="blend", choices=["full", "prefix", "reuse", "blend"])
    ask.add_argument("--ratio", type=float, help="recompute ratio for blend (default 0.15)")
    ask.add_argument("--top-k", type=int, default=6, help="chunks retrieved per question")
    ask.add_argument("--chunk-tokens", type=int, default=512)
    ask.add_argument("--max-new-tokens", type=int, default=128)
    ask.add_argument("--temperature", type=float, default=0.0)
    ask.add_argument("--device", default="cpu")
    ask.add_argument("--dtype", default="float32")
    ask.add_argument("--precompute-all", action="store_true", help="precompute KV of every chunk up front")
    ask.add_argument("--show-sources", action="store_true", help="print the retrieved chunks' sources")
    ask.add_argument("--kv-dir", help="keep chunk KV on disk in this folder, so later runs reuse it")
    ask.add_argument("--redis-url", help="share chunk KV through this Redis, e.g. redis://127.0.0.1:6379/0")
    ask.set_defaults(func=cmd_ask)

    idx = sub.add_parser("index", help="build and save a chunk index of a folder")
    idx.add_argument("--docs", required=True)
    idx.add_argument("--out", required=True)
    idx.add_argument("--model", help="whose tokenizer measures chunk sizes (default: the default preset)")
    idx.add_argument("--chunk-tokens", type=int, default=512)
    idx.set_defaults(func=cmd_index)

    models = sub.add_parser("models", help="list the packaged model presets")
    models.set_defaults(func=cmd_models)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CacheBlendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
