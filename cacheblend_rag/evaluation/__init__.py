"""Evaluation as in the paper's §7: data sets, quality metrics, the compared methods and the benchmark runner.

`datasets` reads MuSiQue, 2WikiMQA, MultiNews and SAMSum into `Case`s; `scoring` has F1 and Rouge-L;
`methods` runs full recompute, prefix caching, full KV reuse, CacheBlend at a ratio, MapReduce and MapRerank
on the engine; `quality` runs them all, writes one JSONL record per case and the summary table and figures;
`throughput` serves the extended `workload` and queues it (`queueing`: Poisson arrivals, one FIFO server) at
several rates (Fig. 14), with typed results in `throughput_report`. Both reports use `report` (formatting,
tables, JSON, figures).
Used by `cacheblend-rag bench quality` / `bench report` / `bench throughput`.
"""

from .datasets import Case, Dataset, DatasetError, TaskSpec, load_dataset, resolve_data_dir
from .methods import DEFAULT_METHODS, MapReduce, MapRerank, MethodResult, PrefillMethod, parse_methods
from .quality import SummaryRow, load_records, run_quality, summarize, summary_markdown, write_report
from .queueing import (
    LiveRun,
    QueueStats,
    Served,
    Timing,
    max_rate_within_slo,
    poisson_arrivals,
    queue_stats,
    replay_queue,
    run_live,
)
from .report import plot_panels
from .scoring import best_f1, best_rouge_l, normalize_answer, score_answer, token_f1
from .throughput import run_throughput, serve_request
from .throughput_report import (
    MethodRow,
    RateRow,
    RequestRecord,
    ServedPass,
    ThroughputResult,
    WorkloadSummary,
    plot_throughput,
    throughput_markdown,
    write_throughput_report,
)
from .throughput_settings import DEFAULT_THROUGHPUT_METHODS, ThroughputSettings, parse_rates, parse_throughput_methods
from .workload import Workload, WorkloadRequest, build_workload

__all__ = [
    "DEFAULT_METHODS",
    "DEFAULT_THROUGHPUT_METHODS",
    "Case",
    "Dataset",
    "DatasetError",
    "LiveRun",
    "MapReduce",
    "MapRerank",
    "MethodResult",
    "MethodRow",
    "PrefillMethod",
    "QueueStats",
    "RateRow",
    "RequestRecord",
    "Served",
    "ServedPass",
    "SummaryRow",
    "TaskSpec",
    "ThroughputResult",
    "ThroughputSettings",
    "Timing",
    "Workload",
    "WorkloadRequest",
    "WorkloadSummary",
    "best_f1",
    "best_rouge_l",
    "build_workload",
    "load_dataset",
    "load_records",
    "max_rate_within_slo",
    "normalize_answer",
    "parse_methods",
    "parse_rates",
    "parse_throughput_methods",
    "plot_panels",
    "plot_throughput",
    "poisson_arrivals",
    "queue_stats",
    "replay_queue",
    "resolve_data_dir",
    "run_live",
    "run_quality",
    "run_throughput",
    "score_answer",
    "serve_request",
    "summarize",
    "summary_markdown",
    "throughput_markdown",
    "token_f1",
    "write_report",
    "write_throughput_report",
]
