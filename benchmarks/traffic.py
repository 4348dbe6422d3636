"""Real questions over a real corpus with a store that cannot hold it all: SQuAD 2.0 dev (1,204 paragraphs, 11,873
questions), each question retrieving its top-k paragraphs (FAISS + the packaged MiniLM) into one engine.

Streams: "clustered" (the file's order: questions of one article, and of one paragraph, together), "uniform" (a
seeded shuffle), "zipf" (articles drawn Zipf-skewed, a random question of each). Budgets are shares of the corpus's
KV (one entry per paragraph, in the memory tier's codec).

    python benchmarks/traffic.py real --questions 200            # the default model: cost model, full sample, runs
    python benchmarks/traffic.py simulate                         # every stream, budget, policy and seed; seconds
    python benchmarks/traffic.py report                           # tables and figures from both
    python benchmarks/traffic.py export --out /tmp/squad-plan     # docs/ and questions.txt for `cacheblend-rag plan`

Everything lands in --out (default benchmarks/results/traffic); the index and retrievals in --work.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchlib.traffic_data import chunk_index, export_corpus, load_squad, retrievals
from benchlib.traffic_real import read_records, run_stream, time_full_sample
from benchlib.traffic_report import write_report
from benchlib.traffic_sim import budget_bytes, corpus_bytes, simulate_grid, stream_requests

from cacheblend_rag.config import normalize_dtype_name
from cacheblend_rag.sizing import STREAMS, CostModel, KVShape, machine_name, measure_costs, prompt_lengths

SHARES = (0.05, 0.10, 0.25, 0.50, 1.00, None)


def _tokenizer_and_shape(model: str | None, dtype: str):
    from transformers import AutoConfig

    from cacheblend_rag.testing import default_preset_tokenizer

    tokenizer = default_preset_tokenizer() if model is None else None
    if tokenizer is None:
        raise SystemExit("load the model once (cacheblend-rag ask ...) so that its tokenizer is cached")
    config = AutoConfig.from_pretrained(tokenizer.name_or_path, local_files_only=True)
    return tokenizer, KVShape.of_config(config, dtype)


def _setup(args):
    squad = load_squad(args.data_dir)
    tokenizer, shape = _tokenizer_and_shape(args.model, args.dtype)
    args.work.mkdir(parents=True, exist_ok=True)
    index = chunk_index(squad, tokenizer, args.work)
    found = retrievals(squad, index, args.top_k, args.work)
    lengths = prompt_lengths(tokenizer, squad.paragraphs, squad.questions)
    return squad, tokenizer, shape, found, lengths


def cmd_real(args) -> None:
    from cacheblend_rag import CacheBlendEngine, EngineConfig

    squad, _, shape, found, lengths = _setup(args)
    corpus = corpus_bytes(lengths, shape)
    engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig(dtype=args.dtype), show_progress=False)
    costs_path = args.out / "costs.json"
    rng = random.Random(0)
    sample = rng.sample(range(len(squad.questions)), args.full_sample)
    prompts = [(q, [squad.paragraphs[c] for c in found[q]], squad.questions[q]) for q in sample]
    if not costs_path.is_file():
        print(f"measuring the cost model on {args.cost_prompts} prompts", file=sys.stderr)
        costs = measure_costs(engine, [p[1:] for p in prompts[: args.cost_prompts]], model=args.model or "default")
        costs.save(costs_path)
    time_full_sample(engine, prompts, args.out / "real.jsonl")
    for stream in args.streams:
        order, _, _ = stream_requests(stream, args.seed, squad.question_article, found, lengths, args.questions)
        for share in args.shares:
            run = f"{stream}-s{args.seed}-b{share:g}-{args.eviction}"
            run_stream(engine, run, order, found, squad.paragraphs, squad.questions, budget_bytes(share, corpus),
                       args.eviction, args.out / "real.jsonl")  # fmt: skip
    engine.close()


def cmd_simulate(args) -> None:
    squad, _, shape, found, lengths = _setup(args)
    costs = CostModel.load(args.costs or args.out / "costs.json")
    shares = tuple(args.grid_shares) if args.grid_shares else SHARES
    rows = simulate_grid(args.streams, args.seeds, shares, args.policies, squad.question_article, found, lengths,
                         shape, costs, length=args.questions)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "simulated.json"
    meta = dict(machine=machine_name(), corpus_bytes=corpus_bytes(lengths, shape),
                bytes_per_token=shape.bytes_per_token, chunks=len(lengths.chunks), questions=len(squad.questions),
                top_k=args.top_k)  # fmt: skip
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"{len(rows)} simulated rows -> {path}")


def cmd_report(args) -> None:
    squad, _, shape, found, lengths = _setup(args)
    costs = CostModel.load(args.costs or args.out / "costs.json")
    write_report(args.out, read_records(args.out / "real.jsonl"), squad, found, lengths, shape, costs)


def cmd_export(args) -> None:
    docs, questions = export_corpus(load_squad(args.data_dir), args.export_to)
    print(f"{docs} and {questions} written")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("real", "simulate", "report", "export"))
    p.add_argument("--data-dir", type=Path, default=os.environ.get("CACHEBLEND_RAG_DATA"),
                   help="folder with the SQuAD file (default: $CACHEBLEND_RAG_DATA)")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/traffic"), help="(default: %(default)s)")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "cacheblend-rag" / "traffic",
                   help="the index and retrievals, kept between runs (default: %(default)s)")  # fmt: skip
    p.add_argument("--export-to", type=Path, default=Path("/tmp/squad-plan"), help="(export; default: %(default)s)")
    p.add_argument("--model", default=None, help="(default: the default preset)")
    p.add_argument("--dtype", default="auto", help="the engine's dtype (default: what auto picks on this machine)")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--questions", type=int, default=None, help="requests per stream (default: real 500, simulate all)")
    p.add_argument("--streams", nargs="+", default=None, choices=STREAMS)
    p.add_argument("--shares", nargs="+", type=float, default=[0.25, 1.0], help="real runs' budgets (of corpus KV)")
    p.add_argument("--grid-shares", nargs="+", type=float,
                   help="simulate's budgets (of corpus KV; default: 5, 10, 25, 50, 100%% and unbounded); e.g. a "
                   "smaller codec's 25%% of int8's bytes is 25%% x (int8 bytes / its bytes) of its corpus")  # fmt: skip
    p.add_argument("--eviction", default="lfu", help="the real runs' memory_eviction (default: %(default)s)")
    p.add_argument("--policies", nargs="+", default=["lru", "lfu"], help="simulated eviction policies")
    p.add_argument("--seed", type=int, default=0, help="the real runs' stream seed")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4], help="simulated stream seeds")
    p.add_argument("--full-sample", type=int, default=24, help="prompts timed as full prefills (real)")
    p.add_argument("--cost-prompts", type=int, default=6, help="of those, prompts the cost model is measured on")
    p.add_argument("--costs", type=Path, default=None, help="a saved cost model (default: --out/costs.json)")
    args = p.parse_args()
    args.dtype = normalize_dtype_name(args.dtype)
    if args.data_dir is None and args.command != "report":
        p.error("give --data-dir DIR (the folder with the SQuAD file) or set CACHEBLEND_RAG_DATA")
    if args.command == "real":
        args.questions = args.questions or 500
        args.streams = args.streams or ["zipf", "clustered"]
    args.streams = args.streams or list(STREAMS)
    {"real": cmd_real, "simulate": cmd_simulate, "report": cmd_report, "export": cmd_export}[args.command](args)


if __name__ == "__main__":
    main()
