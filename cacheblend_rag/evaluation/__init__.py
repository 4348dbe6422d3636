"""Measuring answers against a reference: the benchmark data sets, answer quality, and fidelity to full recompute.

`datasets` reads MuSiQue, 2WikiMQA, MultiNews and SAMSum into `Case`s with each data set's prompt; `scoring`
has F1 and Rouge-L (`best_score` over alternative golds, `score_answer` per task); `fidelity` measures how
closely a way of prefilling follows full recompute (teacher-forced KL, top-1 and first-token agreement) for one
case and over cases. The benchmarks built on them (quality, throughput, the fidelity sweep) live in the
repository's `benchmarks/` folder, not in this package.
"""

from .datasets import Case, Dataset, DatasetError, TaskSpec, load_dataset, resolve_data_dir
from .fidelity import (
    FidelityStats,
    Reference,
    bootstrap_ci,
    fidelity_over_cases,
    measure,
    measure_with_logits,
    prepare_case,
    reference_answer,
)
from .scoring import best_score, normalize_answer, score_answer

__all__ = [
    "Case",
    "Dataset",
    "DatasetError",
    "FidelityStats",
    "Reference",
    "TaskSpec",
    "best_score",
    "bootstrap_ci",
    "fidelity_over_cases",
    "load_dataset",
    "measure",
    "measure_with_logits",
    "normalize_answer",
    "prepare_case",
    "reference_answer",
    "resolve_data_dir",
    "score_answer",
]
