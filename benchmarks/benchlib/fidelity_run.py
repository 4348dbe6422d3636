"""The fidelity benchmark's runner: every rule at every ratio on every case, one JSONL record per (case, method).

Per case, full recompute's reference answer is computed once (`cacheblend_rag.evaluation.fidelity`), then each
method is measured against it. Records go to `OUT/fidelity.jsonl`, so a run resumes where it stopped;
`fidelity_report` turns them into tables and figures.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchlib.records import append_record, check_run_settings, load_records
from cacheblend_rag.config import BlendConfig, blend_rule
from cacheblend_rag.errors import CacheBlendError, ConfigError
from cacheblend_rag.evaluation.datasets import Case, Dataset, TaskSpec
from cacheblend_rag.evaluation.fidelity import Reference, measure, prepare_case

RESULTS_FILE = "fidelity.jsonl"
DEFAULT_RATIOS = (0.02, 0.05, 0.10, 0.15, 0.30)


@dataclass(frozen=True)
class FidelityMethod:
    """One way to prefill a case: full KV reuse, or blend with a named rule at a ratio."""

    rule: str  # "reuse", or a blend rule name (`config.RULE_NAMES`)
    ratio: float | None = None  # blend only

    def __post_init__(self) -> None:
        if (self.rule == "reuse") != (self.ratio is None):
            raise ConfigError(f"a ratio goes with blend rules only, got rule {self.rule!r}, ratio {self.ratio}")
        if self.ratio is not None:
            blend_rule(self.rule, self.ratio)  # validates name and ratio

    @property
    def name(self) -> str:
        return self.rule if self.ratio is None else f"{self.rule}@{self.ratio:.2f}"

    @property
    def blend(self) -> BlendConfig | None:
        return None if self.ratio is None else blend_rule(self.rule, self.ratio)


def fidelity_methods(rules: Sequence[str], ratios: Sequence[float], *, reuse: bool = True) -> list[FidelityMethod]:
    """Every rule at every ratio (and full KV reuse first, unless `reuse=False`)."""
    if not rules and not reuse:
        raise ConfigError("name at least one rule, or keep full KV reuse")
    methods = [FidelityMethod("reuse")] if reuse else []
    methods += [FidelityMethod(rule, float(r)) for rule in rules for r in ratios]
    return methods


def _interleave(datasets: Sequence[Dataset]) -> Iterator[tuple[TaskSpec, Case]]:
    """Case 1 of every data set, then case 2 of every data set...: a stopped run covers all sets evenly."""
    longest = max((len(ds.cases) for ds in datasets), default=0)
    for i in range(longest):
        for ds in datasets:
            if i < len(ds.cases):
                yield ds.spec, ds.cases[i]


def run_fidelity(
    engine: Any,
    datasets: Sequence[Dataset],
    methods: Sequence[FidelityMethod],
    out_dir: str | os.PathLike[str],
    *,
    settings: dict[str, Any] | None = None,
    show_progress: bool = True,
) -> list[dict[str, Any]]:
    """Measure every (case, method) not yet in `OUT/fidelity.jsonl`; return all records.

    Per case: warm the chunk store (untimed), compute full recompute's reference once, then each method.
    A case whose prompt the engine refuses (e.g. beyond the context) is recorded with its error and skipped.
    """
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_run_settings(out, settings or {})
    records = load_records(out, repair=True, filename=RESULTS_FILE)
    done = {(r["dataset"], r["case_id"], r["method"]) for r in records}
    names = ["full", *(m.name for m in methods)]
    work = [(s, c) for s, c in _interleave(datasets) if any((s.name, c.id, n) not in done for n in names)]
    bar = tqdm(work, desc="fidelity", unit="case", disable=not show_progress)
    for spec, case in bar:
        bar.set_postfix_str(f"{spec.name} {case.id}", refresh=True)
        base = {"dataset": spec.name, "case_id": case.id, "task": case.task}
        try:
            prompt, ref = prepare_case(engine, spec, case)
        except CacheBlendError as e:
            rec = {**base, "method": "full", "error": f"{type(e).__name__}: {e}"}
            append_record(out / RESULTS_FILE, rec)
            records.append(rec)
            continue
        todo: list[tuple[str, dict[str, Any]]] = []
        if (spec.name, case.id, "full") not in done:
            todo.append(("full", _full_record(ref)))
        for method in methods:
            if (spec.name, case.id, method.name) not in done:
                rec = measure(engine, prompt, ref, method.blend)
                rec.update(rule=method.rule, ratio=method.ratio)
                todo.append((method.name, rec))
        for name, rec in todo:
            rec = {**base, "method": name, "answer_tokens": len(ref.token_ids), "prompt_tokens": ref.prompt_tokens,
                   **rec}  # fmt: skip
            append_record(out / RESULTS_FILE, rec)
            records.append(rec)
            done.add((spec.name, case.id, name))
    return records


def _full_record(ref: Reference) -> dict[str, Any]:
    """Full recompute against its own reference: the zero point of every figure."""
    logprob = float(ref.logprobs.gather(1, torch.tensor(ref.token_ids)[:, None]).sum())
    return {
        "rule": "full", "ratio": None, "kl_mean": 0.0, "kl_max": 0.0, "top1": 1.0, "first_token": 1.0,
        "logprob": logprob, "ttft_s": ref.ttft_s, "compute_share": 1.0, "recomputed_share": 1.0,
        "reference": ref.text,
    }  # fmt: skip
