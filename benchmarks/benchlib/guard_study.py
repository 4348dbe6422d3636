"""The fidelity guard's study, from the fidelity benchmark's records.

`benchmarks/fidelity.py --rules attention --ratios 0.05,0.15,0.5` records, per case, full recompute (the
reference), full KV reuse and the blends at each ratio, each with its first token, its first-token KL to the
methods measured before it (`first_kl`) and, for the "attention" rule, the risk signals of
`cacheblend_rag.guard`. This module turns them into:
- the signal table: each signal's Spearman correlation with KL(full || blend) and its ROC AUC for "blend's first
  token differs from full's" and for "blend is further from full than reuse";
- one `FidelityProfile` per data set (the same records `cacheblend-rag calibrate` writes), so that every guard
  threshold is replayed exactly as the engine decides it (`FidelityProfile.outcome`), with its TTFT;
- the Pareto figure per data set: fixed ratios and guard thresholds on the same cases, with 95% intervals.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cacheblend_rag.config import Guard
from cacheblend_rag.controller.fidelity_choice import Setting
from cacheblend_rag.controller.fidelity_profile import FidelityProfile
from cacheblend_rag.evaluation import bootstrap_ci

BASE = 0.15
GRID = (0.05, 0.15, 0.5)  # measured blends; 1.0 is full recompute's own record
LADDER = (0.5, 1.0)
THRESHOLDS = (0.0, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)

# signal name -> how to read it from the base blend's risk signals as "higher = riskier"
SIGNALS: dict[str, Callable[[Mapping[str, Any]], float]] = {
    "kl_reuse": lambda r: r["kl_reuse"],
    "disagree_reuse": lambda r: 0.0 if r["agree_reuse"] else 1.0,
    "low_margin": lambda r: -r["margin"],
    "low_reuse_margin": lambda r: -r["reuse_margin"],  # recorded since 2026-11-26; older records lack it
    "stale_attention": lambda r: r["stale_attention"],
}


def method_name(ratio: float) -> str:
    return f"attention@{ratio:.2f}"


def load_cases(
    records: Iterable[Mapping[str, Any]],
    probes: Iterable[Mapping[str, Any]] = (),
    grid: Sequence[float] = GRID,
    variant: str = "native",
    base: float = BASE,
) -> dict[str, list[dict]]:
    """dataset -> one {method: record} per case that has full, reuse and every blend of `grid` (read through the
    store `variant`: "native", or e.g. "cap" for `attention@0.15+cap`, named without the suffix) and the risk
    signals of the base blend (at ratio `base`), in case order. `probes` (`benchmarks/guard_probe.py`) add the
    signals to base-blend records that lack them, when the probe saw the same prompt."""
    by_case: dict[tuple[str, str], dict[str, Mapping[str, Any]]] = defaultdict(dict)
    suffix = "" if variant == "native" else f"+{variant}"
    for r in records:
        if "error" in r:
            continue
        if r["method"] == "full" or r.get("codec", "native") == variant:
            by_case[(r["dataset"], r["case_id"])][r["method"].removesuffix(suffix)] = r
    base_method = method_name(base)
    for p in probes:
        methods = by_case.get((p["dataset"], p["case_id"]), {})
        rec = methods.get(base_method)
        if rec is not None and not rec.get("risk") and p["prompt_tokens"] == rec["prompt_tokens"]:
            methods[base_method] = {**rec, "risk": p["risk"], "first_token_id": p["first_token_id"]}
    needed = {"full", "reuse", *(method_name(x) for x in grid)}
    out: dict[str, list[dict]] = defaultdict(list)
    for (dataset, _), methods in sorted(by_case.items(), key=lambda item: _case_order(*item[0])):
        if needed <= set(methods) and methods[base_method].get("risk"):
            out[dataset].append(dict(methods))
    return dict(out)


def _case_order(dataset: str, case_id: str) -> tuple[str, int, str]:
    tail = case_id.rsplit("-", 1)[-1]
    return (dataset, int(tail) if tail.isdigit() else 10**9, case_id)


def probe_consistency(probes: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """(probes whose blend picks the recorded reference's first token exactly when the recorded blend did, probes
    that can be checked): the probe re-ran the recorded blend, not another one."""
    checked = [p for p in probes if p.get("reference_first_id") is not None]
    same = sum((p["first_token_id"] == p["reference_first_id"]) == (p["recorded_first_token"] == 1.0) for p in checked)
    return same, len(checked)


def _fixed(rec: Mapping[str, Any], ratio: float) -> dict[str, Any]:
    return {"ratio": ratio, **{k: rec[k] for k in ("first_token", "top1", "kl_mean", "compute_share", "ttft_s")}}


def question(
    case: Mapping[str, Mapping[str, Any]],
    grid: Sequence[float] = GRID,
    ladder: Sequence[float] = LADDER,
    base: float = BASE,
) -> dict[str, Any]:
    """One case as a fidelity-profile question (`FidelityProfile`): reuse, each ratio of `grid` and 1.0 (full
    recompute: exact, at the cost of a full prefill over the shared first pass), the base blend's risk signals
    and the ladder's first-token comparisons."""
    reuse, full = case["reuse"], case["full"]
    fixed = [_fixed(case[method_name(r)], r) for r in grid]
    exact = {"first_token": 1.0, "top1": 1.0, "kl_mean": 0.0, "compute_share": 1.0 + reuse["compute_share"],
             "ttft_s": full["ttft_s"] + reuse["ttft_s"]}  # fmt: skip
    fixed.append({"ratio": 1.0, **exact})
    steps, previous = [], method_name(base)
    for ratio in ladder:
        if ratio >= 1.0:  # the ladder's end is exact: nothing after it to agree with
            steps.append({"ratio": ratio, "agree_prev": True, "kl_prev": 0.0})
            break
        rec = case[method_name(ratio)]
        agree = rec["first_token_id"] == case[previous]["first_token_id"]
        steps.append({"ratio": ratio, "agree_prev": agree, "kl_prev": rec["first_kl"][previous]})
        previous = method_name(ratio)
    return {
        "id": full["case_id"],
        "reuse": _fixed(reuse, 0.0),
        "fixed": fixed,
        "risk": case[method_name(base)]["risk"],
        "steps": steps,
        "full_ttft_s": full["ttft_s"],
    }


