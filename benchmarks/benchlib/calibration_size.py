"""How many questions does `cacheblend-rag calibrate` need for a stable choice? Replayed on a measured profile.

Per sample size n: draw n of the profile's questions at random (seeded), choose the cheapest setting meeting the
target exactly as `calibrate` does (`FidelityProfile.choose`; another chooser can be replayed in its place), and
estimate that choice on the questions not drawn.
Over many draws this gives how often the choice meets the target on questions it was not chosen on, the spread of
its held-back first-token agreement and compute share, and how often the most frequent setting is chosen: a
small sample picks whatever happened to look safe on it.
"""

from __future__ import annotations

import random
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from cacheblend_rag.controller.fidelity_choice import FidelityChoice
from cacheblend_rag.controller.fidelity_profile import FidelityProfile

# (the calibration sample, the first-token target) -> the choice made on it
Chooser = Callable[[FidelityProfile, float], FidelityChoice]


def calibrate_choice(sample: FidelityProfile, target_first_token: float) -> FidelityChoice:
    """The choice `cacheblend-rag calibrate` makes."""
    return sample.choose(target_first_token=target_first_token)


@dataclass(frozen=True)
class SizeRow:
    """One sample size over many random draws of the calibration questions."""

    n: int  # calibration questions per draw
    held_back: int  # questions each choice is estimated on
    draws: int
    met_on_sample: float  # share of draws whose choice met the target on its own sample
    met_held_back: float  # share of draws whose choice met the target on the held-back questions
    first_token_mean: float  # held-back first-token agreement, mean over draws: what a user gets on average
    first_token: tuple[float, float, float]  # held-back first-token agreement: median, 5th and 95th percentile
    compute_share: tuple[float, float, float]  # held-back mean compute share: median, 5th, 95th percentile
    top_choice: str  # the setting chosen most often
    top_choice_share: float


def _spread(values: Sequence[float]) -> tuple[float, float, float]:
    return float(np.median(values)), float(np.percentile(values, 5)), float(np.percentile(values, 95))


def calibration_sizes(
    prof: FidelityProfile,
    sizes: Sequence[int],
    *,
    draws: int = 100,
    target_first_token: float = 0.95,
    seed: int = 0,
    choose: Chooser = calibrate_choice,
) -> list[SizeRow]:
    """One row per size in `sizes` that leaves at least one question held back (others are skipped)."""
    rng = random.Random(seed)
    questions = list(prof.questions)
    out = []
    for n in sizes:
        if not 0 < n < len(questions):
            continue
        met_sample, met_held, first, compute, chosen = [], [], [], [], Counter()
        for _ in range(draws):
            order = rng.sample(questions, len(questions))
            choice = choose(replace(prof, questions=tuple(order[:n])), target_first_token)
            held = replace(prof, questions=tuple(order[n:])).estimate(choice.estimate.setting)
            met_sample.append(choice.met)
            met_held.append(held.first_token >= target_first_token)
            first.append(held.first_token)
            compute.append(held.compute_share)
            chosen[choice.estimate.setting.name] += 1
        top, count = chosen.most_common(1)[0]
        out.append(
            SizeRow(
                n=n,
                held_back=len(questions) - n,
                draws=draws,
                met_on_sample=statistics.fmean(met_sample),
                met_held_back=statistics.fmean(met_held),
                first_token_mean=statistics.fmean(first),
                first_token=_spread(first),
                compute_share=_spread(compute),
                top_choice=top,
                top_choice_share=count / draws,
            )
        )
    return out


def sizes_markdown(rows: Sequence[SizeRow], target_first_token: float = 0.95) -> list[str]:
    head = [
        f"| questions | held back | draws | met on its sample | met held back (first token >= {target_first_token:g}) "
        "| held-back first token, mean; median [5%, 95%] | held-back compute, median [5%, 95%] | most chosen (share) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    return head + [
        f"| {r.n} | {r.held_back} | {r.draws} | {r.met_on_sample:.2f} | {r.met_held_back:.2f} | "
        f"{r.first_token_mean:.3f}; {r.first_token[0]:.2f} [{r.first_token[1]:.2f}, {r.first_token[2]:.2f}] | "
        f"{r.compute_share[0]:.2f} [{r.compute_share[1]:.2f}, {r.compute_share[2]:.2f}] | "
        f"{r.top_choice} ({r.top_choice_share:.2f}) |"
        for r in rows
    ]
