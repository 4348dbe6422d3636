"""Tables and figures of the fidelity benchmark (`fidelity.py`): means with bootstrap 95% intervals.

Every comparison is made on common cases: per data set, only the cases that every reported method finished.
A method that ran on fewer cases than the others is listed apart, never mixed into the same table or plot.
"""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import CacheBlendError
from .report import bootstrap_ci, cases_text, comparable_cases, pyplot

SUMMARY_MD = "summary.md"


@dataclass(frozen=True)
class FidelityRow:
    """One method on one data set, over that data set's common cases."""

    dataset: str
    method: str
    rule: str
    ratio: float | None
    n: int
    kl_mean: float
    kl_ci: tuple[float, float]
    kl_max: float
    top1: float
    top1_ci: tuple[float, float]
    first_token: float
    logprob: float
    compute_share: float
    ttft_s: float  # median


def _ok(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in records if "error" not in r and r.get("kl_mean") is not None]


def common_cases(records: Iterable[Mapping[str, Any]]) -> dict[str, tuple[set[str], list[str], list[str]]]:
    """Per data set: (the common cases, the methods compared on them, the methods left out); see
    `report.comparable_cases`."""
    return comparable_cases(_ok(records))


def summarize_fidelity(records: Sequence[Mapping[str, Any]]) -> list[FidelityRow]:
    """One row per (data set, method) on the data set's common cases, ordered by rule, then ratio."""
    rows = []
    for ds, (cases, methods, _) in sorted(common_cases(records).items()):
        recs = [r for r in _ok(records) if r["dataset"] == ds and r["case_id"] in cases]
        for method in methods:
            mine = sorted((r for r in recs if r["method"] == method), key=lambda r: r["case_id"])
            kl = [r["kl_mean"] for r in mine]
            top1 = [r["top1"] for r in mine]
            rows.append(
                FidelityRow(
                    dataset=ds,
                    method=method,
                    rule=mine[0]["rule"],
                    ratio=mine[0]["ratio"],
                    n=len(mine),
                    kl_mean=statistics.fmean(kl),
                    kl_ci=bootstrap_ci(kl),
                    kl_max=statistics.fmean(r["kl_max"] for r in mine),
                    top1=statistics.fmean(top1),
                    top1_ci=bootstrap_ci(top1),
                    first_token=statistics.fmean(r["first_token"] for r in mine),
                    logprob=statistics.fmean(r["logprob"] for r in mine),
                    compute_share=statistics.fmean(r["compute_share"] for r in mine),
                    ttft_s=statistics.median(r["ttft_s"] for r in mine),
                )
            )
    order = {"full": 0, "reuse": 1}
    return sorted(rows, key=lambda r: (r.dataset, order.get(r.rule, 2), r.rule, r.ratio or 0.0))


def paired_difference(
    records: Sequence[Mapping[str, Any]], dataset: str, a: str, b: str, metric: str
) -> tuple[int, float, tuple[float, float]] | None:
    """Mean of metric(a) - metric(b) over the cases both methods finished, with a bootstrap interval."""
    vals: dict[str, dict[str, float]] = defaultdict(dict)
    for r in _ok(records):
        if r["dataset"] == dataset and r["method"] in (a, b):
            vals[r["case_id"]][r["method"]] = r[metric]
    diffs = [v[a] - v[b] for _, v in sorted(vals.items()) if a in v and b in v]
    if not diffs:
        return None
    return len(diffs), statistics.fmean(diffs), bootstrap_ci(diffs)


def _ci(ci: tuple[float, float], spec: str) -> str:
    return f"[{ci[0]:{spec}}, {ci[1]:{spec}}]"


