"""The fidelity benchmark's codec table: what storing chunk KV through a codec costs each method, paired per case.

`fidelity.py --kv-codec int8,int4` records every method once per codec (`attention@0.15+int8`, ...) against the same
full-recompute reference as the uncompressed store's `attention@0.15`. Per data set and pooled over all of them,
each (codec, method) gets the mean over cases of KL(full || method with codec) - KL(full || method uncompressed),
a 95% bootstrap interval over cases, and the change in top-1 and first-token agreement. A codec is "within noise"
for a method when that interval includes 0 or the mean increase is at most `NOISE_NATS`.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from benchlib.fidelity_run import NATIVE, split_codec
from benchlib.report import cases_text, ci_text
from cacheblend_rag.evaluation.fidelity import bootstrap_ci

NOISE_NATS = 0.005  # a mean KL increase this small is within noise whatever its interval
POOLED = "pooled"  # the data set name of the rows over every data set's cases


@dataclass(frozen=True)
class CodecDifference:
    """One method read through one codec against the same method uncompressed, over the cases both finished."""

    dataset: str  # or POOLED
    codec: str
    method: str  # the uncompressed method's name
    n: int
    kl_native: float  # mean KL of the method uncompressed, nats
    kl_codec: float  # mean KL of the method with the codec
    kl_diff: float  # kl_codec - kl_native (the mean of the per-case differences)
    kl_diff_ci: tuple[float, float]  # 95% bootstrap interval over cases
    top1_diff: float  # change in top-1 agreement (codec - uncompressed)
    first_token_diff: float  # change in the share of cases whose first token matches full recompute's
    mismatched: int = 0  # cases left out: the two records were measured against different reference answers

    @property
    def within_noise(self) -> bool:
        lo, hi = self.kl_diff_ci
        return lo <= 0.0 <= hi or self.kl_diff <= NOISE_NATS


def _ok(records: Iterable[Mapping[str, object]]) -> list[Mapping[str, object]]:
    return [r for r in records if "error" not in r and r.get("kl_mean") is not None]


def baseline_of(codec: str) -> str:
    """What a codec's records are paired against: the uncompressed store, or for a codec over a variant of the
    chunk KV ('grp+int4': grouped entries stored as int4) that variant uncompressed ('grp')."""
    variant, sep, _ = codec.rpartition("+")
    return variant if sep else NATIVE


def codec_differences(records: Sequence[Mapping[str, object]]) -> list[CodecDifference]:
    """Per data set (sorted, then POOLED over all of them), per codec and method in the order first recorded: the
    paired difference to the uncompressed store (to the variant uncompressed, for a codec over a variant: see
    `baseline_of`). Empty when the records hold no codec other than native."""
    by_case: dict[tuple[str, str], dict[tuple[str, str], Mapping[str, object]]] = defaultdict(dict)
    pairs: dict[tuple[str, str], None] = {}  # (codec, method), in first-recorded order
    for r in _ok(records):
        method, codec = split_codec(str(r["method"]))
        by_case[(str(r["dataset"]), str(r["case_id"]))][(codec, method)] = r
        if codec != NATIVE:
            pairs[(codec, method)] = None
    datasets = sorted({ds for ds, _ in by_case})
    rows = []
    for ds in [*datasets, POOLED] if len(datasets) > 1 else datasets:
        cases = [recs for (d, _), recs in sorted(by_case.items()) if ds in (d, POOLED)]
        for codec, method in pairs:
            base = (baseline_of(codec), method)
            found = [(recs[base], recs[(codec, method)]) for recs in cases if base in recs and (codec, method) in recs]
            both = [pair for pair in found if _same_reference(*pair)]
            if both:
                rows.append(replace(_difference(ds, codec, method, both), mismatched=len(found) - len(both)))
    return rows


def _same_reference(a: Mapping[str, object], b: Mapping[str, object]) -> bool:
    """Whether two records of a case were measured against the same reference answer (records from before the
    digest was kept count as the same)."""
    da, db = a.get("reference_digest"), b.get("reference_digest")
    return da is None or db is None or da == db


def _difference(
    dataset: str, codec: str, method: str, both: Sequence[tuple[Mapping[str, object], Mapping[str, object]]]
) -> CodecDifference:
    """`both`: per case, (the uncompressed record, the codec's record), in a fixed order (the interval is seeded)."""

    def mean(metric: str, side: int) -> float:
        return statistics.fmean(float(pair[side][metric]) for pair in both)  # type: ignore[arg-type]

    diffs = [float(c["kl_mean"]) - float(n["kl_mean"]) for n, c in both]  # type: ignore[arg-type]
    return CodecDifference(
        dataset=dataset,
        codec=codec,
        method=method,
        n=len(both),
        kl_native=mean("kl_mean", 0),
        kl_codec=mean("kl_mean", 1),
        kl_diff=statistics.fmean(diffs),
        kl_diff_ci=bootstrap_ci(diffs),
        top1_diff=mean("top1", 1) - mean("top1", 0),
        first_token_diff=mean("first_token", 1) - mean("first_token", 0),
    )


CODEC_INTRO = (
    "### Stored KV codecs: paired difference to the uncompressed store",
    "Per case, the method with its chunk KV read through the codec minus the same method uncompressed (a codec over "
    "a variant of the chunk KV, e.g. `grp+int4`, minus that variant uncompressed), against the same full-recompute "
    f"reference. Within noise: the 95% interval includes 0, or KL rises by at most {NOISE_NATS} "
    "nats.",
)


def noise_verdict(r: CodecDifference) -> str:
    """A codec's verdict: whether reading KV through it costs fidelity beyond noise."""
    return "within noise" if r.within_noise else "NOT within noise"


def codec_markdown(
    rows: Sequence[CodecDifference],
    intro: tuple[str, str] = CODEC_INTRO,
    verdict_of: Callable[[CodecDifference], str] = noise_verdict,
) -> str:
    """The table of `codec_differences`, one per data set and pooled; '' when there is no row. `intro`: the
    title and the paragraph under it, `verdict_of` the last column (another variant than a codec, e.g.
    contextual chunk KV, says what it is and how it is judged)."""
    if not rows:
        return ""
    lines = [intro[0], "", intro[1], ""]
    for ds in dict.fromkeys(r.dataset for r in rows):
        mine = [r for r in rows if r.dataset == ds]
        title = "all data sets" if ds == POOLED else ds
        lines += [
            f"#### {title} ({cases_text(max(r.n for r in mine))})",
            "",
            "| codec | method | cases | KL uncompressed | KL codec | KL(codec) - KL(native) [95% CI] | top-1 change | "
            "first-token change | verdict |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in mine:
            verdict = verdict_of(r)
            if r.n == 1:  # the interval of one case is that case's difference: no measure of noise at all
                verdict += " (1 case)"
            lines.append(
                f"| {r.codec} | {r.method} | {r.n} | {r.kl_native:.4f} | {r.kl_codec:.4f} | {r.kl_diff:+.4f} "
                f"{ci_text(r.kl_diff_ci, '+.4f')} | {r.top1_diff:+.3f} | {r.first_token_diff:+.2f} | {verdict} |"
            )
        mismatched = max(r.mismatched for r in mine)
        if mismatched:
            lines.append(
                f"Left out: up to {mismatched} case(s) whose codec and uncompressed records were measured against "
                "different reference answers (a run resumed on a machine where full recompute answered otherwise)."
            )
        lines.append("")
    return "\n".join(lines)
