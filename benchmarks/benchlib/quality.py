"""The quality benchmark: data sets x methods x cases, one JSONL record per finished case, a report at the end.

Scope: running (`run_quality`), resuming, and summarising (`summarize` into typed `SummaryRow`s, `write_report`: a
markdown table and matplotlib figures, drawn with the benchmarks' shared `report` module). One record per (data set,
method, case) is appended to `results.jsonl` as soon as it is done, so an interrupted run loses at most the case in
flight and a rerun with the same `--out` skips what is there. `run.json` remembers the model and settings; resuming
with different ones is refused, since their numbers would not belong in one table.

Each case is run by every method before the next case starts (so a partial run stays balanced across methods), each
method after its untimed warm step (chunk KV precomputed: the paper's steady state).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchlib.methods import Method, answer_text
from benchlib.records import MODEL_UNKNOWN, append_record, check_run_settings, run_settings
from benchlib.records import load_records as _load
from benchlib.report import cases_text, ci_text, comparable_cases, fmt, markdown_table, plot_panels, write_json
from cacheblend_rag.errors import CacheBlendError
from cacheblend_rag.evaluation.datasets import Dataset
from cacheblend_rag.evaluation.fidelity import bootstrap_ci
from cacheblend_rag.evaluation.scoring import METRIC_NAMES, score_answer

__all__ = [
    "RESULTS_FILE",
    "SummaryRow",
    "load_records",
    "plot_panels",
    "plot_quality_vs_ratio",
    "plot_quality_vs_ttft",
    "run_quality",
    "summarize",
    "summary_markdown",
    "write_report",
]

RESULTS_FILE = "results.jsonl"
SUMMARY_MD = "summary.md"
SUMMARY_JSON = "summary.json"
FIG_QUALITY_TTFT = "quality_vs_ttft.png"
FIG_QUALITY_RATIO = "quality_vs_ratio.png"


# -- records ---------------------------------------------------------------------------------------------------


def _key(record: Mapping[str, Any]) -> tuple[str, str, str]:
    return record["dataset"], record["method"], record["case_id"]


def load_records(out_dir: str | os.PathLike[str], *, repair: bool = False) -> list[dict[str, Any]]:
    """Records of `OUT/results.jsonl` (see `records.load_records`)."""
    return _load(out_dir, repair=repair, filename=RESULTS_FILE)


# -- running ---------------------------------------------------------------------------------------------------


def run_quality(
    engine: Any,
    datasets: Sequence[Dataset],
    methods: Sequence[Method],
    out_dir: str | os.PathLike[str],
    *,
    max_new_tokens: int | None = None,
    settings: Mapping[str, Any] | None = None,
    show_progress: bool = True,
) -> list[dict[str, Any]]:
    """Run every supported (data set, method, case) not yet in `out_dir`; return all records.

    `max_new_tokens` overrides each data set's own budget. `settings` (model, dtype, ...) are stored in
    run.json and must match on resume. An engine error on one case (e.g. a prompt beyond the model's context)
    is recorded with the case and the run goes on; any other exception stops the run.
    """
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_run_settings(out, {**(settings or {}), "max_new_tokens": max_new_tokens})
    records = load_records(out, repair=True)
    done = {_key(r) for r in records}
    path = out / RESULTS_FILE
    for ds in datasets:
        spec = ds.spec
        active = [m for m in methods if m.supports(spec)]
        todo = [(c, m) for c in ds.cases for m in active if (spec.name, m.name, c.id) not in done]
        budget = max_new_tokens or spec.max_new_tokens
        bar = tqdm(total=len(todo), desc=f"{spec.name}", unit="run", disable=not show_progress)
        for case, method in todo:
            bar.set_postfix_str(f"{case.id} {method.name}", refresh=True)
            record: dict[str, Any] = {
                "dataset": spec.name,
                "method": method.name,
                "case_id": case.id,
                "task": case.task,
                "metric": METRIC_NAMES[case.task],
            }
            t_warm = time.perf_counter()
            t_run = t_warm
            try:
                method.warm(engine, spec, case)
                t_run = time.perf_counter()
                result = method.run(engine, spec, case, budget)
            except CacheBlendError as e:
                record.update(error=f"{type(e).__name__}: {e}", score=None, ttft_s=None)
            else:
                answer = answer_text(spec, result.text)
                record.update(
                    score=score_answer(case.task, answer, case.answers),
                    ttft_s=result.ttft_s,
                    answer=answer,
                    raw_text=result.text,
                    golds=list(case.answers),
                    prompt_tokens=result.prompt_tokens,
                    recomputed_tokens=result.recomputed_tokens,
                    extra=result.extra,
                )
            t_end = time.perf_counter()
            record.update(warm_s=t_run - t_warm, run_s=t_end - t_run)
            append_record(path, record)
            records.append(record)
            done.add(_key(record))
            bar.update(1)
        bar.close()
    return records


# -- summary ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SummaryRow:
    dataset: str
    method: str
    metric: str
    score: float  # mean over the cases that ran (nan when none did)
    ttft_s: float  # median TTFT over those cases
    n: int  # cases that ran
    errors: int  # cases the engine refused
    ratio: float | None  # blend's recompute ratio, None for other methods
    # Paired with full recompute on the cases both ran (methods may have run on different case counts):
    n_paired: int = 0  # cases with a result of both this method and full
    delta_vs_full: float = math.nan  # mean of (score - full's score) over those cases
    delta_ci95: float = math.nan  # half-width of its 95% confidence interval (normal approximation, n_paired >= 2)
    speedup_vs_full: float = math.nan  # median of full's TTFT / this method's TTFT, case by case
    # Mean metric of this method's answer scored against full recompute's answer as the reference: how closely
    # it reproduces full prefill, which a weak model's low scores against the gold answers cannot show.
    agreement_with_full: float = math.nan
    score_ci: tuple[float, float] = (math.nan, math.nan)  # 95% bootstrap interval of the mean score

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _ratio(method: str) -> float | None:
    """The recompute ratio of "blend@R" or "RULE@R" (a named rule), else None."""
    head, at, tail = method.partition("@")
    if at and head:
        try:
            return float(tail)
        except ValueError:
            return None
    return None


def summarize(records: Iterable[Mapping[str, Any]]) -> list[SummaryRow]:
    """Per (data set, method): mean score, median TTFT, count; in first-seen order."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["dataset"], r["method"]), []).append(r)

    def succeeded(recs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        return [r for r in recs if r.get("error") is None and r.get("score") is not None]

    rows = []
    for (dataset, method), recs in groups.items():
        ok = succeeded(recs)
        full = {r["case_id"]: r for r in succeeded(groups.get((dataset, "full"), []))}
        pairs = [(r, full[r["case_id"]]) for r in ok if r["case_id"] in full]
        ratios = [f["ttft_s"] / r["ttft_s"] for r, f in pairs if r["ttft_s"] and r["ttft_s"] > 0]
        deltas = [r["score"] - f["score"] for r, f in pairs]
        agree = [
            score_answer(r["task"], r["answer"], [f["answer"]])
            for r, f in pairs
            if r.get("task") in METRIC_NAMES and isinstance(r.get("answer"), str) and isinstance(f.get("answer"), str)
        ]
        rows.append(
            SummaryRow(
                dataset=dataset,
                method=method,
                metric=recs[0].get("metric", "score"),
                score=statistics.fmean(r["score"] for r in ok) if ok else math.nan,
                score_ci=bootstrap_ci([r["score"] for r in ok]),
                ttft_s=statistics.median(r["ttft_s"] for r in ok) if ok else math.nan,
                n=len(ok),
                errors=len(recs) - len(ok),
                ratio=_ratio(method),
                n_paired=len(pairs),
                delta_vs_full=statistics.fmean(deltas) if deltas else math.nan,
                delta_ci95=1.96 * statistics.stdev(deltas) / math.sqrt(len(deltas)) if len(deltas) >= 2 else math.nan,
                speedup_vs_full=statistics.median(ratios) if ratios else math.nan,
                agreement_with_full=statistics.fmean(agree) if agree else math.nan,
            )
        )
    return rows


def _ci(r: SummaryRow) -> str:
    if r.method == "full" or math.isnan(r.delta_ci95):
        return "-"
    return ci_text((r.delta_vs_full - r.delta_ci95, r.delta_vs_full + r.delta_ci95), "+.3f")


def summary_markdown(rows: Sequence[SummaryRow]) -> str:
    """One table per data set: method, mean score, median TTFT, n, and the comparison with full recompute on
    the same cases (mean score difference with its 95% confidence interval, the metric of each answer against
    full's answer, median per-case TTFT ratio), which stays fair when methods ran on different numbers of cases
    and is robust to machine load that drifts between cases."""
    lines = []
    for dataset in dict.fromkeys(r.dataset for r in rows):
        sub = [r for r in rows if r.dataset == dataset]
        m = sub[0].metric
        header = [
            "method", m, "median TTFT (s)", "n", f"{m} - full (same cases)", "95% CI", f"{m} vs full's answer",
            "TTFT full / method (median per case)", "paired cases", "errors",
        ]  # fmt: skip
        cells = [
            [
                r.method,
                fmt(r.score, ".3f"),
                fmt(r.ttft_s, ".2f"),
                str(r.n),
                fmt(r.delta_vs_full, "+.3f"),
                _ci(r),
                fmt(r.agreement_with_full, ".3f"),
                fmt(r.speedup_vs_full, ".2f"),
                str(r.n_paired),
                str(r.errors),
            ]  # fmt: skip
            for r in sub
        ]
        lines += [f"### {dataset} ({m})", "", *markdown_table(header, "lrrrrrrrrr", cells), ""]
    return "\n".join(lines)


# -- figures ---------------------------------------------------------------------------------------------------


def plot_quality_vs_ttft(records: Sequence[Mapping[str, Any]], path: str | os.PathLike[str], *, model: str) -> Path:
    """Fig. 12 style: per data set, each method's mean quality (95% bootstrap interval) against its median TTFT.

    Only methods measured on the same cases are compared: per data set, the methods that ran at least half as
    many cases as the best-covered one, on the cases they all finished (each panel's title gives the count)."""
    done = [r for r in records if r.get("error") is None and r.get("score") is not None]
    rows, titles = [], {}
    for dataset, (cases, methods, left) in comparable_cases(done).items():
        sub = summarize(r for r in done if r["dataset"] == dataset and r["method"] in methods and r["case_id"] in cases)
        rows += [r.to_dict() | {"label": r.method, "lo": r.score_ci[0], "hi": r.score_ci[1]} for r in sub]
        dropped = f" ({', '.join(left)} left out)" if left else ""
        titles[dataset] = f"{dataset}: {cases_text(len(cases), 'common ')}{dropped}"
    return plot_panels(
        rows, path, x="ttft_s", y="score", label="label", style="method", xlabel="median TTFT (s)",
        ylabel={r["dataset"]: f"mean {r['metric']} (95% CI)" for r in rows}, title=f"Quality vs TTFT: {model}",
        panel_titles=titles, yerr=("lo", "hi"),
    )  # fmt: skip


def common_cases(records: Iterable[Mapping[str, Any]], methods: Iterable[str]) -> set[tuple[str, str]]:
    """(data set, case id) pairs on which every one of `methods` ran that data set without error."""
    wanted = set(methods)
    ran: dict[tuple[str, str], set[str]] = {}
    for r in records:
        if r.get("error") is None and r.get("score") is not None:
            ran.setdefault((r["dataset"], r["case_id"]), set()).add(r["method"])
    return {case for case, done in ran.items() if wanted <= done}


def plot_quality_vs_ratio(
    records: Sequence[Mapping[str, Any]], path: str | os.PathLike[str], *, model: str
) -> Path | None:
    """Fig. 16 style: blend's quality against its recompute ratio, full recompute and full reuse as lines.

    Per data set, only the cases on which full, reuse (if run) and every blend ratio of that data set ran are
    used, so the curve compares the ratios on the same questions; each panel's title gives that count.
    None (no file) when no data set has blend results at two ratios or more: one point is no curve."""
    data, titles, ylabels = [], {}, {}
    for dataset in dict.fromkeys(r["dataset"] for r in records):
        recs = [r for r in records if r["dataset"] == dataset]
        methods = {r["method"] for r in recs if _ratio(r["method"]) is not None or r["method"] in ("full", "reuse")}
        if len({_ratio(m) for m in methods} - {None}) < 2:
            continue
        cases = common_cases(recs, methods)
        if not cases:
            continue
        rows = summarize(r for r in recs if r["method"] in methods and (dataset, r["case_id"]) in cases)
        data += [r.to_dict() | {"series": r.method.partition("@")[0]} for r in rows]  # "blend" or the rule
        titles[dataset] = f"{dataset} ({len(cases)} cases with every ratio)"
        ylabels[dataset] = f"mean {rows[0].metric}"
    if not data:
        return None
    return plot_panels(
        data, path, x="ratio", y="score", series="series", hlines={"full": "full recompute", "reuse": "full KV reuse"},
        xlabel="recompute ratio r", ylabel=ylabels, title=f"Quality vs recompute ratio: {model}",
        panel_titles=titles,
    )  # fmt: skip


def write_report(
    out_dir: str | os.PathLike[str], records: Sequence[Mapping[str, Any]] | None = None
) -> dict[str, Path]:
    """summary.md, summary.json and the figures from the records (read from `out_dir` when not given).

    The ratio figure is written only when some data set ran blend at two ratios or more (and removed when not,
    so that no figure from an earlier report outlives the results it showed)."""
    out = Path(out_dir)
    if records is None:
        records = load_records(out)
    if not records:
        raise CacheBlendError(f"no results in {out / RESULTS_FILE}; run `python benchmarks/quality.py` first")
    rows = summarize(records)
    model = run_settings(out).get("model", MODEL_UNKNOWN)
    files = {"summary_md": out / SUMMARY_MD, "summary_json": out / SUMMARY_JSON}
    files["summary_md"].write_text("# Quality benchmark\n\n" + summary_markdown(rows))
    write_json(files["summary_json"], [r.to_dict() for r in rows], indent=2)
    if any(r.n for r in rows):
        files["quality_vs_ttft"] = plot_quality_vs_ttft(records, out / FIG_QUALITY_TTFT, model=model)
        ratio_fig = plot_quality_vs_ratio(records, out / FIG_QUALITY_RATIO, model=model)
        if ratio_fig is not None:
            files["quality_vs_ratio"] = ratio_fig
        else:  # fewer than two ratios ran: a figure left by an earlier report would no longer match the results
            (out / FIG_QUALITY_RATIO).unlink(missing_ok=True)
    return files


def write_and_show(out_dir: str | os.PathLike[str], records: Sequence[Mapping[str, Any]]) -> dict[str, Path]:
    """`write_report`, and its tables printed: what `benchmarks/quality.py` and `report.py` end with."""
    files = write_report(out_dir, records)
    print(summary_markdown(summarize(records)))
    return files
