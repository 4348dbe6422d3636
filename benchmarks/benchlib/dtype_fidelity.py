"""The dtype fidelity benchmark's measurements and summary (`benchmarks/dtype_fidelity.py`).

One record per case holds four teacher-forced comparisons (`evaluation.fidelity.compare`), each a method's
distributions along a reference answer:
- "fp32_blend": the fp32 blend against fp32 full recompute;
- "bf16_blend": the bf16 blend against bf16 full recompute (its own greedy answer);
- "bf16_full": bf16 full recompute against fp32 full recompute (the noise floor between the two dtypes);
- "bf16_blend_vs_fp32": the bf16 blend against fp32 full recompute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cacheblend_rag.config import BlendConfig
from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.evaluation.datasets import Case, TaskSpec
from cacheblend_rag.evaluation.fidelity import bootstrap_ci, compare, prepare_case, teacher_forced_logits

COMPARISONS = {
    "fp32_blend": "fp32 blend against fp32 full",
    "bf16_blend": "bf16 blend against bf16 full",
    "bf16_full": "bf16 full against fp32 full (noise floor)",
    "bf16_blend_vs_fp32": "bf16 blend against fp32 full",
}
METRICS = ("kl_mean", "first_token", "top1")


def case_record(fp32: CacheBlendEngine, bf16: CacheBlendEngine, spec: TaskSpec, case: Case) -> dict[str, Any]:
    """The four comparisons of one case (chunk KV stored alone in each engine's memory tier, untimed)."""
    blend = BlendConfig()
    prompt32, ref32 = prepare_case(fp32, spec, case)
    prompt16, ref16 = prepare_case(bf16, spec, case)
    blend32 = fp32.prefill(prompt32, "blend", blend=blend)
    rec: dict[str, Any] = {"dataset": spec.name, "case_id": case.id, "prompt_tokens": ref32.prompt_tokens}
    rec["fp32_blend"] = compare(ref32, teacher_forced_logits(fp32, blend32, ref32))
    rec["bf16_blend"] = compare(ref16, teacher_forced_logits(bf16, bf16.prefill(prompt16, "blend", blend=blend), ref16))
    rec["bf16_full"] = compare(ref32, teacher_forced_logits(bf16, bf16.prefill(prompt16, "full"), ref32))
    along32 = teacher_forced_logits(bf16, bf16.prefill(prompt16, "blend", blend=blend), ref32)
    rec["bf16_blend_vs_fp32"] = compare(ref32, along32)
    rec["answers_equal"] = ref32.token_ids == ref16.token_ids
    rec["answer_tokens"] = {"fp32": len(ref32.token_ids), "bf16": len(ref16.token_ids)}
    rec["ttft_s"] = {"fp32_full": ref32.ttft_s, "bf16_full": ref16.ttft_s}
    return rec


def paired(records: Sequence[Mapping[str, Any]], a: str, b: str, metric: str) -> tuple[float, tuple[float, float]]:
    """Mean over cases of records[a][metric] - records[b][metric], with its 95% bootstrap interval."""
    diff = [r[a][metric] - r[b][metric] for r in records]
    return float(np.mean(diff)), bootstrap_ci(diff)


def _mean_ci(values: Sequence[float]) -> str:
    lo, hi = bootstrap_ci(values)
    return f"{np.mean(values):.4f} [{lo:.4f}, {hi:.4f}]"


def dtype_markdown(records: Sequence[Mapping[str, Any]], *, machine: str) -> str:
    """The summary: each comparison's mean KL, first-token and top-1 agreement (95% intervals over cases), then
    the paired difference of the bf16 blend to the fp32 blend, each against its own full recompute."""
    if not records:
        return "no case measured yet"
    sets = sorted({r["dataset"] for r in records})
    counts = ", ".join(f"{s} {sum(r['dataset'] == s for r in records)}" for s in sets)
    lines = [
        f"{len(records)} cases ({counts}); {machine}; the default blend (attention, r = 0.15), chunk KV stored alone",
        "",
        "| comparison | mean KL (nats) | first-token agreement | top-1 agreement |",
        "|---|---:|---:|---:|",
    ]
    for key, label in COMPARISONS.items():
        cells = [_mean_ci([r[key][m] for r in records]) for m in METRICS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Paired, per case: the bf16 blend against bf16 full minus the fp32 blend against fp32 full", ""]
    lines += ["| metric | bf16 - fp32 | 95% interval |", "|---|---:|---:|"]
    for m in METRICS:
        mean, (lo, hi) = paired(records, "bf16_blend", "fp32_blend", m)
        lines.append(f"| {m} | {mean:+.4f} | [{lo:+.4f}, {hi:+.4f}] |")
    same = sum(bool(r["answers_equal"]) for r in records)
    lines += ["", f"Greedy full-recompute answers equal in both dtypes: {same} of {len(records)} cases."]
    full32 = np.median([r["ttft_s"]["fp32_full"] for r in records])
    full16 = np.median([r["ttft_s"]["bf16_full"] for r in records])
    lines.append(f"Median full-prefill TTFT: fp32 {full32:.2f} s, bf16 {full16:.2f} s ({full32 / full16:.2f}x).")
    return "\n".join(lines)
