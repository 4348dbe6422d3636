"""A hand-written fidelity profile for the calibration tests: four questions whose guard and fixed-ratio outcomes
are known in advance."""

from __future__ import annotations

import math

from cacheblend_rag.controller import FidelityProfile

LADDER = (0.5, 1.0)


def record(ratio, first_token, top1, kl_mean, share):
    return {"ratio": ratio, "first_token": first_token, "top1": top1, "kl_mean": kl_mean, "compute_share": share}


# per question: first token right at r=0.15, at r=0.5; the base blend's KL to reuse; whether each ladder blend agrees
# with the one before (same first token) and their KL
HAND = [
    (False, False, 0.3, [(False, 2.0), (False, 2.0)]),
    (False, True, 0.3, [(False, 2.0), (True, 0.01)]),
    (True, True, 0.3, [(True, 0.05), (True, 0.01)]),
    (True, True, 0.01, [(True, 0.05), (True, 0.01)]),
]


def hand_profile(questions=None, model="m" * 64, dtype="float32"):
    """Four questions: first-token agreement 0.5 at r=0.15 (compute 0.1), 0.75 at r=0.5 (0.4), 1 at r=1 (1.0). The
    guard at max_kl=0.1 takes q0, q1 to r=1 and stops q2 at r=0.5: first token 1.0 at compute 0.875."""

    def question(i, right15, right50, kl_reuse, steps):
        return {
            "id": f"q{i}",
            "reuse": record(0.0, 0.0, 0.5, 1.0, 0.02),
            "fixed": [
                record(0.15, float(right15), 0.8, 0.2, 0.1),
                record(0.5, float(right50), 0.9, 0.1, 0.4),
                record(1.0, 1.0, 1.0, 0.0, 1.0),
            ],
            "risk": {"kl_reuse": kl_reuse, "agree_reuse": True, "margin": 1.0},
            "steps": [{"ratio": r, "agree_prev": a, "kl_prev": k} for r, (a, k) in zip(LADDER, steps, strict=True)],
        }

    return FidelityProfile(
        model=model,
        dtype=dtype,
        rule="attention",
        base_ratio=0.15,
        ratios=(0.15, 0.5, 1.0),
        ladder=LADDER,
        thresholds=(0.0, 0.1, math.inf),
        questions=tuple(questions or [question(i, *q) for i, q in enumerate(HAND)]),
    )
