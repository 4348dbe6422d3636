"""TTFT as the number of chunks and the chunk length grow: the paper's Fig. 15a and 15b, on this engine.

Scope: two sweeps over the shape of a RAG request, timed with `benchlib.timing` (as `ttft.py` is, so that both
scripts build requests, warm the cache and time the modes the same way):

- chunk count: 3, 6, 9, 12 chunks of 512 tokens (`--counts`, `--chunk-tokens`);
- chunk length: 6 chunks of 128, 256, 512, 1024 tokens (`--lengths`, `--chunks`).

Each point times full recompute, prefix caching, full KV reuse and blend at each of `--ratios` (default 0.15)
with every chunk's KV already in the in-memory store, the modes interleaved, and keeps the median over
`--repeats`. A table per sweep gives the TTFT of each mode and the speed-up full / blend; `--out DIR` (default
benchmarks/results/sweep) gets sweep.json and sweep.png (TTFT vs chunk count and TTFT vs chunk length, one line
per mode, titled with the model's real name). A point whose prompt does not fit the model's context is skipped
with a message naming it, and listed under "skipped" in the JSON.

How this differs from the paper's Fig. 15:
- the paper plots the least compute time that keeps F1 within 0.015 of full recompute (the ratio tuned per
  point, 2WikiMQA, Mistral-7B); we plot TTFT at a fixed ratio, 0.15 by default, the ratio our quality runs
  support, and make no quality claim per point;
- TTFT counts everything from the call to the first token (tokenizing, loading chunk KV), not compute alone;
- Fig. 15c (batch size) has no counterpart: the in-process engine serves one request at a time.

    python benchmarks/sweep.py --model smollm2-135m-instruct --repeats 2 --out /tmp/sweep
    python benchmarks/sweep.py --random-weights --model-shape mistral-7b --device cuda --dtype bfloat16 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from benchlib import timing  # noqa: E402
from benchlib.cli import add_out_argument  # noqa: E402
from benchlib.report import pyplot, save_figure  # noqa: E402

from cacheblend_rag import CacheBlendEngine, StoreConfig  # noqa: E402
from cacheblend_rag.errors import PromptError  # noqa: E402


@dataclass(frozen=True)
class Sweep:
    """One panel of Fig. 15: `axis` ("chunks" or "chunk_tokens") takes each of `values`, the other is fixed."""

    name: str  # key in sweep.json
    axis: str  # the quantity that varies
    values: tuple[int, ...]
    fixed: int  # the other quantity's value
    xlabel: str

    @property
    def other(self) -> str:
        return "chunk_tokens" if self.axis == "chunks" else "chunks"

    def points(self) -> list[tuple[int, int]]:
        """(chunks, chunk_tokens) of each point, in order."""
        return [(v, self.fixed) if self.axis == "chunks" else (self.fixed, v) for v in self.values]

    def title(self) -> str:
        return (
            f"TTFT vs number of chunks ({self.fixed} tokens each)"
            if self.axis == "chunks"
            else f"TTFT vs chunk length ({self.fixed} chunks)"
        )


def sweeps_of(args) -> list[Sweep]:
    return [
        Sweep("chunk_count", "chunks", tuple(args.counts), args.chunk_tokens, "number of chunks"),
        Sweep("chunk_length", "chunk_tokens", tuple(args.lengths), args.chunks, "tokens per chunk"),
    ]


def measure_point(engine: CacheBlendEngine, args, chunks: int, tokens: int, data_dir: Path | None) -> dict[str, Any]:
    """Median TTFT of every mode on a request of `chunks` chunks of `tokens` tokens, the chunks' KV warm.

    Raises PromptError when the prompt is longer than the model's context."""
    if chunks * tokens > engine.max_tokens:  # no need to tokenize text that cannot fit
        raise PromptError(f"{chunks * tokens} chunk tokens alone exceed the model's limit of {engine.max_tokens}")
    prompt = timing.make_prompt(engine, args, chunks, tokens, data_dir)
    timing.warm_up(engine, prompt)  # the engine checks the prompt's length here, before any compute
    measured = timing.measure(engine, prompt, timing.timed_runs(args.ratios), args.repeats)
    medians = {name: statistics.median(m.ttft_s for m in ms) for name, ms in measured.items()}
    # A chunk missing from the store during a timed run means the memory budget was too small to keep it warm.
    missed = sum(m.chunks_missed for name, ms in measured.items() if name != "full" for m in ms)
    return {
        "chunks": chunks,
        "chunk_tokens": tokens,
        "prompt_tokens": prompt.num_tokens,
        "ttft_s": {name: round(v, 5) for name, v in medians.items()},
        "speedup": {name: round(medians["full"] / v, 3) for name, v in medians.items() if name.startswith("blend")},
        "chunks_missed": missed,
    }