def profile(
    cases: Sequence[Mapping[str, Any]],
    grid: Sequence[float] = GRID,
    ladder: Sequence[float] = LADDER,
    base: float = BASE,
) -> FidelityProfile:
    """The cases as a fidelity profile of the blends of `grid` whose guard (the KL trigger at each of `THRESHOLDS`)
    escalates from the blend at `base` through `ladder` (0.5 then 1.0, or straight to 1.0)."""
    return FidelityProfile(
        model="", dtype="float32", rule="attention", base_ratio=base, ratios=(*grid, 1.0), ladder=tuple(ladder),
        thresholds=THRESHOLDS, questions=tuple(question(c, grid, ladder, base) for c in cases),
        source="benchmarks/fidelity.py",
    )  # fmt: skip


@dataclass(frozen=True)
class Row:
    """One setting over one set of cases: means with 95% intervals, cost, and per-case safety."""

    name: str
    series: str  # "fixed", or the guard's ladder ("0.15 -> 0.5 -> 1")
    guard: float | None  # max_kl for a guard row
    n: int
    first_token: tuple[float, float, float]  # mean, low, high
    top1: tuple[float, float, float]
    kl: tuple[float, float, float]
    compute_share: float
    escalated: float
    worse_than_reuse: int  # cases further from full than full reuse is
    ttft_mean: float
    ttft_p90: float
    speedup_mean: float  # full's mean TTFT / this setting's, same cases
    speedup_p90: float  # full's p90 TTFT / this setting's p90


def _mci(values: Sequence[float]) -> tuple[float, float, float]:
    lo, hi = bootstrap_ci(values)
    return (statistics.fmean(values), lo, hi)


def _row(
    name: str, series: str, guard: float | None, outcomes: Sequence[Mapping[str, Any]], questions: Sequence[Mapping]
) -> Row:
    full = [q["full_ttft_s"] for q in questions]
    ttft = [o["ttft_s"] for o in outcomes]
    return Row(
        name=name, series=series, guard=guard, n=len(outcomes),
        first_token=_mci([o["first_token"] for o in outcomes]), top1=_mci([o["top1"] for o in outcomes]),
        kl=_mci([o["kl_mean"] for o in outcomes]),
        compute_share=statistics.fmean(o["compute_share"] for o in outcomes),
        escalated=statistics.fmean(float(o.get("escalated", False)) for o in outcomes),
        worse_than_reuse=sum(
            o["kl_mean"] > q["reuse"]["kl_mean"] + 1e-9 for o, q in zip(outcomes, questions, strict=True)
        ),
        ttft_mean=statistics.fmean(ttft), ttft_p90=float(np.percentile(ttft, 90)),
        speedup_mean=statistics.fmean(full) / statistics.fmean(ttft),
        speedup_p90=float(np.percentile(full, 90) / np.percentile(ttft, 90)),
    )  # fmt: skip


def rows(prof: FidelityProfile, *, fixed: bool = True) -> list[Row]:
    """Full reuse, each fixed ratio and full recompute (with `fixed`), then the guard at each threshold over the
    base ratio, on the same cases."""
    qs = prof.questions
    out = []
    if fixed:
        exact = [{"first_token": 1.0, "top1": 1.0, "kl_mean": 0.0, "compute_share": 1.0, "ttft_s": q["full_ttft_s"]}
                 for q in qs]  # fmt: skip
        out.append(_row("reuse (r=0)", "fixed", None, [q["reuse"] for q in qs], qs))
        out += [_row(s.name, "fixed", None, [prof.outcome(s, q) for q in qs], qs) for s in prof.settings()
                if s.guard is None and s.ratio < 1.0]  # fmt: skip
        out.append(_row("full recompute", "fixed", None, exact, qs))
    ladder = " -> ".join(f"{r:g}" for r in (prof.base_ratio, *prof.ladder))
    for s in prof.settings():
        if s.guard is not None:
            name = f"guard KL to reuse > {s.guard.max_kl:g} ({ladder})"
            out.append(_row(name, f"KL to reuse ({ladder})", s.guard.max_kl, [prof.outcome(s, q) for q in qs], qs))
    return out


