"""Evaluation as in the paper's §7: data sets, quality metrics, the compared methods and the benchmark runner.

`datasets` reads MuSiQue, 2WikiMQA, MultiNews and SAMSum into `Case`s; `scoring` has F1 and Rouge-L;
`methods` runs full recompute, prefix caching, full KV reuse, CacheBlend at a ratio, MapReduce and MapRerank
on the engine; `quality` runs them all, writes one JSONL record per case and the summary table and figures;
`throughput` queues Poisson arrivals of requests that share chunks at several rates (Fig. 14).
Used by `cacheblend-rag bench quality` / `bench report` / `bench throughput`.
"""

from .datasets import Case, Dataset, DatasetError, TaskSpec, load_dataset, resolve_data_dir
from .methods import DEFAULT_METHODS, MapReduce, MapRerank, MethodResult, PrefillMethod, parse_methods
from .quality import load_records, plot_panels, run_quality, summarize, summary_markdown, write_report
from .scoring import best_f1, best_rouge_l, normalize_answer, score_answer, token_f1
from .throughput import (
    DEFAULT_THROUGHPUT_METHODS,
    Served,
    ThroughputSettings,
    Timing,
    Workload,
    WorkloadRequest,
    build_workload,
    max_rate_within_slo,
    parse_rates,
    parse_throughput_methods,
    poisson_arrivals,
    queue_stats,
    replay_queue,
    run_live,
    run_throughput,
    throughput_markdown,
    write_throughput_report,
)

__all__ = [
    "DEFAULT_METHODS",
    "DEFAULT_THROUGHPUT_METHODS",
    "Case",
    "Dataset",
    "DatasetError",
    "MapReduce",
    "MapRerank",
    "MethodResult",
    "PrefillMethod",
    "Served",
    "TaskSpec",
    "ThroughputSettings",
    "Timing",
    "Workload",
    "WorkloadRequest",
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
    "poisson_arrivals",
    "queue_stats",
    "replay_queue",
    "resolve_data_dir",
    "run_live",
    "run_quality",
    "run_throughput",
    "score_answer",
    "summarize",
    "summary_markdown",
    "throughput_markdown",
    "token_f1",
    "write_report",
    "write_throughput_report",
]