def format_table(sweep: Sweep, points: list[dict[str, Any]], names: list[str], repeats: int) -> str:
    """The sweep's points as a fixed-width table: TTFT of each mode in ms, then full / blend per ratio."""
    blends = [n for n in names if n.startswith("blend")]
    head = [sweep.axis, "prompt"] + [f"{n} ms" for n in names] + [f"full/{n}" for n in blends]
    widths = [max(8, len(h)) for h in head]
    lines = [
        f"== {sweep.title()}: medians of {repeats} interleaved runs",
        "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)),
    ]
    for p in points:
        cells = [str(p[sweep.axis]), str(p["prompt_tokens"])]
        cells += [f"{p['ttft_s'][n] * 1000:.0f}" for n in names]
        cells += [f"{p['speedup'][n]:.2f}" for n in blends]
        lines.append("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    return "\n".join(lines)


def plot(report: dict[str, Any], sweeps: list[Sweep], names: list[str], path: Path) -> Path:
    """Two panels (one per sweep), TTFT in ms against the varied quantity, one line per mode."""
    plt = pyplot()

    fig, axes = plt.subplots(1, len(sweeps), figsize=(5 * len(sweeps), 4), squeeze=False)
    for ax, sweep in zip(axes[0], sweeps, strict=True):
        points = report["sweeps"][sweep.name]["points"]
        for name in names:
            ax.plot([p[sweep.axis] for p in points], [p["ttft_s"][name] * 1000 for p in points], marker="o", label=name)
        ax.set_xticks([p[sweep.axis] for p in points])  # measured points only, not skipped ones
        ax.set_title(sweep.title(), fontsize=10)
        ax.set_xlabel(sweep.xlabel)
        ax.set_ylabel("TTFT (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['model']} {report['dtype']} on {report['device']}", fontsize=10)
    return save_figure(fig, path)


def run(args) -> dict[str, Any]:
    data_dir = Path(args.data_dir) if args.data_dir else None
    t = time.perf_counter()
    engine = timing.build_engine(args, args.dtype, store=StoreConfig(memory_budget_bytes=int(args.memory_gb * 1024**3)))
    model = timing.model_label(args)
    print(
        f"== {model} {args.dtype} on {args.device} (loaded in {time.perf_counter() - t:.1f}s, "
        f"{torch.get_num_threads()} CPU threads, context {engine.max_tokens} tokens)",
        flush=True,
    )
    names = [name for name, _ in timing.timed_runs(args.ratios)]
    sweeps = sweeps_of(args)
    report: dict[str, Any] = {
        "model": model,
        "device": args.device,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "ratios": args.ratios,
        "modes": names,
        "sweeps": {},
    }
    done: dict[tuple[int, int], dict[str, Any]] = {}  # the defaults share 6 x 512: timed once, shown in both
    tables = []
    for sweep in sweeps:
        points, skipped = [], []
        for chunks, tokens in sweep.points():
            if (chunks, tokens) not in done:
                try:
                    done[chunks, tokens] = measure_point(engine, args, chunks, tokens, data_dir)
                except PromptError as e:
                    done[chunks, tokens] = {"chunks": chunks, "chunk_tokens": tokens, "reason": str(e)}
                p = done[chunks, tokens]
                if "reason" in p:
                    print(f"  skipped {chunks} chunks x {tokens} tokens: {p['reason']}", flush=True)
                else:
                    times = ", ".join(f"{n} {p['ttft_s'][n] * 1000:.0f} ms" for n in names)
                    print(
                        f"  {chunks} chunks x {tokens} tokens ({p['prompt_tokens']}-token prompt): {times}", flush=True
                    )
                    if p["chunks_missed"]:
                        print(f"  warning: {p['chunks_missed']} chunk loads missed the store; raise --memory-gb")
            p = done[chunks, tokens]
            (skipped if "reason" in p else points).append(p)
        report["sweeps"][sweep.name] = {
            "varies": sweep.axis,
            sweep.other: sweep.fixed,
            "points": points,
            "skipped": skipped,
        }
        tables.append(format_table(sweep, points, names, args.repeats))
    print("\n" + "\n\n".join(tables), flush=True)
    return report


def _int_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def _ratio_list(text: str) -> list[float]:
    values = [float(x) for x in text.split(",") if x.strip()]
    if not values or not all(0.0 <= r <= 1.0 for r in values):
        raise argparse.ArgumentTypeError(f"expected ratios in [0, 1] separated by commas, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="preset name or local checkpoint (default: the default preset)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--counts", type=_int_list, nargs="+", default=[[3, 6, 9, 12]], help="chunk counts, e.g. 3,6,9,12")
    p.add_argument("--chunk-tokens", type=int, default=512, help="tokens per chunk while the count varies")
    p.add_argument("--lengths", type=_int_list, nargs="+", default=[[128, 256, 512, 1024]], help="tokens per chunk")
    p.add_argument("--chunks", type=int, default=6, help="number of chunks while the length varies")
    p.add_argument("--ratios", type=_ratio_list, nargs="+", default=[[0.15]], help="blend recompute ratios")
    p.add_argument("--repeats", type=int, default=3)
    timing.add_data_dir_argument(p)
    p.add_argument("--random-weights", action="store_true", help="random weights of --model-shape (GPU timing)")
    p.add_argument("--model-shape", default="7b", choices=sorted(timing.RANDOM_SHAPES))
    p.add_argument("--memory-gb", type=float, default=8.0, help="in-memory chunk KV budget; must hold one point")
    add_out_argument(p, "sweep", "folder for sweep.json and sweep.png")
    args = p.parse_args(argv)
    # Each list option may be given as "3,6,9" or "3 6 9" (or both): flatten, keeping order.
    for name in ("counts", "lengths", "ratios"):
        setattr(args, name, [v for group in getattr(args, name) for v in group])
    if args.repeats < 1 or args.chunks < 1 or args.chunk_tokens < 1:
        p.error("--repeats, --chunks and --chunk-tokens must be >= 1")
    report = run(args)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, sweeps_of(args), report["modes"], out / "sweep.png")
    print(f"\nwrote {out / 'sweep.json'} and {out / 'sweep.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