MARGINS = (0.02, 0.05, 0.1, 0.2, 0.3)


def margin_rows(prof: FidelityProfile) -> list[Row]:
    """The guard's margin trigger (`Guard(min_margin=m)`) at each of `MARGINS`, over the profile's base ratio and
    ladder."""
    qs = prof.questions
    ladder = " -> ".join(f"{r:g}" for r in (prof.base_ratio, *prof.ladder))
    out = []
    for m in MARGINS:
        s = Setting(prof.base_ratio, Guard(min_margin=m, ratios=prof.ladder))
        out.append(_row(f"guard margin < {m:g} ({ladder})", f"margin ({ladder})", m, [prof.outcome(s, q) for q in qs],
                        qs))  # fmt: skip
    return out


def _auc(labels: Sequence[bool], scores: Sequence[float]) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(labels, scores)) if 0 < sum(labels) < len(labels) else float("nan")


def signal_table(cases: Sequence[Mapping[str, Any]]) -> list[tuple[str, float, float, float]]:
    """Per signal: (name, Spearman with KL(full || base blend), AUC first token differs, AUC further than reuse).
    A signal some record lacks (recorded after that record was made) is left out."""
    from scipy.stats import spearmanr

    base = [c[method_name(BASE)] for c in cases]
    kl = [b["kl_mean"] for b in base]
    flipped = [b["first_token"] < 1 for b in base]
    worse = [b["kl_mean"] > c["reuse"]["kl_mean"] for b, c in zip(base, cases, strict=True)]
    out = []
    for name, read in SIGNALS.items():
        try:
            s = [read(b["risk"]) for b in base]
        except KeyError:
            continue
        rho = float(spearmanr(s, kl).statistic) if len(set(s)) > 1 and len(set(kl)) > 1 else float("nan")
        out.append((name, rho, _auc(flipped, s), _auc(worse, s)))
    return out


def plot_pareto(table: Sequence[Row], title: str, path: Path) -> Path:
    """KL and first-token agreement against mean compute share: fixed ratios as a line, the guard's thresholds as
    points, 95% intervals, all on the same cases."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[str, list[Row]] = defaultdict(list)
    for r in table:
        series[r.series].append(r)
    for ax, attr, label in ((axes[0], "kl", "mean KL(full || method), nats"),
                            (axes[1], "first_token", "first-token agreement with full")):  # fmt: skip
        styles = iter(
            [
                dict(fmt=f, color=c)
                for f, c in zip(
                    "s^vDP*", ["tab:red", "tab:green", "tab:orange", "tab:purple", "k", "tab:brown"], strict=True
                )
            ]
        )
        for name, rows_ in series.items():
            fixed = name == "fixed"
            style = dict(fmt="o-", color="tab:blue") if fixed else next(styles)
            legend = "fixed r" if fixed else f"guard: {name}"
            x = [r.compute_share for r in rows_]
            y = [getattr(r, attr)[0] for r in rows_]
            err = [[y_ - getattr(r, attr)[1] for y_, r in zip(y, rows_, strict=True)],
                   [getattr(r, attr)[2] - y_ for y_, r in zip(y, rows_, strict=True)]]  # fmt: skip
            ax.errorbar(x, y, yerr=err, capsize=3, label=legend, alpha=0.85, **style)
        for r in (r for r in table if r.guard is not None):
            ax.annotate(f"{r.guard:g}", (r.compute_share, getattr(r, attr)[0]), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))  # fmt: skip
        ax.set_xlabel("mean compute share (full prefill = 1)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].axhline(0.95, color="grey", ls=":", lw=1)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{title} ({table[0].n} cases; 95% bootstrap intervals)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(m: tuple[float, float, float], digits: int = 3) -> str:
    return f"{m[0]:.{digits}f} [{m[1]:.{digits}f}, {m[2]:.{digits}f}]"


def markdown_rows(table: Sequence[Row]) -> list[str]:
    head = ["| setting | first-token agreement | top-1 agreement | mean KL (nats) | compute share | escalated | "
            "cases worse than reuse | TTFT mean / p90 (s) | speed-up vs full, mean / p90 |",
            "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    return head + [
        f"| {r.name} | {_fmt(r.first_token, 2)} | {_fmt(r.top1, 3)} | {_fmt(r.kl, 3)} | {r.compute_share:.3f} | "
        f"{r.escalated:.2f} | {r.worse_than_reuse} | {r.ttft_mean:.2f} / {r.ttft_p90:.2f} | "
        f"{r.speedup_mean:.2f}x / {r.speedup_p90:.2f}x |"
        for r in table
    ]
