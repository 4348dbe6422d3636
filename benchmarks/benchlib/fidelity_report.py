"""Tables and figures of the fidelity benchmark (`fidelity.py`): means with bootstrap 95% intervals.

Every comparison is made on common cases: per data set, only the cases that every method of a table finished.
Methods that ran on far fewer cases than the others get a table of their own, on their cases, with the rows of
the better-covered methods that finished those cases too. Each data set's figure shows its best-covered table;
a table that sweeps more ratios on fewer cases (e.g. the full grid on the first 8 cases) gets a figure of its own.
Methods measured with their chunk KV stored through a codec (`attention@0.15+int8`) are rows and lines of their
own, and get the paired table of `fidelity_codecs` as well.
"""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchlib.fidelity_codecs import codec_differences, codec_markdown
from benchlib.fidelity_context import CONTEXT_INTRO, context_verdict, precompute_cost, split_context_rows
from benchlib.fidelity_run import NATIVE, split_codec
from benchlib.records import MODEL_UNKNOWN, run_settings
from benchlib.report import cases_text, ci_text, comparable_cases, pyplot, save_figure
from cacheblend_rag.config import BlendConfig
from cacheblend_rag.errors import CacheBlendError
from cacheblend_rag.evaluation.fidelity import bootstrap_ci, fidelity_over_cases

SUMMARY_MD = "summary.md"


@dataclass(frozen=True)
class FidelityRow:
    """One method on one data set, over that data set's common cases."""

    dataset: str
    group: int  # 0: the data set's best-covered methods; k > 0: the k-th table of methods run on fewer cases
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
    codec: str = NATIVE  # the codec the method's chunk KV was stored through

    @property
    def line(self) -> str:
        """What a figure's line is named by: the rule, and the codec unless uncompressed."""
        return self.rule if self.codec == NATIVE else f"{self.rule}+{self.codec}"


def _ok(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in records if "error" not in r and r.get("kl_mean") is not None]


def common_cases(records: Iterable[Mapping[str, Any]]) -> dict[str, tuple[set[str], list[str], list[str]]]:
    """Per data set: (the common cases, the methods compared on them, the methods left out); see
    `report.comparable_cases`."""
    return comparable_cases(_ok(records))


MIN_GROUP_CASES = 2  # a table of methods run on fewer cases needs at least this many common cases


def case_groups(records: Iterable[Mapping[str, Any]]) -> dict[str, list[tuple[set[str], list[str]]]]:
    """Per data set, the tables to print, each (its common cases, its methods).

    The first is `common_cases`. The methods it leaves out are grouped the same way among themselves, and each
    such table also gets every method of the earlier tables that finished all its cases (full, reuse, the
    reference rules), so that they are compared on the same cases. A group of fewer than `MIN_GROUP_CASES`
    cases is not shown (its methods are listed as left out).
    """
    ok = _ok(records)
    out: dict[str, list[tuple[set[str], list[str]]]] = {}
    for ds in sorted({r["dataset"] for r in ok}):
        mine = [r for r in ok if r["dataset"] == ds]
        done: dict[str, set[str]] = defaultdict(set)
        for r in mine:
            done[r["method"]].add(r["case_id"])
        groups: list[tuple[set[str], list[str]]] = []
        while mine:
            cases, kept, left = comparable_cases(mine)[ds]
            if len(cases) < MIN_GROUP_CASES and groups:
                break
            shown = [m for _, ms in groups for m in ms if m not in kept and cases <= done[m]]
            groups.append((cases, list(dict.fromkeys(shown + kept))))
            mine = [r for r in mine if r["method"] in left]
        out[ds] = groups
    return out


def left_out(records: Iterable[Mapping[str, Any]], dataset: str) -> list[str]:
    """The methods of `dataset` in no table of `case_groups` (run on too few cases), sorted."""
    ok = _ok(records)
    shown = {m for _, ms in case_groups(ok).get(dataset, []) for m in ms}
    return sorted({r["method"] for r in ok if r["dataset"] == dataset} - shown)


def _row(dataset: str, group: int, method: str, recs: Sequence[Mapping[str, Any]]) -> FidelityRow:
    mine = sorted((r for r in recs if r["method"] == method), key=lambda r: r["case_id"])
    stats = fidelity_over_cases(mine)
    codec = split_codec(method)[1]
    return FidelityRow(dataset, group, method, mine[0]["rule"], mine[0]["ratio"], **asdict(stats), codec=codec)


