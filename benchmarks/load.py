"""Load with real concurrency: requests to one engine from many threads of one process, as a deployment sees them.

Every request is a RAG request (--chunks retrieved chunks from a warm pool + a question), read as a stream to its
end. Two ways to send them:
- `--arrivals closed` (the default): N clients, each sending a request, reading its stream to the end and sending
  the next, until it has sent --per-client requests; one row per client count (--concurrency).
- `--arrivals poisson`: an open loop. The calling thread sends --requests requests at exponential inter-arrival
  times (a Poisson process at each rate of --rates, in requests per minute; repeat r draws with --seed + r, the
  same draws at every rate and setting), each served by a thread of its own whatever is in flight; one row per rate.
Each setting is a way to serve them:
- `blend` / `full`: the prefill mode;
- `serial` (max_batch_size=1: one request at a time, in arrival order) or `batched` (max_batch_size=--batch:
  decode steps of all requests in flight run as one forward);
- `int8`: decode steps read int8 copies of the weights (`decode_weights="int8"`);
- `graphed` (CUDA only): batched, with decode steps replayed as CUDA graphs (`decode_graphs=True`).
With --cold-share F, that share of the requests (the same ones in every repeat) is cold: its chunks are texts the
engine has never stored (a pool chunk with a unique two-word tag in front), so it takes the miss policy's path
(--miss-policy; under the default "auto" a fully cold request is answered with a full prefill, whose chunk KV is
stored as --chunk-context says: "grouped", the engine's default, and "captured" keep every chunk from that prefill;
"isolated" keeps the first and prefills the others after the answer, in the background). Cold chunks are dropped from
the store after each run, so every run starts from the same warm pool. Such a row is named "SETTING, 25% cold".

Reports, per setting and load, answers per minute, generated tokens per second, TTFT p50/p90/p99 (from arrival,
queueing included) and time per output token; with --repeats R > 1 each as its mean and 95% t interval over the
repeats (`benchlib.load_report`). --check-serial re-serves, after the first repeat of each batched row, the same
requests one at a time (max_batch_size=1, the same store, each cold request's chunks dropped again first) and
counts the greedy answers that differ token for token ("differing answers: K of N"). Writes OUT/results.json,
summary.md and load.png.

    python benchmarks/load.py --concurrency 1,4,8 --settings blend-serial,blend-batched,full-batched
    python benchmarks/load.py --arrivals poisson --rates 0.5,1,2 --requests 16 --repeats 3 \\
        --settings blend-batched,full-batched
    python benchmarks/load.py --concurrency 8 --cold-share 0,0.25 --settings blend-batched --repeats 3
    python benchmarks/load.py --concurrency 16 --settings blend-batched --batch 16 --check-serial
    python benchmarks/load.py --random-weights --model-shape 7b --device cuda --dtype bfloat16 --concurrency 1,8,32
    python benchmarks/load.py --model smollm2-135m-instruct --concurrency 1,2 --chunk-tokens 64 --new-tokens 8 \\
        --per-client 1 --out /tmp/load       # a quick smoke run
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from benchlib.cli import add_out_argument, cpu_name, gap_list, model_name, number_list  # noqa: E402
from benchlib.load_report import load_axis, load_markdown, plot_load, row_label, summarize_runs  # noqa: E402
from benchlib.load_requests import QUESTIONS, Planned, plan_requests  # noqa: E402
from benchlib.queueing import poisson_arrivals  # noqa: E402
from benchlib.timing import RANDOM_SHAPES, add_data_dir_argument, build_engine, chunk_texts  # noqa: E402

from cacheblend_rag import CacheBlendEngine, EngineConfig, ServingConfig, StoreConfig  # noqa: E402
from cacheblend_rag.config import CHUNK_CONTEXTS, MISS_POLICIES  # noqa: E402

SETTINGS = {
    "blend-serial": dict(mode="blend", max_batch_size=1, decode_weights="native"),
    "blend-batched": dict(mode="blend", max_batch_size=None, decode_weights="native"),
    "full-serial": dict(mode="full", max_batch_size=1, decode_weights="native"),
    "full-batched": dict(mode="full", max_batch_size=None, decode_weights="native"),
    "blend-serial-int8": dict(mode="blend", max_batch_size=1, decode_weights="int8"),
    "blend-batched-int8": dict(mode="blend", max_batch_size=None, decode_weights="int8"),
    "full-batched-int8": dict(mode="full", max_batch_size=None, decode_weights="int8"),
    # CUDA only: decode steps replayed as CUDA graphs
    "blend-graphed": dict(mode="blend", max_batch_size=None, decode_weights="native", decode_graphs=True),
    "full-graphed": dict(mode="full", max_batch_size=None, decode_weights="native", decode_graphs=True),
}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def serve(engine: CacheBlendEngine, req: Planned, mode: str, new_tokens: int, arrived: float) -> dict:
    """One request streamed to its end. Its TTFT counts from `arrived` (perf_counter): the wait before the call,
    then the engine's own TTFT (queueing in the scheduler included)."""
    called = time.perf_counter()
    stream = engine.stream(list(req.chunks), req.question, mode=mode, max_new_tokens=new_tokens)
    seen = [time.perf_counter() for _ in stream]  # when each piece of text reached the reader
    result = stream.result
    m = result.metrics
    return dict(index=req.index, cold=req.cold, ttft_s=called - arrived + m.ttft_s, decode_s=m.decode_s,
                tokens=m.generated_tokens, chunks=len(req.chunks), chunks_hit=m.chunks_hit, end=time.perf_counter(),
                gaps=[b - a for a, b in itertools.pairwise(seen)], hosted=m.interleaved_steps,
                token_ids=list(result.token_ids))  # fmt: skip


