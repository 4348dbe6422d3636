"""The traffic benchmark's tables and figures: the real runs, the simulation of the same runs (agreement), every
simulated stream / budget / policy over seeds, and the warm-up curves."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchlib.traffic_real import latest_attempts
from benchlib.traffic_sim import budget_bytes, corpus_bytes
from cacheblend_rag.sizing import (
    CostModel,
    Curve,
    KVShape,
    PromptLengths,
    StoreSimulator,
    machine_name,
    run_stream,
    summarize,
)

WARMUP = (25, 50, 100, 200, 500, 1000, 2000, 5000, None)


def _parse_run(run: str) -> tuple[str, int, float, str]:
    stream, seed, share, policy = run.split("-")
    return stream, int(seed[1:]), float(share[1:]), policy


def real_vs_simulated(records, squad, found, lengths, shape: KVShape, costs: CostModel) -> list[dict[str, Any]]:
    """Per real run: its hit rate and mean TTFT against full prefill, and the simulation of the same requests."""
    fulls = [r for r in records if r.get("kind") == "full"]
    full = Curve.fit([r["prompt_tokens"] for r in fulls], [r["ttft_s"] for r in fulls]) if fulls else costs.full
    corpus = corpus_bytes(lengths, shape)
    rows = []
    for run, reqs in sorted(latest_attempts(records).items()):
        stream, seed, share, policy = _parse_run(run)
        n = len(reqs)
        requests = [r["chunks"] for r in reqs]  # the run's own requests, as recorded
        ordered = PromptLengths(lengths.prefix, lengths.chunks, tuple(lengths.suffixes[r["q"]] for r in reqs))
        sim = StoreSimulator(ordered.chunks, prefix_tokens=ordered.prefix, bytes_per_token=shape.bytes_per_token,
                             budget_bytes=budget_bytes(share, corpus), num_layers=shape.num_layers, costs=costs,
                             eviction=policy)  # fmt: skip
        simulated = run_stream(sim, requests, ordered.suffixes)
        for window in sorted({w for w in (50, 200) if w < n} | {n}):  # the warm-up curve, then the whole run
            part = reqs[:window]
            chunks = sum(r["hits"] + r["misses"] for r in part)
            ttft = statistics.mean(r["ttft_s"] for r in part)
            full_s = statistics.mean(full(r["prompt_tokens"]) for r in part)
            s = summarize(simulated, window)
            rows.append(dict(run=run, requests=len(part), hit_rate=sum(r["hits"] for r in part) / chunks,
                             mean_ttft_s=ttft, mean_full_s=full_s, speedup=full_s / ttft, sim_hit_rate=s.hit_rate,
                             sim_mean_ttft_s=s.mean_ttft_s, sim_speedup=s.speedup,
                             full_modes=sum(r["mode"] == "full" for r in part)))  # fmt: skip
    return rows


def _pct(x: float) -> str:
    return f"{x:.1%}"


def simulated_table(rows: list[dict[str, Any]]) -> str:
    """Hit rate and speed-up over the whole stream, mean and range over seeds, per stream, budget and policy."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["window"] is None:
            groups[(r["stream"], r["share"], r["policy"])].append(r)
    unbounded = {
        (s, p): statistics.mean(x["hit_rate"] for x in g) for (s, share, p), g in groups.items() if share is None
    }
    lines = [
        "| stream | budget | policy | hit rate (seeds: min-max) | of unbounded | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for (stream, share, policy), g in groups.items():
        hits = [x["hit_rate"] for x in g]
        speed = [x["speedup"] for x in g]
        rng = f" ({min(hits):.1%}-{max(hits):.1%})" if len(g) > 1 else ""
        budget = "unbounded" if share is None else f"{share:.0%}"
        keep = statistics.mean(hits) / unbounded[(stream, policy)]
        lines.append(f"| {stream} | {budget} | {policy} | {statistics.mean(hits):.1%}{rng} | {keep:.0%} | "
                     f"{statistics.mean(speed):.2f}x |")  # fmt: skip
    return "\n".join(lines)


def _spread(mean: list[float], vals: list[list[float]]) -> list[list[float]]:
    """Error bars from the mean to the lowest and highest seed."""
    return [
        [m - min(v) for m, v in zip(mean, vals, strict=True)],
        [max(v) - m for m, v in zip(mean, vals, strict=True)],
    ]


def plot(rows: list[dict[str, Any]], real: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = sorted({r["stream"] for r in rows})
    policies = sorted({r["policy"] for r in rows})
    fig, axes = plt.subplots(2, len(streams), figsize=(5 * len(streams), 8), squeeze=False)
    for j, stream in enumerate(streams):
        for policy in policies:
            pts = defaultdict(list)
            for r in rows:
                if r["stream"] == stream and r["policy"] == policy and r["window"] is None and r["share"] is not None:
                    pts[r["share"]].append(r)
            shares = sorted(pts)
            for i, key in enumerate(("hit_rate", "speedup")):
                vals = [[x[key] for x in pts[s]] for s in shares]
                mean = [statistics.mean(v) for v in vals]
                axes[i][j].errorbar([s * 100 for s in shares], mean, yerr=_spread(mean, vals), fmt="o-", capsize=3,
                                    label=policy)  # fmt: skip
        for r in real:
            stream_r, _, share, policy = _parse_run(r["run"])
            if stream_r == stream and r["requests"] > 50:
                axes[0][j].plot([share * 100], [r["hit_rate"]], "k*", markersize=10)
                axes[1][j].plot([share * 100], [r["speedup"]], "k*", markersize=10)
        axes[0][j].set_title(f"{stream} (simulated, whole stream; * real run)")
        for i, label in enumerate(("chunk hit rate", "mean TTFT speed-up vs full prefill")):
            axes[i][j].set_xscale("log")
            axes[i][j].set_xlabel("store budget, % of corpus KV")
            axes[i][j].set_ylabel(label)
            axes[i][j].legend()
    fig.tight_layout()
    fig.savefig(out / "budget.png", dpi=110)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for stream in streams:
        for share in (0.25, 1.0):
            pts = defaultdict(list)
            for r in rows:
                if r["stream"] == stream and r["policy"] == "lfu" and r["share"] == share and r["window"]:
                    pts[r["window"]].append(r)
            ws = sorted(pts)
            for i, key in enumerate(("hit_rate", "speedup")):
                vals = [[x[key] for x in pts[w]] for w in ws]
                mean = [statistics.mean(v) for v in vals]
                axes[i].errorbar(ws, mean, yerr=_spread(mean, vals), fmt="o-", capsize=3,
                                 label=f"{stream} {share:.0%}")  # fmt: skip
    for i, label in enumerate(("chunk hit rate over the first N requests", "mean TTFT speed-up, first N requests")):
        axes[i].set_xscale("log")
        axes[i].set_xlabel("requests N")
        axes[i].set_ylabel(label)
        axes[i].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "warmup.png", dpi=110)


def write_report(out: Path, records, squad, found, lengths, shape: KVShape, costs: CostModel) -> None:
    sim_path = out / "simulated.json"
    sim = json.loads(sim_path.read_text()) if sim_path.is_file() else {"rows": []}
    rows = sim["rows"]
    real = real_vs_simulated(records, squad, found, lengths, shape, costs)
    lines = [f"# Traffic benchmark ({machine_name()})", "", "## Real runs and their simulation", "",
             "| run | requests | hit rate | sim | mean TTFT | sim | full prefill | speed-up | sim | cold in full |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in real:
        lines.append(f"| {r['run']} | {r['requests']} | {_pct(r['hit_rate'])} | {_pct(r['sim_hit_rate'])} | "
                     f"{r['mean_ttft_s']:.2f}s | {r['sim_mean_ttft_s']:.2f}s | {r['mean_full_s']:.2f}s | "
                     f"{r['speedup']:.2f}x | {r['sim_speedup']:.2f}x | {r['full_modes']} |")  # fmt: skip
    lines += ["", "## Simulated (whole stream)", "", simulated_table(rows) if rows else "(none)", ""]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "real_vs_simulated.json").write_text(json.dumps(real, indent=1))
    if rows:
        plot(rows, real, out)
    print("\n".join(lines))
