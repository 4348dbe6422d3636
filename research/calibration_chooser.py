"""Does `calibrate` meet its target on questions it was not chosen on? Choosing on the sample's own shares against
choosing on what to expect of a new question.

`FidelityProfile.choose` picks the cheapest setting meeting a first-token target on the calibration sample. It used
to judge each setting by its share k / n on the sample; it now judges it by (k + 1) / (n + 2), the chance that a new
question agrees (Laplace's rule of succession; full recompute counts as exact). This replays both on the fidelity
benchmark's 200 cases (50 per data set; the guard study's records, `benchmarks/guard_signals.py`): per data set and
sample size n, n questions drawn at random (200 draws, seeded), each chooser's choice made on them and measured on
the other 50 - n (`benchlib.calibration_size`). Runs on the current code, from records only:

    python research/calibration_chooser.py > research/results/calibration_chooser.txt
"""

import argparse
import sys
from dataclasses import replace
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from benchlib.calibration_size import calibrate_choice, calibration_sizes  # noqa: E402
from benchlib.guard_study import load_cases, profile  # noqa: E402
from benchlib.records import load_records  # noqa: E402

from cacheblend_rag.controller.fidelity_choice import FidelityChoice, Targets  # noqa: E402
from cacheblend_rag.controller.fidelity_profile import DEFAULT_MARGINS, FidelityProfile  # noqa: E402

SIZES = (10, 20, 30, 40)
TARGET = 0.95
DRAWS = 200


def sample_share_choice(sample: FidelityProfile, target: float) -> FidelityChoice:
    """The former rule: the cheapest setting whose share on the sample itself meets the target."""
    targets = Targets(target)
    table = sample.table()
    meeting = [e for e in table if targets.shortfall(e) == 0.0]
    best = min(meeting or table, key=lambda e: (targets.shortfall(e), e.compute_share))
    return FidelityChoice(best, targets, met=bool(meeting), rule=sample.rule)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    records = [r for folder in ("guard", "fidelity") for r in load_records(BENCHMARKS / "results" / folder,
                                                                             filename="fidelity.jsonl")]  # fmt: skip
    probes = load_records(BENCHMARKS / "results" / "guard", filename="probe.jsonl")
    cases = load_cases(records, probes, grid=(0.05, 0.15))
    choosers = {"sample share k/n": sample_share_choice, "expected (k+1)/(n+2)": calibrate_choice}
    print(f"first-token target {TARGET}; {DRAWS} draws per cell; held-back figures over draws\n")
    print("| data set | n | chooser | met on held back | held-back first token, mean | held-back compute, median |")
    print("|---|---|---|---|---|---|")
    for name, group in cases.items():
        prof = replace(profile(group, (0.05, 0.15), (1.0,)), margins=DEFAULT_MARGINS)
        for n in SIZES:
            for label, choose in choosers.items():
                (row,) = calibration_sizes(prof, [n], draws=DRAWS, target_first_token=TARGET, choose=choose)
                print(f"| {name} ({len(group)}) | {n} | {label} | {row.met_held_back:.2f} | "
                      f"{row.first_token_mean:.3f} | {row.compute_share[0]:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
