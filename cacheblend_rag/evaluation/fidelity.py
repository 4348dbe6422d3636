"""Fidelity to full recompute, measured by teacher forcing.

For each case, full recompute writes the reference answer greedily (the data set's answer budget). Every
method then prefills the same prompt and is fed the reference tokens; at each step its next-token
distribution is compared with full recompute's:
- KL(full || method) in nats, mean and max over the answer;
- top-1 agreement: the share of reference tokens that the method also ranks first;
- first-token agreement, and the log-probability the method gives the whole reference.
This is deterministic, needs no gold answer, and separates methods with a few dozen cases, where F1 on a small
model moves by ~0.13 whenever one answer flips.

`measure` gives these figures for one case and one way to prefill it; `fidelity_over_cases` averages them over
cases, with bootstrap 95% intervals (`bootstrap_ci`) on KL and top-1 agreement. The fidelity benchmark
(`benchmarks/fidelity.py`) runs them over data sets, rules and ratios.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..config import BlendConfig
from .datasets import Case, TaskSpec

if TYPE_CHECKING:
    from ..engine import CacheBlendEngine, TokenizedPrompt

__all__ = [
    "FidelityStats",
    "Reference",
    "bootstrap_ci",
    "compare",
    "fidelity_over_cases",
    "measure",
    "measure_with_logits",
    "prepare_case",
    "reference_answer",
    "teacher_forced_logits",
    "token_kl",
]


@dataclass
class Reference:
    """Full recompute's greedy answer and its next-token log-probabilities along it."""

    token_ids: list[int]  # ends with the end-of-turn token when full recompute stopped by itself
    logprobs: torch.Tensor  # [T, vocab] float32, log-softmax of full's logits before each reference token
    text: str
    ttft_s: float
    prompt_tokens: int


def reference_answer(engine: CacheBlendEngine, prompt: TokenizedPrompt, max_new_tokens: int) -> Reference:
    """Full prefill, then greedy decoding of up to `max_new_tokens` tokens, keeping full's distributions.

    Its full prefill stores no chunk KV as it is in this prompt (a full prefill asked for never does), so the
    methods measured after it read the entries they would read without it."""
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


def prepare_case(
    engine: CacheBlendEngine, spec: TaskSpec, case: Case, *, context: Any = None
) -> tuple[TokenizedPrompt, Reference]:
    """A case's prompt (the data set's template), its chunks warmed in the store (untimed), and full recompute's
    reference answer: what every method of a case is measured against.

    `context` is `engine.precompute`'s: None (the default) stores each chunk's KV prefilled alone after the
    prefix (isolated entries, the baseline every fidelity figure is measured on)."""
    prompt = engine.build_prompt(list(case.chunks), case.question, template=spec.template)
    engine.precompute(list(case.chunks), case.question, template=spec.template, context=context)
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


def teacher_forced_logits(engine: CacheBlendEngine, prefill: Any, reference: Reference) -> torch.Tensor:
    """[T, vocab]: the prefill's last logits, then one forward over the reference's first T-1 tokens."""
    rows = [prefill.logits[None]]
    if len(reference.token_ids) > 1:
        rows.append(engine.extend(prefill, reference.token_ids[:-1]))
    return torch.cat(rows)


def measure(
    engine: CacheBlendEngine, prompt: TokenizedPrompt, reference: Reference, blend: BlendConfig | None
) -> dict[str, Any]:
    """One way to prefill `prompt` (`blend`, or full KV reuse for None) against full recompute's `reference`:
    the figures of `compare`, with its TTFT (prefill and first token, warm store) and how much it recomputed."""
    return measure_with_logits(engine, prompt, reference, blend)[0]


def measure_with_logits(
    engine: CacheBlendEngine, prompt: TokenizedPrompt, reference: Reference, blend: BlendConfig | None
) -> tuple[dict[str, Any], torch.Tensor]:
    """`measure`, and the method's first-token logits ([vocab]): to compare methods of one case with each other
    (e.g. whether two budgets pick the same first token, as the guard's ladder asks)."""
    t0 = time.perf_counter()
    mode = "reuse" if blend is None else "blend"
    pre = engine.prefill(prompt, mode, blend=blend)
    first = int(pre.logits.argmax())
    ttft = time.perf_counter() - t0
    m = pre.metrics
    record = compare(reference, teacher_forced_logits(engine, pre, reference))
    record.update(
        ttft_s=ttft,
        first_token_id=first,
        compute_share=m.compute_share,
        recomputed_share=m.recomputed_tokens / max(m.prompt_tokens, 1),
        recomputed_tokens=m.recomputed_tokens,
        reused_tokens=m.reused_tokens,
        risk=m.risk,  # the blend's risk signals (the "attention" rule), for the guard's study
        escalations=list(m.escalations),
        guard_reason=m.guard_reason,
    )
    return record, pre.logits.detach().float().reshape(-1).clone()


BOOTSTRAP_SAMPLES = 2000


def bootstrap_ci(values: Sequence[float], *, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean (resampling cases); nan for no values."""
    import numpy as np

    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return (float("nan"), float("nan"))
    if x.size == 1:
        return (float(x[0]), float(x[0]))
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(BOOTSTRAP_SAMPLES, x.size))].mean(axis=1)
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return float(lo), float(hi)


@dataclass(frozen=True)
class FidelityStats:
    """`measure`'s figures over several cases: means, with 95% bootstrap intervals on KL and top-1 agreement."""

    n: int  # cases
    kl_mean: float  # mean over cases of each case's mean KL(full || method), nats
    kl_ci: tuple[float, float]
    kl_max: float  # mean over cases of each case's largest KL
    top1: float
    top1_ci: tuple[float, float]
    first_token: float  # share of cases whose first token matches full recompute's
    logprob: float
    compute_share: float
    ttft_s: float  # median


def fidelity_over_cases(records: Sequence[Mapping[str, Any]]) -> FidelityStats:
    """The figures of `measure` (one record per case, in a fixed order: the intervals are seeded) over cases."""
    if not records:
        raise ValueError("no case to average over")
    kl = [r["kl_mean"] for r in records]
    top1 = [r["top1"] for r in records]
    return FidelityStats(
        n=len(records),
        kl_mean=statistics.fmean(kl),
        kl_ci=bootstrap_ci(kl),
        kl_max=statistics.fmean(r["kl_max"] for r in records),
        top1=statistics.fmean(top1),
        top1_ci=bootstrap_ci(top1),
        first_token=statistics.fmean(r["first_token"] for r in records),
        logprob=statistics.fmean(r["logprob"] for r in records),
        compute_share=statistics.fmean(r["compute_share"] for r in records),
        ttft_s=statistics.median(r["ttft_s"] for r in records),
    )