def _join(threads: list[threading.Thread], errors: list[BaseException]) -> None:
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def run_closed(
    engine: CacheBlendEngine, requests: list[Planned], clients: int, per_client: int, mode: str, new_tokens: int
) -> tuple[list[dict], float]:
    """One closed-loop run: `clients` threads, client c sending requests c * per_client ... one after another.
    -> (records, wall time)."""
    records: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def client(c: int) -> None:
        start.wait()
        try:
            for req in requests[c * per_client : (c + 1) * per_client]:
                record = serve(engine, req, mode, new_tokens, time.perf_counter())
                with lock:
                    records.append(record)
        except BaseException as exc:  # raised again by the caller, after every client has stopped
            errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    _join(threads, errors)
    return records, time.perf_counter() - t0


def run_open(
    engine: CacheBlendEngine, requests: list[Planned], arrivals: Sequence[float], mode: str, new_tokens: int
) -> tuple[list[dict], float]:
    """One open-loop run: this thread starts request i at `arrivals[i]` seconds from now, on a thread of its own,
    whatever is still in flight. -> (records, first arrival to last token)."""
    records: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one(req: Planned, arrived: float) -> None:
        try:
            record = serve(engine, req, mode, new_tokens, arrived)
        except BaseException as exc:
            errors.append(exc)
            return
        with lock:
            records.append(record)

    threads = []
    t0 = time.perf_counter()
    for req, at in zip(requests, arrivals, strict=True):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=one, args=(req, t0 + at), name=f"request-{req.index}")
        t.start()
        threads.append(t)
    _join(threads, errors)
    return records, max(r["end"] for r in records) - t0


def figures(records: list[dict], wall: float, engine: CacheBlendEngine) -> dict:
    """What one run measured (floats are summarized over repeats; ints are counts)."""
    ttfts = [r["ttft_s"] for r in records]
    tpots = [r["decode_s"] / (r["tokens"] - 1) for r in records if r["tokens"] > 1]
    gaps = [g for r in records for g in r["gaps"]]
    return dict(
        wall_s=wall,
        answers_per_min=60 * len(records) / wall,
        tokens_per_s=sum(r["tokens"] for r in records) / wall,
        ttft_p50=percentile(ttfts, 0.5),
        ttft_p90=percentile(ttfts, 0.9),
        ttft_p99=percentile(ttfts, 0.99),
        tpot_s=statistics.mean(tpots) if tpots else float("nan"),
        gap_p99_s=percentile(gaps, 0.99) if gaps else float("nan"),  # between two pieces of one streamed answer
        gap_max_s=max(gaps) if gaps else float("nan"),
        hosted_steps=sum(r["hosted"] for r in records),
        hit_share=sum(r["chunks_hit"] for r in records) / sum(r["chunks"] for r in records),  # chunks from the store
        largest_batch=engine.scheduler.largest_batch,
        requests=len(records),
        cold_requests=sum(r["cold"] for r in records),
    )


