"""The load benchmark's report (`load.py`): each figure over repeats, the table in summary.md and load.png.

A row of the results is one setting (a way to serve, `blend-batched`, with its share of cold requests) at one load:
a number of closed-loop clients or a Poisson arrival rate. Each figure of a row is summarized over its repeats as
mean, min and max and, from two repeats on, a 95% interval of the mean from Student's t over the repeats
(mean +- t(0.975, R - 1) * sd / sqrt(R)): with the few repeats a load run can afford (3-5), a bootstrap over R
values gives intervals that are too narrow. The table shows min-max for one repeat (they are the value), the t
interval for more.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchlib.report import markdown_table, pyplot, save_figure

__all__ = ["load_axis", "load_markdown", "plot_load", "row_label", "summarize_runs", "t_interval", "t_quantile_975"]

# Student's t 97.5% quantile for 1..30 degrees of freedom (two-sided 95%).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
         2.042)  # fmt: skip
_Z975 = 1.959964


def t_quantile_975(df: int) -> float:
    """Student's t 97.5% quantile: the table up to 30 degrees of freedom, then the Cornish-Fisher expansion
    (two terms: within 0.001 of the exact value from 31 on)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t_interval(values: Sequence[float]) -> tuple[float, float] | None:
    """The 95% t interval of the mean of `values` (repeats); None for fewer than two."""
    if len(values) < 2:
        return None
    mean = statistics.mean(values)
    half = t_quantile_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return (mean - half, mean + half)


def summarize_runs(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per figure (the float fields of a run): mean, min ("lo"), max ("hi") and the 95% t interval ("ci95", None
    for one repeat) over the repeats."""
    keys = [k for k in runs[0] if isinstance(runs[0][k], float)]
    out = {}
    for k in keys:
        values = [r[k] for r in runs]
        ci = t_interval(values)
        out[k] = dict(mean=statistics.mean(values), lo=min(values), hi=max(values), ci95=list(ci) if ci else None)
    return out


def load_axis(results: Mapping[str, Any]) -> tuple[str, str]:
    """(the rows' load field, its name in the table): clients in a closed loop, the rate under Poisson arrivals."""
    if results.get("arrivals", "closed") == "poisson":
        return "rate_per_min", "rate (req/min)"
    return "clients", "clients"


def row_label(row: Mapping[str, Any]) -> str:
    """The setting of a row as readers see it: `blend-batched`, `blend-batched, 25% cold` for a mixed stream,
    `blend-batched, gap 0.5 s` with decode steps between a prefill's layers (`max_token_gap_s`)."""
    label = row["setting"]
    if row.get("token_gap") is not None:
        label += f", gap {row['token_gap']:g} s"
    share = row.get("cold_share", 0.0)
    return f"{label}, {share:.0%} cold" if share else label


def _cell(s: Mapping[str, Any], digits: int) -> str:
    lo, hi = s["ci95"] if s.get("ci95") else (s["lo"], s["hi"])
    return f"{s['mean']:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _caption(results: Mapping[str, Any]) -> str:
    arrivals = ""
    if results.get("arrivals") == "poisson":
        arrivals = (f" Poisson arrivals, {results['requests']} requests per rate (repeat r drawn with seed "
                    f"{results['seed']} + r), each streamed to the end by a thread of its own; TTFT counts from "
                    "arrival, queueing included.")  # fmt: skip
    warm = "chunks warm"
    if any(r.get("cold_share") for r in results["rows"]):
        warm = (f"chunks warm except for the cold requests' (chunks never stored before, taking the miss policy "
                f"'{results.get('miss_policy', 'auto')}')")  # fmt: skip
    repeats = results["repeats"]
    spread = "min-max in brackets" if repeats == 1 else "95% t interval over the repeats in brackets"
    return (
        f"Model {results['model']}, {results['cpu']}, torch threads {results['threads']}; {results['chunks']} chunks "
        f"of {results['chunk_tokens']} tokens, answers up to {results['new_tokens']} tokens, {warm};{arrivals} "
        f"{repeats} repeat(s), {spread}."
    )


def load_markdown(results: Mapping[str, Any]) -> str:
    """summary.md: the caption, one table row per setting and load, then the serial checks if any were run."""
    key, name = load_axis(results)
    mixed = any(r.get("cold_share") for r in results["rows"])
    header = ["setting", name, "answers/min", "generated tok/s", "TTFT p50 (s)", "TTFT p90 (s)", "TTFT p99 (s)",
              "s/token"]  # fmt: skip
    gaps = all("gap_p99_s" in r["summary"] for r in results["rows"])  # results written before gaps were measured
    if gaps:
        header += ["gap p99 (s)", "longest gap (s)"]
    if mixed:
        header += ["cold requests", "chunks from store"]
    rows = []
    for row in results["rows"]:
        s = row["summary"]
        cells = [row_label(row), f"{row[key]:g}", _cell(s["answers_per_min"], 2), _cell(s["tokens_per_s"], 2),
                 _cell(s["ttft_p50"], 1), _cell(s["ttft_p90"], 1), _cell(s["ttft_p99"], 1),
                 _cell(s["tpot_s"], 3)]  # fmt: skip
        if gaps:
            cells += [_cell(s["gap_p99_s"], 2), _cell(s["gap_max_s"], 2)]
        if mixed:
            run = row["runs"][0]
            cells += [f"{run['cold_requests']} of {run['requests']}", _cell(s["hit_share"], 2)]
        rows.append(cells)
    lines = [_caption(results), "", *markdown_table(header, "lr" + "r" * (len(header) - 2), rows)]
    checked = [r for r in results["rows"] if r.get("serial_check")]
    if checked:
        lines += ["", "Greedy answers of the first repeat against the same requests served alone (max_batch_size=1):"]
        for row in checked:
            c = row["serial_check"]
            at = f"{row[key]:g} clients" if key == "clients" else f"{row[key]:g} requests/min"
            lines.append(f"- {row_label(row)}, {at}: differing answers: {c['differing']} of {c['checked']}")
    return "\n".join(lines) + "\n"


def plot_load(results: Mapping[str, Any], path: str | Path) -> Path:
    """load.png: generated tokens/s and TTFT p90 against the load, one line per setting; error bars are the 95% t
    intervals over the repeats (none for one repeat)."""
    plt = pyplot()
    key, _ = load_axis(results)
    xlabel = "concurrent clients" if key == "clients" else "arrival rate (requests / min)"
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    rows = results["rows"]
    for label in dict.fromkeys(row_label(r) for r in rows):
        line = sorted((r for r in rows if row_label(r) == label), key=lambda r: r[key])
        xs = [r[key] for r in line]
        for ax, figure in zip(axes, ("tokens_per_s", "ttft_p90"), strict=True):
            stats = [r["summary"][figure] for r in line]
            mean = [s["mean"] for s in stats]
            err = None
            if all(s.get("ci95") for s in stats):
                err = [[m - s["ci95"][0] for m, s in zip(mean, stats, strict=True)],
                       [s["ci95"][1] - m for m, s in zip(mean, stats, strict=True)]]  # fmt: skip
            ax.errorbar(xs, mean, yerr=err, marker="o", capsize=3, label=label)
    axes[0].set(xlabel=xlabel, ylabel="generated tokens / s", title="Throughput")
    axes[1].set(xlabel=xlabel, ylabel="TTFT p90 (s)", title="Time to first token (p90)")
    axes[0].legend(fontsize=8)
    if results["repeats"] > 1:
        fig.suptitle(f"{results['model']}: mean of {results['repeats']} repeats, 95% t intervals", fontsize=10)
    return save_figure(fig, path)