def fidelity_markdown(rows: Sequence[FidelityRow], records: Sequence[Mapping[str, Any]]) -> str:
    """A table per data set (KL, top-1, first token, compute share, TTFT) and the methods left out."""
    lines = []
    cover = common_cases(records)
    for ds in sorted({r.dataset for r in rows}):
        mine = [r for r in rows if r.dataset == ds]
        lines += [
            f"### {ds} ({cases_text(mine[0].n)})",
            "",
            "| method | mean KL (nats) [95% CI] | max KL | top-1 agreement [95% CI] | first token | "
            "log p(ref) | compute share | median TTFT (s) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in mine:
            lines.append(
                f"| {r.method} | {r.kl_mean:.4f} {_ci(r.kl_ci, '.4f')} | {r.kl_max:.3f} | "
                f"{r.top1:.3f} {_ci(r.top1_ci, '.3f')} | {r.first_token:.2f} | {r.logprob:.2f} | "
                f"{r.compute_share:.3f} | {r.ttft_s:.2f} |"
            )
        left = cover[ds][2]
        if left:
            lines += ["", f"Left out (measured on half as many cases or fewer): {', '.join(sorted(left))}."]
        lines.append("")
    return "\n".join(lines)


def targets_markdown(rows: Sequence[FidelityRow], records: Sequence[Mapping[str, Any]]) -> str:
    """The judged comparisons, paired per case: the default rule at r = 0.05 against the paper's rule at 0.15,
    and full KV reuse against blend at 0.15 (both rules). Lower KL and higher top-1 are better."""
    from ..config import BlendConfig, rule_name

    default = rule_name(BlendConfig()) or "default"
    pairs = [(f"{default}@0.05", "paper@0.15"), ("reuse", "paper@0.15"), ("reuse", f"{default}@0.15")]
    lines = [
        f"### Targets (default rule: {default})",
        "",
        "| data set | A | B | cases | KL(A) - KL(B) [95% CI] | top-1(A) - top-1(B) [95% CI] | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for ds in sorted({r.dataset for r in rows}):
        for a, b in pairs:
            kl = paired_difference(records, ds, a, b, "kl_mean")
            top = paired_difference(records, ds, a, b, "top1")
            if kl is None or top is None:
                continue
            if a == "reuse":  # reuse must be clearly worse: its KL interval above blend's, not overlapping
                ra = next((r for r in rows if r.dataset == ds and r.method == a), None)
                rb = next((r for r in rows if r.dataset == ds and r.method == b), None)
                ok = ra is not None and rb is not None and ra.kl_ci[0] > rb.kl_ci[1]
                if ok:
                    verdict = "intervals apart"
                elif kl[2][0] > 0:  # the per-case differences still put reuse further from full, every resample
                    verdict = "intervals overlap; paired KL difference above 0"
                else:
                    verdict = "intervals overlap (or not on common cases)"
            else:  # A must be at least as faithful as B on both measures
                verdict = "A at least as faithful" if kl[1] <= 0 and top[1] >= 0 else "A less faithful"
            lines.append(
                f"| {ds} | {a} | {b} | {kl[0]} | {kl[1]:+.4f} {_ci(kl[2], '+.4f')} | "
                f"{top[1]:+.3f} {_ci(top[2], '+.3f')} | {verdict} |"
            )
    return "\n".join(lines) + "\n"


def plot_pareto(rows: Sequence[FidelityRow], dataset: str, path: str | os.PathLike[str]) -> Path:
    """Mean KL (log scale) and top-1 agreement against compute share: one line per rule, 95% intervals."""
    plt = pyplot()
    mine = [r for r in rows if r.dataset == dataset and r.rule != "full"]
    if not mine:
        raise CacheBlendError(f"no fidelity rows for {dataset!r}")
    fig, (ax_kl, ax_top) = plt.subplots(1, 2, figsize=(12, 4.6))
    for rule in dict.fromkeys(r.rule for r in mine):
        pts = sorted((r for r in mine if r.rule == rule), key=lambda r: r.compute_share)
        x = [r.compute_share for r in pts]
        style = {"marker": "s", "linestyle": "none", "color": "black"} if rule == "reuse" else {"marker": "o"}
        for ax, ys, cis in (
            (ax_kl, [r.kl_mean for r in pts], [r.kl_ci for r in pts]),
            (ax_top, [r.top1 for r in pts], [r.top1_ci for r in pts]),
        ):
            err = [
                [v - lo for v, (lo, _) in zip(ys, cis, strict=True)],
                [hi - v for v, (_, hi) in zip(ys, cis, strict=True)],
            ]
            ax.errorbar(x, ys, yerr=err, capsize=3, label=rule, **style)
    ax_kl.set_yscale("log")
    ax_kl.set_ylabel("mean KL(full || method), nats (log)")
    ax_top.set_ylabel("top-1 agreement with full recompute")
    for ax in (ax_kl, ax_top):
        ax.set_xlabel("compute share (recomputed token-layers / all)")
        ax.grid(alpha=0.3)
    ax_top.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Fidelity to full recompute vs compute: {dataset}, {cases_text(mine[0].n, 'common ')} (95% CIs)")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_fidelity_report(out_dir: str | os.PathLike[str], records: Sequence[Mapping[str, Any]]) -> dict[str, Path]:
    """`fidelity_summary.md` (+ .json) and one `fidelity_<dataset>.png` per data set, in `out_dir`."""
    import json

    rows = summarize_fidelity(records)
    if not rows:
        raise CacheBlendError(f"no fidelity results in {out_dir}; run `cacheblend-rag bench fidelity` first")
    out = Path(out_dir)
    files = {"summary": out / SUMMARY_MD, "json": out / "summary.json"}
    files["summary"].write_text(fidelity_markdown(rows, records) + "\n" + targets_markdown(rows, records))
    files["json"].write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    for ds in sorted({r.dataset for r in rows}):
        files[ds] = plot_pareto(rows, ds, out / f"fidelity_{ds}.png")
    return files
