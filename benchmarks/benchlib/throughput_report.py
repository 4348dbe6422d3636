"""The throughput benchmark's results, typed, and their report: `results.json`, `summary.md` and a figure.

`ThroughputResult` holds what a run measured: per data set its workload, every pass's per-request records, one
`RateRow` per (method, rate) and one `MethodRow` per method. `results.json` is its `to_dict()`, and
`ThroughputResult.from_dict` reads it back, so `write_throughput_report` can redraw the report from the file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from benchlib.queueing import QueueStats, Served, Timing
from benchlib.records import MODEL_UNKNOWN
from benchlib.report import fmt, markdown_table, pyplot, save_figure, write_json
from benchlib.throughput_settings import ThroughputSettings
from cacheblend_rag.errors import CacheBlendError

__all__ = [
    "FIGURE",
    "REPEAT_NOTE",
    "RESULTS_JSON",
    "SUMMARY_MD",
    "MethodRow",
    "RateRow",
    "RequestRecord",
    "ServedPass",
    "ThroughputResult",
    "WorkloadSummary",
    "plot_throughput",
    "throughput_markdown",
    "write_throughput_report",
]

RESULTS_JSON = "results.json"
SUMMARY_MD = "summary.md"
FIGURE = "ttft_vs_rate.png"
REPEAT_NOTE = (
    "each question is asked `repeats` times, its top-k chunks in a new random order each time; the paper used "
    "GPT-4 paraphrases of the question instead, which this offline benchmark cannot make"
)


@dataclass(frozen=True)
class RequestRecord:
    """One served request of a pass: which it was, what it cost, and (live mode) when it ran in the queue."""

    index: int  # position in the served sequence (its chunks: the workload's sequence at this index)
    case_id: str
    repeat: int
    served: Served
    timing: Timing | None = None  # live mode only: a replayed pass is the same at every rate

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"index": self.index, "case_id": self.case_id, "repeat": self.repeat}
        d.update(asdict(self.served))
        if self.timing is not None:
            t = self.timing
            d.update(arrival_s=t.arrival_s, start_s=t.start_s, finish_s=t.finish_s, queued_ttft_s=t.ttft_s)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RequestRecord:
        served = Served(**{f.name: d[f.name] for f in fields(Served) if f.name in d})
        timing = None
        if "queued_ttft_s" in d:
            timing = Timing(d["index"], d["arrival_s"], d["start_s"], d["finish_s"], d["queued_ttft_s"])
        return cls(d["index"], d["case_id"], d["repeat"], served, timing)


@dataclass(frozen=True)
class ServedPass:
    dataset: str
    method: str
    rate: float | None  # the live pass's rate; None for a replayed pass, which serves every rate
    records: tuple[RequestRecord, ...]

    def to_dict(self) -> dict[str, Any]:
        d = {"dataset": self.dataset, "method": self.method, "rate": self.rate}
        return d | {"records": [r.to_dict() for r in self.records]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ServedPass:
        records = tuple(RequestRecord.from_dict(r) for r in d["records"])
        return cls(d["dataset"], d["method"], d["rate"], records)


@dataclass(frozen=True)
class RateRow:
    """One (data set, method, rate): the queue's figures over the measured requests."""

    dataset: str
    method: str
    rate: float  # req/s
    stats: QueueStats

    def to_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "method": self.method, "rate": self.rate} | asdict(self.stats)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RateRow:
        stats = QueueStats(**{f.name: _number(d[f.name]) for f in fields(QueueStats)})
        return cls(d["dataset"], d["method"], d["rate"], stats)


