"""Evaluation as in the paper's §7: data sets, quality metrics, the compared methods and the benchmark runner.

`datasets` reads MuSiQue, 2WikiMQA, MultiNews and SAMSum into `Case`s; `scoring` has F1 and Rouge-L;
`methods` runs full recompute, prefix caching, full KV reuse, CacheBlend at a ratio, MapReduce and MapRerank
on the engine; `quality` runs them all, writes one JSONL record per case and the summary table and figures.
Used by `cacheblend-rag bench quality` / `bench report`.
"""

from .datasets import Case, Dataset, DatasetError, TaskSpec, load_dataset, resolve_data_dir
from .methods import DEFAULT_METHODS, MapReduce, MapRerank, MethodResult, PrefillMethod, parse_methods
from .quality import load_records, plot_panels, run_quality, summarize, summary_markdown, write_report
from .scoring import best_f1, best_rouge_l, normalize_answer, score_answer, token_f1

__all__ = [
    "DEFAULT_METHODS",
    "Case",
    "Dataset",
    "DatasetError",
    "MapReduce",
    "MapRerank",
    "MethodResult",
    "PrefillMethod",
    "TaskSpec",
    "best_f1",
    "best_rouge_l",
    "load_dataset",
    "load_records",
    "normalize_answer",
    "parse_methods",
    "plot_panels",
    "resolve_data_dir",
    "run_quality",
    "score_answer",
    "summarize",
    "summary_markdown",
    "token_f1",
    "write_report",
]