def forget_cold(engine: CacheBlendEngine, requests: Sequence[Planned]) -> None:
    """Drop the chunks the cold requests stored (after their background fills end): the warm pool alone stays."""
    engine.wait_for_fills()
    for req in requests:
        if req.cold:
            prompt = engine.build_prompt(list(req.chunks), req.question)
            for ids in prompt.chunk_ids:
                for captured in (False, True):
                    engine.store.discard(engine.chunk_key(prompt.prefix_ids, ids, captured=captured))


def check_serial(
    alone: CacheBlendEngine, requests: Sequence[Planned], records: list[dict], mode: str, new_tokens: int
) -> dict:
    """Serve `requests` again one at a time on `alone` (max_batch_size=1, the same store; the cold requests' chunks
    dropped, so each takes the path it took) and count the answers that differ token for token from `records`."""
    served = {r["index"]: r["token_ids"] for r in records}
    differing = 0
    for req in requests:
        result = alone.generate(list(req.chunks), req.question, mode=mode, max_new_tokens=new_tokens)
        if req.cold and result.metrics.chunks_hit:
            raise RuntimeError(f"cold request {req.index} found {result.metrics.chunks_hit} chunks stored")
        differing += list(result.token_ids) != served[req.index]
    forget_cold(alone, requests)
    return dict(differing=differing, checked=len(requests))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before any model loads."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="preset or checkpoint (default: the default preset)")
    p.add_argument("--random-weights", action="store_true", help="random weights of --model-shape (GPU timing)")
    p.add_argument("--model-shape", default="7b", choices=sorted(RANDOM_SHAPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--memory-gb", type=float, default=2.0, help="memory tier budget (the pool must fit to stay warm)")
    p.add_argument("--arrivals", default="closed", choices=("closed", "poisson"),
                   help="closed: --concurrency clients, each sending its next request when an answer ends; "
                   "poisson: --requests requests arriving at each of --rates")  # fmt: skip
    p.add_argument("--concurrency", default="1,4,8", help="client counts, comma-separated (closed)")
    p.add_argument("--per-client", type=int, default=1, help="requests each client sends, one after another (closed)")
    p.add_argument("--rates", default="0.5,1,2", help="arrival rates in requests per minute, comma-separated (poisson)")
    p.add_argument("--requests", type=int, default=16, help="requests per rate and repeat (poisson)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times (repeat r: seed + r) and cold picks")
    p.add_argument("--settings", default="blend-serial,blend-batched,full-batched", help=f"of {', '.join(SETTINGS)}")
    p.add_argument("--token-gaps", default="none",
                   help="max_token_gap_s of the batched settings, comma-separated: 'none' (a prefill runs to its end "
                   "first) or seconds, e.g. none,0.5")  # fmt: skip
    p.add_argument("--cold-share", default="0", help="shares (0..1) of cold requests, comma-separated: 0,0.25")
    p.add_argument("--miss-policy", default="auto", choices=MISS_POLICIES, help="what a cold request does")
    p.add_argument("--chunk-context", default="grouped", choices=tuple(CHUNK_CONTEXTS),
                   help="how chunk KV is cached, and what a cold request's full prefill stores")  # fmt: skip
    p.add_argument("--check-serial", action="store_true",
                   help="re-serve each batched row's requests alone and count differing greedy answers")  # fmt: skip
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--pool", type=int, default=24, help="distinct chunks the requests draw from (all warm)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="max_batch_size of the batched settings")
    p.add_argument("--repeats", type=int, default=1, help="runs per row; from 2 on, 95%% t intervals over them")
    add_out_argument(p, "load", "where the load results go")
    add_data_dir_argument(p)
    args = p.parse_args(argv)
    unknown = [s for s in args.settings.split(",") if s not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}")
    args.settings = args.settings.split(",")
    if args.arrivals == "closed":
        args.loads = number_list(p, "--concurrency", args.concurrency, int, lambda c: c >= 1, "client counts >= 1")
    else:
        args.loads = number_list(p, "--rates", args.rates, float, lambda r: 0 < r < float("inf"),
                                 "rates > 0 per minute")  # fmt: skip
    args.token_gaps = gap_list(p, args.token_gaps)
    args.cold_shares = number_list(p, "--cold-share", args.cold_share, float, lambda f: 0 <= f <= 1,
                                   "shares in [0, 1]")  # fmt: skip
    for option in ("per_client", "requests", "repeats", "chunks", "pool", "new_tokens", "batch"):
        if getattr(args, option) < 1:
            p.error(f"--{option.replace('_', '-')} must be >= 1, got {getattr(args, option)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    label = f"random-{args.model_shape}" if args.random_weights else model_name(args.model)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_name()
    results = dict(model=label, cpu=device, device=args.device, dtype=args.dtype, threads=torch.get_num_threads(),
                   chunks=args.chunks, chunk_tokens=args.chunk_tokens, new_tokens=args.new_tokens,
                   repeats=args.repeats, arrivals=args.arrivals, miss_policy=args.miss_policy,
                   chunk_context=args.chunk_context,
                   interval="95% Student t over the repeats (from 2 repeats on)", rows=[])  # fmt: skip
    if args.arrivals == "poisson":
        results.update(requests=args.requests, seed=args.seed)
    key, _ = load_axis(results)
    base = build_engine(args, args.dtype, store=StoreConfig(memory_budget_bytes=int(args.memory_gb * 2**30)))
    if args.random_weights:  # one token per word "wN"
        g = torch.Generator().manual_seed(1)
        pool = [" ".join(f"w{int(i)}" for i in torch.randint(2, 32000, (args.chunk_tokens,), generator=g))
                for _ in range(args.pool)]  # fmt: skip
    else:
        data = Path(args.data_dir) if args.data_dir else None
        pool = chunk_texts(base.tokenizer, args.pool, args.chunk_tokens, data)
    base.precompute(pool, QUESTIONS[0])

    def engine_for(spec: dict, max_batch: int, gap: float | None = None) -> CacheBlendEngine:
        serving = ServingConfig(
            max_batch_size=max_batch,
            decode_weights=spec["decode_weights"],
            decode_graphs=spec.get("decode_graphs", False),
            max_token_gap_s=gap,
        )
        config = EngineConfig(device=args.device, dtype=args.dtype, miss_policy=args.miss_policy,
                              chunk_context=args.chunk_context, serving=serving)  # fmt: skip
        return CacheBlendEngine(base.model, base.tokenizer, config=config, store=base.store)  # same warm store

    alone: dict[str, CacheBlendEngine] = {}  # by decode weights: the engines of --check-serial
    fresh = itertools.count()  # tags of cold chunks, never reused
    # one request at a time: nothing decodes while a prefill runs, so a serial setting has no gap to vary
    serial = {s for s in args.settings if SETTINGS[s]["max_batch_size"] == 1}
    served = [(s, g) for s in args.settings for g in ([None] if s in serial else args.token_gaps)]
    for setting, gap in served:
        spec = SETTINGS[setting]
        engine = engine_for(spec, spec["max_batch_size"] or args.batch, gap)
        engine.generate(pool[: args.chunks], QUESTIONS[0], mode=spec["mode"], max_new_tokens=2)  # warm the path
        for share, load in itertools.product(args.cold_shares, args.loads):
            row = dict(setting=setting, token_gap=gap, cold_share=share, **{key: load})
            runs = []
            for repeat in range(args.repeats):
                n = load * args.per_client if args.arrivals == "closed" else args.requests
                requests = plan_requests(pool, n, args.chunks, share, args.seed, fresh)
                engine.scheduler.largest_batch = 0
                if args.arrivals == "closed":
                    records, wall = run_closed(engine, requests, load, args.per_client, spec["mode"], args.new_tokens)
                else:
                    arrivals = poisson_arrivals(n, load / 60, seed=args.seed + repeat)
                    records, wall = run_open(engine, requests, arrivals, spec["mode"], args.new_tokens)
                forget_cold(engine, requests)
                runs.append(figures(records, wall, engine))
                if args.check_serial and repeat == 0 and spec["max_batch_size"] != 1:
                    if spec["decode_weights"] not in alone:
                        alone[spec["decode_weights"]] = engine_for(spec, 1)
                    check = check_serial(alone[spec["decode_weights"]], requests, records, spec["mode"],
                                         args.new_tokens)  # fmt: skip
                    row["serial_check"] = check
                    print(f"{row_label(row)} {load:g}: differing answers: {check['differing']} of {check['checked']}",
                          flush=True)  # fmt: skip
            row.update(runs=runs, summary=summarize_runs(runs))
            results["rows"].append(row)
            print(row_label(row), f"{load:g}", {k: round(v["mean"], 3) for k, v in row["summary"].items()}, flush=True)
            (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "summary.md").write_text(load_markdown(results))
    plot_load(results, out / "load.png")
    print(load_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