@dataclass(frozen=True)
class MethodRow:
    """One (data set, method): the requests' own cost, and the rates that meet the TTFT target."""

    dataset: str
    method: str
    own_ttft_p50_s: float  # median TTFT with no queue in front
    service_mean_s: float  # mean time a request holds the server
    capacity_rps: float  # 1 / service_mean_s
    hit_rate: float
    slo_s: float | None  # the TTFT target, if one was set
    max_tested_rate_within_slo: float | None = None  # highest rate run whose p90 TTFT met the target
    max_rate_within_slo: float | None = None  # replay only: the exact edge (inf: any rate; None: none)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MethodRow:
        measured = ("own_ttft_p50_s", "service_mean_s", "capacity_rps", "hit_rate")  # null there was nan
        return cls(**{f.name: _number(d[f.name]) if f.name in measured else d[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class WorkloadSummary:
    dataset: str
    cases: int  # questions the requests were made from
    chunks: int  # size of the chunk database
    requests: int
    warmup: int  # first requests served but not measured
    sequence: tuple[tuple[str, int, tuple[int, ...]], ...]  # (case id, repeat, chunk indices) per request, in order

    def to_dict(self) -> dict[str, Any]:
        sequence = [{"case_id": c, "repeat": r, "chunks": list(ch)} for c, r, ch in self.sequence]
        return {"dataset": self.dataset, "cases": self.cases, "chunks": self.chunks, "requests": self.requests,
                "warmup": self.warmup, "sequence": sequence}  # fmt: skip

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WorkloadSummary:
        sequence = tuple((s["case_id"], s["repeat"], tuple(s["chunks"])) for s in d["sequence"])
        return cls(d["dataset"], d["cases"], d["chunks"], d["requests"], d["warmup"], sequence)


@dataclass
class ThroughputResult:
    """What `run_throughput` measured; filled in pass by pass (results.json is rewritten after each)."""

    settings: ThroughputSettings
    store_bytes: int  # the memory store's budget per pass, in bytes
    info: dict[str, Any] = field(default_factory=dict)  # facts about the run, e.g. the model's name
    note: str = REPEAT_NOTE
    workloads: list[WorkloadSummary] = field(default_factory=list)
    passes: list[ServedPass] = field(default_factory=list)
    rows: list[RateRow] = field(default_factory=list)
    methods: list[MethodRow] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": {**self.settings.to_dict(), "store_bytes": self.store_bytes, **self.info},
            "note": self.note,
            "workloads": [w.to_dict() for w in self.workloads],
            "passes": [p.to_dict() for p in self.passes],
            "rows": [r.to_dict() for r in self.rows],
            "methods": [m.to_dict() for m in self.methods],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ThroughputResult:
        raw = dict(d["settings"])
        settings = ThroughputSettings.from_dict({k: v for k, v in raw.items() if k != "store_bytes"})
        names = {f.name for f in fields(ThroughputSettings)} | {"store_bytes"}
        return cls(
            settings=settings,
            store_bytes=raw["store_bytes"],
            info={k: v for k, v in raw.items() if k not in names},
            note=d.get("note", REPEAT_NOTE),
            workloads=[WorkloadSummary.from_dict(w) for w in d["workloads"]],
            passes=[ServedPass.from_dict(p) for p in d["passes"]],
            rows=[RateRow.from_dict(r) for r in d["rows"]],
            methods=[MethodRow.from_dict(m) for m in d["methods"]],
        )


def _number(x: Any) -> Any:
    """JSON's null back to what it stood for: nan in the statistics (see `report.jsonable`)."""
    return float("nan") if x is None else x


def throughput_markdown(result: ThroughputResult) -> str:
    """Per data set: a row per (method, rate), then a row per method with its own cost and the TTFT target."""
    s = result.settings
    slo = s.ttft_slo_s
    lines = [
        f"Mode {s.mode}; top {s.top_k} chunks of <= {s.chunk_tokens} tokens per request; {s.max_new_tokens} new "
        f"tokens; store {result.store_bytes / 2**20:.0f} MiB per method. Questions are repeated, not paraphrased: "
        f"{result.note}. TTFT counts the wait in the queue; hit rate = prompt chunks read from the store / prompt "
        "chunks.",
        "",
    ]
    for w in result.workloads:
        rate_cells = [
            [
                r.method,
                fmt(r.rate, "g"),
                fmt(r.stats.ttft_p50_s, ".3f"),
                fmt(r.stats.ttft_p90_s, ".3f"),
                fmt(r.stats.ttft_p99_s, ".3f"),
                fmt(r.stats.ttft_mean_s, ".3f"),
                fmt(r.stats.throughput_rps, ".4f"),
                fmt(r.stats.hit_rate, ".2f"),
                str(r.stats.n),
            ]  # fmt: skip
            for r in result.rows
            if r.dataset == w.dataset
        ]
        header = ["method", "rate (req/s)", "TTFT p50 (s)", "p90", "p99", "mean", "completed req/s", "hit rate", "n"]
        lines += [
            f"### {w.dataset} extended ({w.cases} questions, {w.chunks} chunks, {w.requests} requests, "
            f"first {w.warmup} not measured)",
            "",
            *markdown_table(header, "lrrrrrrrr", rate_cells),
            "",
        ]
        header = ["method", "own TTFT p50 (s)", "mean service (s)", "capacity (req/s)", "hit rate"]
        if slo is not None:
            header += [f"max tested rate, p90 <= {slo:g} s", "max rate (replay)"]
        method_cells = []
        for m in (m for m in result.methods if m.dataset == w.dataset):
            cells = [m.method, fmt(m.own_ttft_p50_s, ".3f"), fmt(m.service_mean_s, ".3f")]
            cells += [fmt(m.capacity_rps, ".4f"), fmt(m.hit_rate, ".2f")]
            if slo is not None:
                cells += [fmt(m.max_tested_rate_within_slo, "g"), fmt(m.max_rate_within_slo, ".4g")]
            method_cells.append(cells)
        lines += [*markdown_table(header, "l" + "r" * (len(header) - 1), method_cells), ""]
    return "\n".join(lines)


_PANELS = (  # (x, y, x label, y label): TTFT against the offered rate, and against the rate actually completed
    ("rate", "ttft_p50_s", "request rate (req/s)", "TTFT p50 (s)"),
    ("rate", "ttft_p90_s", "request rate (req/s)", "TTFT p90 (s)"),
    ("throughput_rps", "ttft_p90_s", "completed requests/s", "TTFT p90 (s)"),
)


def plot_throughput(result: ThroughputResult, path: str | os.PathLike[str]) -> Path:
    """Fig. 14 style, one row of panels per data set: TTFT p50 and p90 against the request rate, and p90 against
    the completed requests per second; one line per method, the TTFT target dashed."""
    plt = pyplot()
    names = [w.dataset for w in result.workloads]
    if not names:
        raise CacheBlendError("nothing to plot: no data set was run")
    slo = result.settings.ttft_slo_s
    fig, axes = plt.subplots(len(names), len(_PANELS), figsize=(13, 3.8 * len(names)), squeeze=False)
    for row_axes, name in zip(axes, names, strict=True):
        rows = [r.to_dict() for r in result.rows if r.dataset == name]
        for ax, (x, y, xlabel, ylabel) in zip(row_axes, _PANELS, strict=True):
            for method in dict.fromkeys(r["method"] for r in rows):
                pts = sorted((r[x], r[y]) for r in rows if r["method"] == method and not math.isnan(r[x] + r[y]))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
            xs = [r[x] for r in rows if r[x] > 0]
            if xs and max(xs) / min(xs) > 20:
                ax.set_xscale("log")
            if slo is not None:
                ax.axhline(slo, linestyle="--", linewidth=1, color="grey", label=f"target {slo:g} s")
            ax.set_title(f"{name} extended")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    model = result.info.get("model", MODEL_UNKNOWN)
    fig.suptitle(f"TTFT under Poisson arrivals (one server, FIFO): {model}")
    return save_figure(fig, path)


def save_result(out_dir: str | os.PathLike[str], result: ThroughputResult) -> Path:
    """results.json of `result` (written atomically: an interrupted run keeps the passes it finished)."""
    return write_json(Path(out_dir) / RESULTS_JSON, result.to_dict())


def write_throughput_report(out_dir: str | os.PathLike[str], result: ThroughputResult | None = None) -> dict[str, Path]:
    """results.json, summary.md and the figure from a `run_throughput` result (read from `out_dir` if not given)."""
    out = Path(out_dir)
    path = out / RESULTS_JSON
    if result is None:
        if not path.exists():
            raise CacheBlendError(f"no results at {path}; run `python benchmarks/throughput.py` first")
        result = ThroughputResult.from_dict(json.loads(path.read_text()))
    else:
        save_result(out, result)
    files = {"results": path, "summary_md": out / SUMMARY_MD}
    files["summary_md"].write_text("# Throughput benchmark (Fig. 14)\n\n" + throughput_markdown(result))
    if result.rows:
        files["figure"] = plot_throughput(result, out / FIGURE)
    return files
