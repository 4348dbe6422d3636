"""The fidelity profile: how close each recompute setting stays to full recompute on the user's own questions, and
the cheapest setting that meets a target.

Measured per question of a sample (`measure_fidelity`, in `calibration.py`): the teacher-forced figures of
`evaluation.fidelity` (first-token agreement, top-1 agreement, mean KL against full recompute) and the compute
share of a blend at each ratio of a grid (the engine's rule; ratio 1.0 recomputes every chunk token, a full
prefill's result), of full KV reuse, and the first-token comparisons the guard makes: the base blend's risk
signals, and whether each ladder ratio's blend agrees with the one before it (same first token, and their KL).

A guarded setting (`Guard(max_kl=t)` or `Guard(min_margin=m)` over the base ratio, with the profile's ladder) is
not run again per threshold: its outcome per question is replayed from those records, exactly as the engine
decides it. A risky question (`Guard.is_risky`: first-token margin below m, or KL(blend || reuse) above t)
takes the ladder's ratios in turn until one agrees with the previous blend (same first token, KL within t); it
ends with the figures of the last blend taken and pays the base blend plus each
escalation's blend (each blend's compute share less the first pass's, which escalations share; the first pass
is what full KV reuse computes). `tests/test_calibrate.py` checks the replay against the engine run with the guard.

`FidelityProfile.choose` picks the lowest-compute setting expected to meet the targets on a new question (the
agreement shares as `fidelity_choice` explains: k of n counts as (k + 1) / (n + 2)). How it composes
with the loading controller: the choice's ratio is the quality floor, r = max(r_fidelity, r_load), so
`LoadingController(loading_profile, min_ratio=choice.min_ratio)`; a chosen guard escalates from whatever ratio
the controller picked (`Guard.ladder`).
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from ..config import Guard
from ..errors import ConfigError
from .fidelity_choice import Estimate, FidelityChoice, HeldBackCheck, Setting, Targets
from .profile import finite
from .profile_io import load_profile_json, write_profile_json

PROFILE_FORMAT = "cacheblend-rag/fidelity-profile/1"
DEFAULT_RATIOS = (0.05, 0.15, 0.3, 0.5, 1.0)
DEFAULT_THRESHOLDS = (0.0, 0.05, 0.1, 0.2, 0.5, 1.0)  # max_kl of the KL trigger (0: escalate every request)
DEFAULT_MARGINS = (0.02, 0.05, 0.1, 0.2)  # min_margin of the margin trigger
DEFAULT_LADDER = (1.0,)
MAX_PROFILE_BYTES = 64 << 20  # a few hundred bytes per question


MAX_PROFILE_QUESTIONS = 2000  # a calibration sample is tens of questions; far more is not one

# Each measured record's fields and their ranges (lo, hi); every value must be a finite number in range.
# compute_share can pass 1: the attention rule's first pass comes on top of a full recompute's token-layers.
_RECORD_FIELDS = {"first_token": (0.0, 1.0), "top1": (0.0, 1.0), "kl_mean": (0.0, math.inf),
                  "compute_share": (0.0, math.inf)}  # fmt: skip
_RISK_FIELDS = {"margin": (0.0, 1.0), "kl_reuse": (0.0, math.inf)}
_STEP_FIELDS = {"ratio": (0.0, 1.0), "kl_prev": (0.0, math.inf)}


def _check_numbers(where: str, record: object, fields: dict[str, tuple[float, float]]) -> None:
    if not isinstance(record, dict):
        raise ConfigError(f"{where} must be an object with {', '.join(fields)}, got {type(record).__name__}")
    for name, (lo, hi) in fields.items():
        value = record.get(name)
        if not finite(value):
            raise ConfigError(f"{where}.{name} must be a finite number, got {value!r}")
        if not lo <= value <= hi:
            raise ConfigError(f"{where}.{name} must be in [{lo:g}, {hi:g}], got {value!r}")


def check_question(index: int, q: object) -> None:
    """One question of a fidelity profile, whole: every record present, every number finite and in range."""
    if not isinstance(q, dict):
        raise ConfigError(f"question {index} must be an object, got {type(q).__name__}")
    where = f"question {index} ({str(q.get('id'))[:40]!r})"
    _check_numbers(f"{where} reuse", q.get("reuse"), _RECORD_FIELDS)
    fixed, steps = q.get("fixed"), q.get("steps")
    if not isinstance(fixed, list) or not fixed:
        raise ConfigError(f"{where} fixed must be a non-empty list of records, got {fixed!r:.60}")
    for j, rec in enumerate(fixed):
        _check_numbers(f"{where} fixed[{j}]", rec, {**_RECORD_FIELDS, "ratio": (0.0, 1.0)})
    _check_numbers(f"{where} risk", q.get("risk"), _RISK_FIELDS)
    if not isinstance(steps, list):
        raise ConfigError(f"{where} steps must be a list, got {steps!r:.60}")
    for j, step in enumerate(steps):
        _check_numbers(f"{where} steps[{j}]", step, _STEP_FIELDS)
        if not isinstance(step.get("agree_prev"), bool):
            raise ConfigError(f"{where} steps[{j}].agree_prev must be true or false, got {step.get('agree_prev')!r}")


@dataclass(frozen=True)
class FidelityProfile:
    """Per-question fidelity records of one model in one dtype (see the module docstring for their content)."""

    model: str  # model fingerprint: a profile of another model or precision is refused
    dtype: str
    rule: str
    base_ratio: float  # the blend a guard starts from
    ratios: tuple[float, ...]  # the fixed-ratio grid
    ladder: tuple[float, ...]  # the guard's escalation ratios
    thresholds: tuple[float, ...]  # the KL trigger's max_kl values in the table
    questions: tuple[dict[str, Any], ...] = field(repr=False)
    source: str = ""  # what the sample was drawn from
    created: str = ""
    margins: tuple[float, ...] = ()  # the margin trigger's min_margin values in the table

    def __post_init__(self) -> None:
        needed = {self.base_ratio, *self.ladder}
        if not needed <= set(self.ratios):
            raise ConfigError(f"the ratio grid {self.ratios} must hold the base ratio and the ladder {sorted(needed)}")
        Guard(ratios=self.ladder)  # checks the ladder
        if len(self.questions) > MAX_PROFILE_QUESTIONS:
            raise ConfigError(
                f"the fidelity profile holds {len(self.questions)} questions, above {MAX_PROFILE_QUESTIONS}: no "
                "calibration measures that many (each question is minutes of compute), and choosing over them "
                "would take minutes and gigabytes; calibrate on a sample (--limit)"
            )
        for i, q in enumerate(self.questions):
            check_question(i, q)
            if {r["ratio"] for r in q["fixed"]} != set(self.ratios):
                raise ConfigError(f"question {q.get('id')!r} of the fidelity profile lacks records of {self.ratios}")

    def check_model(self, fingerprint: str, dtype: str) -> None:
        """ConfigError unless the profile was measured for this model (fingerprint) in this dtype."""
        if self.model != fingerprint or self.dtype != dtype:
            raise ConfigError(
                f"the fidelity profile was measured for model {self.model[:12]} in {self.dtype}, this engine runs "
                f"{fingerprint[:12]} in {dtype}; run `cacheblend-rag calibrate` for this model and dtype"
            )

    def settings(self) -> list[Setting]:
        fixed = [Setting(r) for r in self.ratios]
        by_kl = [Guard(min_margin=0.0, max_kl=t, ratios=self.ladder) for t in self.thresholds]
        by_margin = [Guard(min_margin=m, ratios=self.ladder) for m in self.margins]
        return fixed + [Setting(self.base_ratio, g) for g in (*by_kl, *by_margin)]

    def outcome(self, setting: Setting, question: dict[str, Any]) -> dict[str, Any]:
        """One question's figures under `setting`: measured for a fixed ratio, replayed for a guard."""
        fixed = {rec["ratio"]: rec for rec in question["fixed"]}
        record = fixed[setting.ratio]
        guard = setting.guard
        if guard is None or not guard.is_risky(question["risk"]):
            return {**record, "escalated": False}
        # compute share (and time, where the records have it) add up over the blends taken
        costs = [k for k in ("compute_share", "ttft_s") if k in record and k in question["reuse"]]
        spent = {k: record[k] for k in costs}
        for step in question["steps"]:
            if step["ratio"] not in guard.ladder(setting.ratio):
                continue
            record = fixed[step["ratio"]]
            for k in costs:
                spent[k] += record[k] - question["reuse"][k]  # the first pass is shared
            if step["agree_prev"] and step["kl_prev"] <= guard.max_kl:
                break
        return {**record, **spent, "escalated": True}

    def estimate(self, setting: Setting) -> Estimate:
        from ..evaluation import bootstrap_ci

        if not self.questions:
            raise ConfigError("the fidelity profile holds no question; run `cacheblend-rag calibrate` on a sample")
        rows = [self.outcome(setting, q) for q in self.questions]

        def column(key: str) -> list[float]:
            return [float(r[key]) for r in rows]

        return Estimate(
            setting=setting,
            n=len(rows),
            first_token=statistics.fmean(column("first_token")),
            first_token_ci=bootstrap_ci(column("first_token")),
            top1=statistics.fmean(column("top1")),
            top1_ci=bootstrap_ci(column("top1")),
            kl_mean=statistics.fmean(column("kl_mean")),
            kl_ci=bootstrap_ci(column("kl_mean")),
            compute_share=statistics.fmean(column("compute_share")),
            escalated=statistics.fmean(column("escalated")),
        )

    def table(self) -> list[Estimate]:
        return [self.estimate(s) for s in self.settings()]

    def choose(
        self, target_first_token: float | None = 0.95, target_top1: float | None = None, max_kl: float | None = None
    ) -> FidelityChoice:
        """The lowest-compute setting expected to meet the targets on a new question (`Targets.shortfall` with
        `expected`); when none is, the closest (the least summed shortfall, then the least compute), with `met`
        False."""
        targets = Targets(target_first_token, target_top1, max_kl)
        table = self.table()
        meeting = [e for e in table if targets.shortfall(e, expected=True) == 0.0]
        if meeting:
            best = min(meeting, key=lambda e: e.compute_share)
        else:
            best = min(table, key=lambda e: (targets.shortfall(e, expected=True), e.compute_share))
        return FidelityChoice(best, targets, met=bool(meeting), rule=self.rule)

    def subset(self, start: int, stop: int | None = None) -> FidelityProfile:
        """The same profile over questions[start:stop]."""
        return replace(self, questions=self.questions[start:stop])

    def held_back_check(self, calibrate_share: float = 2 / 3, **targets: Any) -> HeldBackCheck:
        """Choose on the first `calibrate_share` of the questions, estimate the choice on the rest."""
        cut = round(len(self.questions) * calibrate_share)
        if not 0 < cut < len(self.questions):
            raise ConfigError(
                f"a held-back check needs questions on both sides of the split; {len(self.questions)} questions "
                f"and calibrate_share={calibrate_share} leave one side empty"
            )
        choice = self.subset(0, cut).choose(**targets)
        return HeldBackCheck(choice, self.subset(cut).estimate(choice.estimate.setting))

    # -- persistence ---------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "model": self.model,
            "dtype": self.dtype,
            "rule": self.rule,
            "base_ratio": self.base_ratio,
            "ratios": list(self.ratios),
            "ladder": list(self.ladder),
            "thresholds": [t if math.isfinite(t) else "inf" for t in self.thresholds],  # JSON has no infinity
            "margins": list(self.margins),
            "source": self.source,
            "created": self.created,
            "sample_size": len(self.questions),
            "questions": list(self.questions),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FidelityProfile:
        return cls(
            model=str(data["model"]),
            dtype=str(data["dtype"]),
            rule=str(data["rule"]),
            base_ratio=float(data["base_ratio"]),
            ratios=tuple(float(r) for r in data["ratios"]),
            ladder=tuple(float(r) for r in data["ladder"]),
            thresholds=tuple(float(t) for t in data["thresholds"]),
            margins=tuple(float(m) for m in data.get("margins", ())),
            questions=tuple(dict(q) for q in data["questions"]),
            source=str(data.get("source", "")),
            created=str(data.get("created", "")),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        write_profile_json(path, self.to_json(), indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> FidelityProfile:
        """Read a profile written by `save`; ConfigError, naming the path, for anything that is not one."""
        redo = f"write it with `cacheblend-rag calibrate --out {path}`"
        return load_profile_json(path, "a fidelity profile", PROFILE_FORMAT, MAX_PROFILE_BYTES, redo, cls.from_json)
