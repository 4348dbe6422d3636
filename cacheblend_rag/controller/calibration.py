"""Measuring a fidelity profile: each question of a sample under full KV reuse and a blend at every ratio of a grid,
against full recompute's greedy answer (teacher forcing, `evaluation.fidelity`).

Per question: one full prefill and greedy decoding (the reference), then reuse and one blend per ratio, each
prefilled and teacher-forced over the reference. The guard's decisions are recorded along the way (the base
blend's risk signals; each ladder blend's first token against the previous blend's), so every guard threshold
is replayed from these records (`FidelityProfile.outcome`) instead of being run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config import Guard
from ..errors import ConfigError
from ..guard import kl
from .fidelity_profile import DEFAULT_LADDER, DEFAULT_MARGINS, DEFAULT_RATIOS, DEFAULT_THRESHOLDS, FidelityProfile

if TYPE_CHECKING:
    from ..engine import CacheBlendEngine, PromptTemplate, TokenizedPrompt
    from ..evaluation import Reference


@dataclass(frozen=True)
class SampleQuestion:
    """One question of the sample: its chunks (retrieved, or a data set's), how it is prompted, the answer budget."""

    id: str
    chunks: tuple[str, ...]
    question: str
    template: PromptTemplate | None = None  # None: the engine's
    max_new_tokens: int = 32  # length of full recompute's reference answer


def _figures(engine: CacheBlendEngine, prompt: TokenizedPrompt, reference: Reference, mode: str, blend: Any) -> Any:
    """(record, first-token logits [vocab]) of one prefill, teacher-forced over the reference."""
    from ..evaluation.fidelity import compare, teacher_forced_logits

    pre = engine.prefill(prompt, mode, blend=blend)
    logits = teacher_forced_logits(engine, pre, reference)  # [T, vocab]; row 0 is the prefill's own
    record = compare(reference, logits)
    record = {k: record[k] for k in ("first_token", "top1", "kl_mean")}
    record["compute_share"] = pre.metrics.compute_share
    return record, logits[0], pre.metrics


def measure_question(
    engine: CacheBlendEngine,
    sample: SampleQuestion,
    *,
    ratios: Sequence[float],
    base_ratio: float,
    ladder: Sequence[float],
    context: Any = "auto",
) -> dict[str, Any]:
    """One question's record of a fidelity profile (see `FidelityProfile`). `context`: how its chunks' KV is
    built, as `engine.precompute` takes it ("auto": as the engine's chunk_context says)."""
    from ..evaluation import reference_answer

    t0 = time.perf_counter()
    chunks = list(sample.chunks)
    # every method reads warm chunks, built as requests will read them (`context`: `engine.precompute`'s)
    engine.precompute(chunks, sample.question, template=sample.template, context=context)
    prompt = engine.build_prompt(chunks, sample.question, template=sample.template)
    reference = reference_answer(engine, prompt, sample.max_new_tokens)
    reuse, _, _ = _figures(engine, prompt, reference, "reuse", None)
    fixed, first_logits, risk = [], {}, None
    for ratio in sorted(set(ratios)):
        record, first, metrics = _figures(engine, prompt, reference, "blend", engine.config.blend.with_ratio(ratio))
        fixed.append({"ratio": ratio, **record})
        first_logits[ratio] = first
        if ratio == base_ratio:
            risk = metrics.risk
    assert risk is not None, "the attention rule's blend records its risk signals"
    steps, previous = [], first_logits[base_ratio]
    for ratio in (r for r in ladder if r > base_ratio):
        current = first_logits[ratio]
        same = int(current.argmax()) == int(previous.argmax())
        steps.append({"ratio": ratio, "agree_prev": same, "kl_prev": kl(current, previous)})
        previous = current
    return {
        "id": sample.id,
        "prompt_tokens": prompt.num_tokens,
        "answer_tokens": len(reference.token_ids),
        "reuse": reuse,
        "fixed": fixed,
        "risk": risk,
        "steps": steps,
        "seconds": time.perf_counter() - t0,
    }


def measure_fidelity(
    engine: CacheBlendEngine,
    sample: Iterable[SampleQuestion],
    *,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    margins: Sequence[float] = DEFAULT_MARGINS,
    base_ratio: float | None = None,
    ladder: Sequence[float] = DEFAULT_LADDER,
    source: str = "",
    on_question: Callable[[dict[str, Any]], None] | None = None,
    context: Any = "auto",
    done: Mapping[str, dict[str, Any]] | None = None,
) -> FidelityProfile:
    """A fidelity profile of `engine` (its rule; base ratio: its blend's, unless given) over `sample`.

    The grid is extended with the base ratio and the ladder, whose records the guard's replay reads.
    `on_question` sees each question's record as it is measured (progress, a journal); `done` holds records of
    questions measured before (by id, e.g. read back from that journal): they are used as they are, not measured
    again, where they cover the same ratios."""
    base = engine.config.blend.recompute_ratio if base_ratio is None else float(base_ratio)
    check_grid(ratios, thresholds, base, ladder, margins)
    if not engine.config.blend.uses_attention_pass:
        raise ConfigError(
            f"the guard reads the 'attention' rule's first pass, but the engine's rule is "
            f"{engine.config.blend.rule!r}; calibrate an engine with blend_rule('attention', r)"
        )
    if not engine.config.blend.full_probe:
        raise ConfigError(
            f"the guard reads full reuse's logits from a first pass over every layer, but the engine's blend has "
            f"probe_depth={engine.config.blend.probe_depth:g}; calibrate an engine with probe_depth=1.0"
        )
    grid = tuple(sorted({*map(float, ratios), base, *map(float, ladder)}))
    questions = []
    for item in sample:
        record = (done or {}).get(item.id)
        if record is None or {r.get("ratio") for r in record.get("fixed", ())} != set(grid):
            record = measure_question(engine, item, ratios=grid, base_ratio=base, ladder=ladder, context=context)
            if on_question is not None:
                on_question(record)
        questions.append(record)
    return FidelityProfile(
        model=engine.fingerprint,
        dtype=engine.config.dtype,
        rule=engine.config.blend.rule,
        base_ratio=base,
        ratios=grid,
        ladder=tuple(float(r) for r in ladder),
        thresholds=tuple(float(t) for t in thresholds),
        margins=tuple(float(m) for m in margins),
        questions=tuple(questions),
        source=source,
        created=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )


def check_grid(
    ratios: Sequence[float],
    thresholds: Sequence[float],
    base_ratio: float,
    ladder: Sequence[float],
    margins: Sequence[float] = (),
) -> None:
    """ConfigError for a grid the profile cannot be built from (checked before any model loads)."""
    if not ratios or any(not 0 < r <= 1 for r in ratios):
        raise ConfigError(f"ratios must be one or more numbers in (0, 1], got {list(ratios)}")
    if not thresholds or any(not t >= 0 for t in thresholds):
        raise ConfigError(f"thresholds must be one or more numbers >= 0 (nats; inf allowed), got {list(thresholds)}")
    if any(not 0 <= m <= 1 for m in margins):
        raise ConfigError(f"margins must be probabilities in [0, 1], got {list(margins)}")
    if not 0 < base_ratio <= 1:
        raise ConfigError(f"the base ratio must be in (0, 1], got {base_ratio}")
    Guard(ratios=tuple(ladder))
