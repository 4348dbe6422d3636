"""`cacheblend-rag ask --docs DIR "question"`: answer questions over a folder of text files.

`ask` reads the text files of a folder, splits them into chunks, indexes them (FAISS + all-MiniLM-L6-v2),
retrieves the top-k chunks for each question and answers with the chosen prefill mode on the chosen model,
printing the answer and the request's metrics. A chunk's KV is computed by the first request that retrieves it
(and counted in that request's TTFT); later questions in one call, or later calls with --kv-dir / --redis-url,
show chunk hits. Where the chunks come from is in `sources.py`.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import warnings

from ..config.device import resolve_device
from ..config.dtype import normalize_dtype_name
from ..cpu import SLOW_BF16_WARNING, cpu_has_bf16
from .args import check_kv_dir, check_model_name, check_numbers, guard_from_args
from .precompute_all import precompute_after_answers
from .sources import build_index, index_context, read_sources

__all__ = ["cmd_ask", "engine_config"]


def engine_config(args: argparse.Namespace):
    """The EngineConfig `ask`'s options name, checked before any model loads."""
    from ..config import BlendConfig, EngineConfig, ServingConfig, StoreConfig

    blend = BlendConfig(recompute_ratio=args.ratio) if args.ratio is not None else BlendConfig()
    check_model_name(args.model)
    check_kv_dir(args)
    slow_bf16 = str(args.dtype).lower() in ("bfloat16", "bf16") and cpu_has_bf16() is False
    if slow_bf16 and resolve_device(args.device) == "cpu":
        print("warning: this CPU has no bf16 matrix instructions (amx_bf16 / avx512_bf16): bfloat16 runs several "
              "times slower than float32 here; drop --dtype bfloat16", file=sys.stderr)  # fmt: skip
    return EngineConfig(
        device=args.device,
        dtype=args.dtype,
        blend=blend,
        store=StoreConfig(disk_dir=args.kv_dir, redis_url=args.redis_url),
        miss_policy=args.miss_policy,
        guard=guard_from_args(args),
        chunk_context=args.chunk_context,
        serving=ServingConfig(decode_weights=args.decode_weights),
    )


ECHO_CHARS = 200  # the most of a question the `Q:` line shows


def echoed(question: str, limit: int = ECHO_CHARS) -> str:
    """A question as the `Q:` line shows it: whole up to `limit` characters, else its start and its length."""
    if len(question) <= limit:
        return question
    return f"{question[:limit].rstrip()}... ({len(question):,} characters)"


def cmd_ask(args: argparse.Namespace) -> int:
    from ..engine import CacheBlendEngine
    from ..retrieval import MIN_CHUNK_TOKENS

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
    config = engine_config(args)
    fidelity, min_ratio = None, args.min_ratio
    if args.fidelity_profile:
        from .calibrate import apply_fidelity_profile

        # The fidelity choice sets r and the guard; with a loading profile it is the floor: r = max(it, r_load).
        config, fidelity = apply_fidelity_profile(args, config)
        min_ratio = fidelity.choice.min_ratio
    controller = None
    if args.profile:
        from ..controller import LoadingController, LoadingProfile

        # --ratio, when given, pins r: the engine then uses it as is and the controller stays out of the way.
        controller = LoadingController(LoadingProfile.load(args.profile), min_ratio=min_ratio)
    sources = read_sources(args)
    t = time.perf_counter()
    with warnings.catch_warnings():  # engine_config has said it, before the load: once is enough
        warnings.filterwarnings("ignore", message=re.escape(SLOW_BF16_WARNING))
        engine = CacheBlendEngine.from_pretrained(args.model, config=config, controller=controller)
    running = f"{normalize_dtype_name(engine.lm.dtype)} on {engine.lm.device}"  # dtype="auto" resolved
    print(f"model {args.model or 'default preset'} ready in {time.perf_counter() - t:.1f}s ({running})",
          file=sys.stderr)  # fmt: skip
    if fidelity is not None:
        fidelity.profile.check_model(engine.fingerprint, engine.config.dtype)
    index = build_index(args, sources, engine.tokenizer)
    context = index_context(engine)  # in groups of similar chunks of the index (--chunk-context grouped), or alone
    answered = []  # the answers' metrics: their prefills time --precompute-all's estimate
    for question in args.questions:
        hits = index.search(question, k=args.top_k)
        print(f"\nQ: {echoed(question)}")
        if args.show_sources:
            for h in hits:
                print(f"   [{h.score:.3f}] {h.chunk.source} #{h.chunk.index}")
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
        started = False  # "A: " comes with the first piece, after what the prefill logs (e.g. entries of another dtype)
        try:
            for piece in stream:
                print(("" if started else "A: ") + piece, end="", flush=True)
                started = True
        finally:
            print("" if started else "A: ", flush=True)  # the answer's line ends, even when Ctrl-C cuts it short
        assert stream.result is not None, "a finished stream holds its result"
        print(f"   {stream.result.metrics.summary()}")
        answered.append(stream.result.metrics)
    engine.wait_for_fills()  # chunks cold questions were answered without: stored after each answer, in the background
    if args.precompute_all:
        precompute_after_answers(args, engine, index, context, answered)
    engine.store.flush()  # chunk KV written to disk/Redis in the background must land before the process exits
    return 0