def summarize_fidelity(records: Sequence[Mapping[str, Any]]) -> list[FidelityRow]:
    """One row per (data set, table, method) on that table's common cases (`case_groups`), ordered by table,
    then rule, then ratio, then codec (uncompressed first)."""
    rows = []
    for ds, groups in sorted(case_groups(records).items()):
        for group, (cases, methods) in enumerate(groups):
            recs = [r for r in _ok(records) if r["dataset"] == ds and r["case_id"] in cases]
            rows += [_row(ds, group, method, recs) for method in methods]
    order = {"full": 0, "reuse": 1}
    return sorted(rows, key=lambda r: (r.dataset, r.group, order.get(r.rule, 2), r.rule, r.ratio or 0.0,
                                       r.codec != NATIVE, r.codec))  # fmt: skip


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


def fidelity_markdown(rows: Sequence[FidelityRow], records: Sequence[Mapping[str, Any]]) -> str:
    """Per data set, a table per `case_groups` group (KL, top-1, first token, compute share, TTFT), then the
    methods run on too few cases to be shown."""
    lines = []
    for ds in sorted({r.dataset for r in rows}):
        for group in sorted({r.group for r in rows if r.dataset == ds}):
            mine = [r for r in rows if r.dataset == ds and r.group == group]
            if group == 0:
                lines += [f"### {ds} ({cases_text(mine[0].n)})", ""]
            else:
                lines += [
                    f"#### {ds}: rules run on fewer cases ({cases_text(mine[0].n)})",
                    "",
                    "These rules ran on fewer cases than the table above. Every row here, the rows repeated "
                    "from above included, is over the cases they all finished.",
                    "",
                ]
            lines += [
                "| method | mean KL (nats) [95% CI] | max KL | top-1 agreement [95% CI] | first token | "
                "log p(ref) | compute share | median TTFT (s) |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for r in mine:
                lines.append(
                    f"| {r.method} | {r.kl_mean:.4f} {ci_text(r.kl_ci, '.4f')} | {r.kl_max:.3f} | "
                    f"{r.top1:.3f} {ci_text(r.top1_ci, '.3f')} | {r.first_token:.2f} | {r.logprob:.2f} | "
                    f"{r.compute_share:.3f} | {r.ttft_s:.2f} |"
                )
            lines.append("")
        left = left_out(records, ds)
        if left:
            lines += [f"Left out (measured on fewer than {MIN_GROUP_CASES} common cases): {', '.join(left)}.", ""]
    return "\n".join(lines)


def targets_markdown(rows: Sequence[FidelityRow], records: Sequence[Mapping[str, Any]]) -> str:
    """The judged comparisons, paired per case: the default rule at r = 0.05 against the paper's rule at 0.15,
    and full KV reuse against blend at 0.15 (both rules). Lower KL and higher top-1 are better."""
    default = BlendConfig().rule
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
                ra = next((r for r in rows if r.dataset == ds and r.method == a and r.group == 0), None)
                rb = next((r for r in rows if r.dataset == ds and r.method == b and r.group == 0), None)
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
                f"| {ds} | {a} | {b} | {kl[0]} | {kl[1]:+.4f} {ci_text(kl[2], '+.4f')} | "
                f"{top[1]:+.3f} {ci_text(top[2], '+.3f')} | {verdict} |"
            )
    return "\n".join(lines) + "\n"


def _ratios_per_rule(rows: Sequence[FidelityRow], dataset: str, group: int) -> int:
    """The most ratios any blend rule has in one table."""
    per: dict[str, set[float]] = defaultdict(set)
    for r in rows:
        if r.dataset == dataset and r.group == group and r.ratio is not None:
            per[r.rule].add(r.ratio)
    return max((len(v) for v in per.values()), default=0)


SWEEP_MIN_RATIOS = 3  # a table of fewer cases gets a figure of its own when a rule has this many ratios in it


def sweep_group(rows: Sequence[FidelityRow], dataset: str) -> int | None:
    """The table (group) of `dataset` that sweeps the most ratios per rule, when it is not the best-covered one
    and sweeps at least `SWEEP_MIN_RATIOS` (more ratios than the first table); None otherwise."""
    width = {g: _ratios_per_rule(rows, dataset, g) for g in sorted({r.group for r in rows if r.dataset == dataset})}
    best = max(width, key=lambda g: (width[g], -g), default=None)
    if best in (None, 0) or width[best] < SWEEP_MIN_RATIOS or width[best] <= width.get(0, 0):
        return None
    return best


