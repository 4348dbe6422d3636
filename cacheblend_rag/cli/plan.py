"""`cacheblend-rag plan --docs DIR --questions FILE`: how large a chunk store your traffic needs.

It indexes --docs as `ask` does (or loads --index), retrieves every question's top-k chunks, and sends them, in the
file's order, through a simulated store at several budgets (`cacheblend_rag.sizing`). It prints the bytes a chunk's
KV takes, and per budget the chunk hit rate and the expected time-to-first-token speed-up over full prefill, from a
cost model: the one given with --costs, one measured now with --measure-costs, or the reference one. No model runs
unless --measure-costs asks for it; only the tokenizer and the model's config are read.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

from ..errors import CacheBlendError
from .args import check_model_name, check_numbers
from .sources import build_index, read_sources

__all__ = ["cmd_plan", "tokenizer_and_config"]

MAX_QUESTIONS_BYTES = 64 * 2**20
COST_PROMPTS = 4  # prompts --measure-costs times


def tokenizer_and_config(model: str | None) -> tuple[Any, Any]:
    """The model's tokenizer and config, without its weights where a converted copy or a local folder has them."""
    from transformers import AutoConfig, AutoTokenizer

    from ..models import load_model
    from ..models.gguf import preset_cache_dir
    from ..models.presets import default_model, find_preset

    name = model or default_model()
    preset = find_preset(name)
    folder = preset_cache_dir(preset) / "hf" if preset is not None else Path(name)
    if (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder)
    loaded, tokenizer = load_model(name)  # a preset not converted yet, or a hub id: loaded once
    return tokenizer, loaded.config


def read_questions(path: str) -> list[str]:
    from ..controller.profile_io import read_small_text_file

    text = read_small_text_file(Path(path), "a questions file", MAX_QUESTIONS_BYTES)
    questions = [" ".join(line.split()) for line in text.splitlines()]
    questions = [q for q in questions if q]
    if not questions:
        raise CacheBlendError(f"--questions {path!r} holds no questions; write one question per line")
    return questions


def _costs(args: argparse.Namespace, index: Any, questions: list[str]):
    from ..sizing import REFERENCE_COSTS, CostModel, measure_costs

    if args.measure_costs:
        from ..config import EngineConfig
        from ..engine import CacheBlendEngine

        engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig(dtype=args.dtype))
        sample = random.Random(0).sample(questions, min(COST_PROMPTS, len(questions)))
        prompts = [([h.chunk.text for h in index.search(q, k=args.top_k)], q) for q in sample]
        costs = measure_costs(engine, prompts, model=args.model or "default preset")
        costs.save(args.measure_costs)
        engine.close()
        print(f"cost model saved to {args.measure_costs}", file=sys.stderr)
        return costs
    if args.costs:
        return CostModel.load(args.costs)
    print(f"using the reference cost model ({REFERENCE_COSTS.model}, {REFERENCE_COSTS.machine}); pass --costs or "
          "--measure-costs for this machine's", file=sys.stderr)  # fmt: skip
    return REFERENCE_COSTS


def cmd_plan(args: argparse.Namespace) -> int:
    from ..retrieval import MIN_CHUNK_TOKENS
    from ..sizing import KVShape, format_plan, plan_store

    check_numbers(("--top-k", args.top_k, 1), ("--chunk-tokens", args.chunk_tokens, MIN_CHUNK_TOKENS),
                  ("--max-doc-mb", args.max_doc_mb, 0), *(("--budgets", b, 0) for b in args.budgets))  # fmt: skip
    check_model_name(args.model)
    from ..config import normalize_dtype_name

    args.dtype = normalize_dtype_name(args.dtype)  # "auto": what an engine here would run
    if args.costs and args.measure_costs:
        raise CacheBlendError("give --costs (a saved cost model) or --measure-costs (measure one now), not both")
    questions = read_questions(args.questions)
    sources = read_sources(args)
    tokenizer, config = tokenizer_and_config(args.model)
    index = build_index(args, sources, tokenizer)
    costs = _costs(args, index, questions)
    shape = KVShape.of_config(config, args.dtype, args.codec)
    stream = "clustered" if args.order == "as-given" else "uniform"
    plan = plan_store(index, questions, tokenizer, shape, costs, top_k=args.top_k, shares=(*args.budgets, None),
                      eviction=args.eviction, stream=stream)  # fmt: skip
    print(format_plan(plan))
    return 0
