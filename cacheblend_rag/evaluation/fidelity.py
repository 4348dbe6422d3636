"""Fidelity to full recompute, measured by teacher forcing (the fidelity benchmark of docs/benchmarks.md).

For each case, full recompute writes the reference answer greedily (the data set's answer budget). Every
method then prefills the same prompt and is fed the reference tokens; at each step its next-token
distribution is compared with full recompute's:
- KL(full || method) in nats, mean and max over the answer;
- top-1 agreement: the share of reference tokens that the method also ranks first;
- first-token agreement, and the log-probability the method gives the whole reference.
This is deterministic, needs no gold answer, and separates methods with a few dozen cases, where F1 on a small
model moves by ~0.13 whenever one answer flips.

Records go to `OUT/fidelity.jsonl`, one per (data set, case, method), so a run resumes where it stopped.
`fidelity_report` turns them into tables and figures.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import BlendConfig, blend_rule
from ..errors import CacheBlendError, ConfigError
from .datasets import Case, Dataset, TaskSpec
from .records import append_record, check_run_settings, load_records

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


@dataclass
class Reference:
    """Full recompute's greedy answer and its next-token log-probabilities along it."""

    token_ids: list[int]  # ends with the end-of-turn token when full recompute stopped by itself
    logprobs: torch.Tensor  # [T, vocab] float32, log-softmax of full's logits before each reference token
    text: str
    ttft_s: float
    prompt_tokens: int


def reference_answer(engine: Any, prompt: Any, max_new_tokens: int) -> Reference:
    """Full prefill, then greedy decoding of up to `max_new_tokens` tokens, keeping full's distributions."""
    t0 = time.perf_counter()
    pre = engine.prefill(prompt, "full")
    token = int(pre.logits.argmax())
    ttft = time.perf_counter() - t0
    rows, tokens = [pre.logits], [token]
    while token not in engine.eos_ids and len(tokens) < max_new_tokens:
        rows.append(engine.extend(pre, [token])[-1])
        token = int(rows[-1].argmax())
        tokens.append(token)
    answer = [t for t in tokens if t not in engine.eos_ids]
    text = engine.tokenizer.decode(answer, skip_special_tokens=True)
    logprobs = torch.log_softmax(torch.stack(rows).float(), dim=-1)
    return Reference(tokens, logprobs, text, ttft, prompt.num_tokens)


def prepare_case(engine: Any, spec: TaskSpec, case: Case) -> tuple[Any, Reference]:
    """A case's prompt (the data set's template), its chunks warmed in the store (untimed), and full recompute's
    reference answer: what every method of a case is measured against."""
    prompt = engine.build_prompt(list(case.chunks), case.question, template=spec.template)
    engine.precompute(list(case.chunks), case.question, template=spec.template)
    return prompt, reference_answer(engine, prompt, spec.max_new_tokens)


def token_kl(reference: Reference, logits: torch.Tensor) -> torch.Tensor:
    """[T] KL(full || method) in nats before each reference token, from the method's teacher-forced logits
    ([T, vocab], row t before reference token t)."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    logp = reference.logprobs
    return (logp.exp() * (logp - logq)).sum(dim=-1).clamp_min(0.0)


def compare(reference: Reference, logits: torch.Tensor) -> dict[str, float]:
    """Teacher-forced comparison of one method's logits ([T, vocab], row t before reference token t)."""
    logq = torch.log_softmax(logits.float(), dim=-1)  # [T, V]
    ref = torch.tensor(reference.token_ids)
    kl = token_kl(reference, logits)  # [T]
    picks = logq.argmax(dim=-1)  # [T]
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1": float((picks == ref).float().mean()),
        "first_token": float(picks[0] == ref[0]),
        "logprob": float(logq.gather(1, ref[:, None]).sum()),
    }


def teacher_forced_logits(engine: Any, prefill: Any, reference: Reference) -> torch.Tensor:
    """[T, vocab]: the prefill's last logits, then one forward over the reference's first T-1 tokens."""
    rows = [prefill.logits[None]]
    if len(reference.token_ids) > 1:
        rows.append(engine.extend(prefill, reference.token_ids[:-1]))
    return torch.cat(rows)


def measure(engine: Any, prompt: Any, reference: Reference, method: FidelityMethod) -> dict[str, Any]:
    """One method's fidelity figures on one prompt, with its TTFT (prefill and first token, warm store)."""
    return measure_blend(engine, prompt, reference, method.blend)


def measure_blend(engine: Any, prompt: Any, reference: Reference, blend: BlendConfig | None) -> dict[str, Any]:
    """`measure` for any `BlendConfig` (None: full KV reuse)."""
    t0 = time.perf_counter()
    mode = "reuse" if blend is None else "blend"
    pre = engine.prefill(prompt, mode, blend=blend)
    int(pre.logits.argmax())
    ttft = time.perf_counter() - t0
    m = pre.metrics
    record = compare(reference, teacher_forced_logits(engine, pre, reference))
    record.update(
        ttft_s=ttft,
        compute_share=m.compute_share,
        recomputed_share=m.recomputed_tokens / max(m.prompt_tokens, 1),
        recomputed_tokens=m.recomputed_tokens,
        reused_tokens=m.reused_tokens,
    )
    return record


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
                rec = measure(engine, prompt, ref, method)
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