def plot_pareto(
    rows: Sequence[FidelityRow], dataset: str, path: str | os.PathLike[str], *, model: str, group: int = 0
) -> Path:
    """Mean KL (log scale) and top-1 agreement against compute share: one line per rule, 95% intervals.
    Only the rows of one table (`group`), so every point is over the same cases."""
    plt = pyplot()
    mine = [r for r in rows if r.dataset == dataset and r.group == group and r.rule != "full"]
    if not mine:
        raise CacheBlendError(f"no fidelity rows for {dataset!r} in table {group}")
    fig, (ax_kl, ax_top) = plt.subplots(1, 2, figsize=(12, 4.6))
    rules = list(dict.fromkeys(r.line for r in mine))
    colors = plt.get_cmap("tab10" if len(rules) <= 10 else "tab20").colors  # one color per rule
    for i, rule in enumerate(rules):
        pts = sorted((r for r in mine if r.line == rule), key=lambda r: r.compute_share)
        x = [r.compute_share for r in pts]
        if rule == "reuse":
            style = {"marker": "s", "linestyle": "none", "color": "black"}
        elif rule.startswith("reuse+"):  # full reuse read through a codec: a point, in a color of its own
            style = {"marker": "s", "linestyle": "none", "color": colors[i % len(colors)]}
        else:
            style = {"marker": "o", "color": colors[i % len(colors)]}
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
    low = min((r.kl_mean for r in mine if r.kl_mean > 0), default=None)
    if low is not None:  # an interval reaching 0 (a few cases) must not stretch the log axis over decades
        ax_kl.set_ylim(bottom=low / 3)
    ax_kl.set_ylabel("mean KL(full || method), nats (log)")
    ax_top.set_ylabel("top-1 agreement with full recompute")
    for ax in (ax_kl, ax_top):
        ax.set_xlabel("compute share (recomputed token-layers / all)")
        ax.grid(alpha=0.3)
    ax_top.legend(fontsize=8, loc="lower right")
    cases = cases_text(mine[0].n, "common ")
    fig.suptitle(f"Fidelity to full recompute vs compute: {model}, {dataset}, {cases} (95% CIs)")
    return save_figure(fig, path, dpi=110)


def write_fidelity_report(out_dir: str | os.PathLike[str], records: Sequence[Mapping[str, Any]]) -> dict[str, Path]:
    """`summary.md` (+ .json) and one `fidelity_<dataset>.png` per data set, in `out_dir`; plus
    `fidelity_<dataset>_ratios.png` where a table of fewer cases sweeps more ratios (`sweep_group`). The figures
    name the model of `out_dir`'s run.json. With codec records, the summary ends with their paired table
    (`fidelity_codecs`), also written as `codecs.json`."""
    import json

    rows = summarize_fidelity(records)
    if not rows:
        raise CacheBlendError(f"no fidelity results in {out_dir}; run `python benchmarks/fidelity.py` first")
    out = Path(out_dir)
    model = run_settings(out).get("model", MODEL_UNKNOWN)
    files = {"summary": out / SUMMARY_MD, "json": out / "summary.json"}
    codecs = codec_differences(records)
    text = fidelity_markdown(rows, records) + "\n" + targets_markdown(rows, records)
    codec_rows, context_rows = split_context_rows(codecs)
    for table in (codec_markdown(codec_rows), codec_markdown(context_rows, CONTEXT_INTRO, context_verdict)):
        text += "\n" + table + "\n" if table else ""
    cost = precompute_cost(records)
    if cost:
        text += "\nPrecompute cost of contextual chunk KV:\n\n" + "\n".join(cost) + "\n"
    files["summary"].write_text(text)
    files["json"].write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    if codecs:
        files["codecs"] = out / "codecs.json"
        files["codecs"].write_text(json.dumps([{**asdict(r), "within_noise": r.within_noise} for r in codecs],
                                              indent=1) + "\n")  # fmt: skip
    for ds in sorted({r.dataset for r in rows}):
        files[ds] = plot_pareto(rows, ds, out / f"fidelity_{ds}.png", model=model)
        sweep = sweep_group(rows, ds)
        if sweep is not None:
            files[f"{ds}_ratios"] = plot_pareto(rows, ds, out / f"fidelity_{ds}_ratios.png", model=model, group=sweep)
    return files
