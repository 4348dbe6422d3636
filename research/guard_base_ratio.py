"""The margin guard from a cheaper base blend: a fidelity run's blends at r = 0.05 and r = 0.15, each escalated
straight to full recompute where its own first-token margin is under a threshold (`Guard(min_margin=m)` on a
request blended at that ratio), and the two-step ladder from r = 0.05 (`Guard(min_margin=m, ratios=(0.15,
1.0))`: a near tie at 0.05 is blended again at 0.15, which stands where it picks the same first token), replayed
from the records exactly as the engine decides it (`benchlib.guard_study`, `FidelityProfile.outcome`). First
token kept, pooled with a 95% bootstrap interval and per set, mean compute share and the share escalated. Only
cases whose blends at both ratios carry risk signals count. Loads no model.

    python research/guard_base_ratio.py benchmarks/results/fidelity-grouped-apart --variant grp

`benchmarks/guard_signals.py` replays the guard from r = 0.15 only, with every trigger and the figures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from benchlib.guard_study import load_cases, margin_rows, profile  # noqa: E402
from benchlib.records import load_records  # noqa: E402

BASES = (0.05, 0.15)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="a benchmarks/fidelity.py output folder")
    p.add_argument("--variant", default="grp", help="the records' chunk KV suffix ('native': isolated entries)")
    args = p.parse_args()
    records = list(load_records(args.folder, filename="fidelity.jsonl"))
    cases = load_cases(records, grid=BASES, variant=args.variant, base=BASES[0])
    risky = {c["full"]["case_id"] for cs in load_cases(records, grid=BASES, variant=args.variant).values() for c in cs}
    both = {name: [c for c in cs if c["full"]["case_id"] in risky] for name, cs in cases.items()}
    sets = sorted(name for name, cases in both.items() if cases)
    pooled = [c for name in sets for c in both[name]]
    print(f"{len(pooled)} cases; first token kept, pooled [95% CI] and per set ({' / '.join(sets)}), compute share\n")
    print("| blends | escalate where margin < | first token, pooled | per set | compute share | escalated |")
    print("|---:|---:|---|---|---:|---:|")
    for b, ladder in [(BASES[0], (1.0,)), (BASES[1], (1.0,)), (BASES[0], (BASES[1], 1.0))]:
        per_set = [margin_rows(profile(both[name], BASES, ladder, b)) for name in sets]
        path = " -> ".join(f"{r:g}" for r in (b, *ladder))
        for i, row in enumerate(margin_rows(profile(pooled, BASES, ladder, b))):
            mean, lo, hi = row.first_token
            cells = " / ".join(f"{rows[i].first_token[0]:.2f}" for rows in per_set)
            print(f"| {path} | {row.guard:g} | {mean:.2f} [{lo:.2f}, {hi:.2f}] | {cells} | {row.compute_share:.3f} | "
                  f"{row.escalated:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
