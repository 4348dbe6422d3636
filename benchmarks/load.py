"""Load with real concurrency: N clients in one process, each sending RAG requests to one engine, closed loop.

Every client sends a request (6 retrieved chunks from a warm pool + a question), reads its stream to the end, and
sends the next, until it has sent --per-client requests. Each setting is a way to serve them:
- `blend` / `full`: the prefill mode;
- `serial` (max_batch_size=1: one request at a time, in arrival order) or `batched` (max_batch_size=--batch:
  decode steps of all requests in flight run as one forward);
- `int8`: decode steps read int8 copies of the weights (`decode_weights="int8"`).
Reports, per setting and concurrency, answers per minute, generated tokens per second, TTFT p50/p90/p99 (from
arrival, queueing included) and time per output token, with the spread over --repeats. Writes OUT/results.json,
summary.md and load.png.

    python benchmarks/load.py --concurrency 1,4,8 --settings blend-serial,blend-batched,full-batched
    python benchmarks/load.py --random-weights --model-shape 7b --device cuda --dtype bfloat16 --concurrency 1,8,32
    python benchmarks/load.py --model smollm2-135m-instruct --concurrency 1,2 --chunk-tokens 64 --new-tokens 8 \\
        --per-client 1 --out /tmp/load       # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from benchlib.cli import add_out_argument, model_name  # noqa: E402
from benchlib.timing import RANDOM_SHAPES, add_data_dir_argument, build_engine, chunk_texts  # noqa: E402

from cacheblend_rag import CacheBlendEngine, EngineConfig  # noqa: E402

SETTINGS = {
    "blend-serial": dict(mode="blend", max_batch_size=1, decode_weights="native"),
    "blend-batched": dict(mode="blend", max_batch_size=None, decode_weights="native"),
    "full-serial": dict(mode="full", max_batch_size=1, decode_weights="native"),
    "full-batched": dict(mode="full", max_batch_size=None, decode_weights="native"),
    "blend-serial-int8": dict(mode="blend", max_batch_size=1, decode_weights="int8"),
    "blend-batched-int8": dict(mode="blend", max_batch_size=None, decode_weights="int8"),
}
QUESTIONS = [
    "Which people are named in these passages, and what did they do?",
    "What places do these passages mention?",
    "Summarize what these passages say about history.",
    "Which dates appear in these passages, and what happened then?",
]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def run_level(engine: CacheBlendEngine, pool: list[str], clients: int, per_client: int, args, mode: str) -> dict:
    """One closed-loop run: `clients` threads, each sending `per_client` requests one after another."""
    records: list[dict] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def client(c: int) -> None:
        start.wait()
        for r in range(per_client):
            i = c * per_client + r
            chunks = [pool[(i * 5 + j * 7) % len(pool)] for j in range(args.chunks)]
            stream = engine.stream(chunks, QUESTIONS[i % len(QUESTIONS)], mode=mode, max_new_tokens=args.new_tokens)
            for _ in stream:
                pass
            m = stream.result.metrics
            with lock:
                records.append(dict(ttft_s=m.ttft_s, decode_s=m.decode_s, tokens=m.generated_tokens, end=time.time()))

    t0 = time.time()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - t0
    ttfts = [r["ttft_s"] for r in records]
    tpots = [r["decode_s"] / (r["tokens"] - 1) for r in records if r["tokens"] > 1]
    return dict(
        wall_s=wall,
        answers_per_min=60 * len(records) / wall,
        tokens_per_s=sum(r["tokens"] for r in records) / wall,
        ttft_p50=percentile(ttfts, 0.5),
        ttft_p90=percentile(ttfts, 0.9),
        ttft_p99=percentile(ttfts, 0.99),
        tpot_s=statistics.mean(tpots) if tpots else float("nan"),
        largest_batch=engine.scheduler.largest_batch,
        requests=len(records),
    )


def summarize(runs: list[dict]) -> dict:
    """Mean and (min, max) over repeats of each figure."""
    keys = [k for k in runs[0] if isinstance(runs[0][k], float)]
    return {k: dict(mean=statistics.mean(r[k] for r in runs), lo=min(r[k] for r in runs),
                    hi=max(r[k] for r in runs)) for k in keys}  # fmt: skip


def markdown(results: dict) -> str:
    lines = [
        f"Model {results['model']}, {results['cpu']}, torch threads {results['threads']}; {results['chunks']} chunks "
        f"of {results['chunk_tokens']} tokens, answers up to {results['new_tokens']} tokens, chunks warm; "
        f"{results['repeats']} repeat(s), min-max in brackets.",
        "",
        "| setting | clients | answers/min | generated tok/s | TTFT p50 (s) | TTFT p90 (s) | TTFT p99 (s) | s/token |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(s: dict, k: str, d: int = 2) -> str:
        return f"{s[k]['mean']:.{d}f} [{s[k]['lo']:.{d}f}, {s[k]['hi']:.{d}f}]"

    for row in results["rows"]:
        s = row["summary"]

        def f(k: str, d: int = 2, s: dict = s) -> str:
            return cell(s, k, d)

        lines.append(f"| {row['setting']} | {row['clients']} | {f('answers_per_min')} | {f('tokens_per_s')} | "
                     f"{f('ttft_p50', 1)} | {f('ttft_p90', 1)} | {f('ttft_p99', 1)} | {f('tpot_s', 3)} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for setting in dict.fromkeys(r["setting"] for r in results["rows"]):
        rows = [r for r in results["rows"] if r["setting"] == setting]
        xs = [r["clients"] for r in rows]
        for ax, key in zip(axes, ("tokens_per_s", "ttft_p90"), strict=True):
            mean = [r["summary"][key]["mean"] for r in rows]
            err = [[m - r["summary"][key]["lo"] for m, r in zip(mean, rows, strict=True)],
                   [r["summary"][key]["hi"] - m for m, r in zip(mean, rows, strict=True)]]  # fmt: skip
            ax.errorbar(xs, mean, yerr=err, marker="o", capsize=3, label=setting)
    axes[0].set(xlabel="concurrent clients", ylabel="generated tokens / s", title="Throughput")
    axes[1].set(xlabel="concurrent clients", ylabel="TTFT p90 (s)", title="Time to first token (p90)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                flags = Path("/proc/cpuinfo").read_text()
                extra = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
                return f"{line.split(':', 1)[1].strip()} ({', '.join(extra) or 'no AVX-512/AMX'})"
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="preset or checkpoint (default: the default preset)")
    p.add_argument("--random-weights", action="store_true", help="random weights of --model-shape (GPU timing)")
    p.add_argument("--model-shape", default="7b", choices=sorted(RANDOM_SHAPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--memory-gb", type=float, default=2.0, help="memory tier budget (the pool must fit to stay warm)")
    p.add_argument("--concurrency", default="1,4,8", help="client counts, comma-separated")
    p.add_argument("--settings", default="blend-serial,blend-batched,full-batched", help=f"of {', '.join(SETTINGS)}")
    p.add_argument("--per-client", type=int, default=1, help="requests each client sends, one after another")
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--pool", type=int, default=24, help="distinct chunks the requests draw from (all warm)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="max_batch_size of the batched settings")
    p.add_argument("--repeats", type=int, default=1)
    add_out_argument(p, "load", "where the load results go")
    add_data_dir_argument(p)
    args = p.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    label = f"random-{args.model_shape}" if args.random_weights else model_name(args.model)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_name()
    results = dict(model=label, cpu=device, device=args.device, dtype=args.dtype, threads=torch.get_num_threads(),
                   chunks=args.chunks, chunk_tokens=args.chunk_tokens, new_tokens=args.new_tokens,
                   repeats=args.repeats, rows=[])  # fmt: skip
    base = build_engine(args, args.dtype, memory_budget_bytes=int(args.memory_gb * 2**30))
    if args.random_weights:  # one token per word "wN"
        g = torch.Generator().manual_seed(1)
        pool = [" ".join(f"w{int(i)}" for i in torch.randint(2, 32000, (args.chunk_tokens,), generator=g))
                for _ in range(args.pool)]  # fmt: skip
    else:
        data = Path(args.data_dir) if args.data_dir else None
        pool = chunk_texts(base.tokenizer, args.pool, args.chunk_tokens, data)
    base.precompute(pool, QUESTIONS[0])
    for setting in settings:
        spec = SETTINGS[setting]
        config = EngineConfig(
            max_batch_size=spec["max_batch_size"] or args.batch, decode_weights=spec["decode_weights"]
        )
        engine = CacheBlendEngine(base.model, base.tokenizer, config=config, store=base.store)  # same warm store
        engine.generate(pool[: args.chunks], QUESTIONS[0], mode=spec["mode"], max_new_tokens=2)  # warm the path
        for clients in levels:
            runs = [run_level(engine, pool, clients, args.per_client, args, spec["mode"]) for _ in range(args.repeats)]
            row = dict(setting=setting, clients=clients, runs=runs, summary=summarize(runs))
            results["rows"].append(row)
            print(setting, clients, {k: round(v["mean"], 3) for k, v in row["summary"].items()}, flush=True)
            (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "summary.md").write_text(markdown(results))
    plot(results, out / "load.png")
    print(markdown(results))


if __name__ == "__main__":
    main()
