"""Does full KV reuse's own first-token margin tell when the default blend will change the first token?

The guard escalates on the blend's first-token margin (`Guard()`: margin < 0.1). On the 1.5B preset that signal is at
chance on MuSiQue (AUC 0.48, research/README.md, study 9). The `attention` rule's first pass ends with full KV reuse's
first-token distribution before any token is recomputed, and every blend now records its margin as
`metrics.risk["reuse_margin"]`. This study reads it from guard probes (`benchmarks/guard_probe.py`: one chunk
prefill and one default blend per case, on cases whose fidelity records hold full recompute's answer) and asks, per
model and data set, how well each signal ranks the cases whose blend first token differs from full recompute's:
ROC AUC with a 95% bootstrap interval over cases (0.5 = chance). Runs on the current code, from probe records:

    python benchmarks/guard_probe.py --records benchmarks/results/guard-1.5b/fidelity.jsonl \
        --model qwen2.5-coder-1.5b-instruct --datasets musique --limit 15 \
        --out benchmarks/results/reuse-margin/1.5b --data-dir ../shared/data
    python benchmarks/guard_probe.py --records benchmarks/results/guard/fidelity.jsonl \
        --datasets musique,wikimqa --limit 20 --out benchmarks/results/reuse-margin/0.5b --data-dir ../shared/data
    python research/reuse_margin_signal.py > research/results/reuse_margin_signal.txt
"""

import argparse
import random
import statistics
import sys
from collections import defaultdict
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path[:0] = [str(BENCHMARKS)]

from benchlib.records import load_records  # noqa: E402
from sklearn.metrics import roc_auc_score  # noqa: E402

RESULTS = BENCHMARKS / "results" / "reuse-margin"
MODELS = {"0.5B": "0.5b", "1.5B": "1.5b"}
# signal -> how to read it from a blend's risk signals as "higher = riskier"
SIGNALS = {
    "low blend margin (the guard's)": lambda r: -r["margin"],
    "low reuse margin": lambda r: -r["reuse_margin"],
    "lower of the two margins": lambda r: -min(r["margin"], r["reuse_margin"]),
    "KL(blend || reuse)": lambda r: r["kl_reuse"],
}


def auc_ci(labels: list[bool], scores: list[float], draws: int = 2000) -> tuple[float, float, float]:
    """ROC AUC and its 95% bootstrap interval over cases (resamples with one class only are redrawn)."""
    point = float(roc_auc_score(labels, scores))
    rng = random.Random(0)
    n, values = len(labels), []
    while len(values) < draws:
        idx = [rng.randrange(n) for _ in range(n)]
        ys = [labels[i] for i in idx]
        if 0 < sum(ys) < n:
            values.append(float(roc_auc_score(ys, [scores[i] for i in idx])))
    values.sort()
    return point, values[int(0.025 * draws)], values[int(0.975 * draws) - 1]


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    for model, folder in MODELS.items():
        probes = load_records(RESULTS / folder, filename="probe.jsonl")
        by_set: dict[str, list[dict]] = defaultdict(list)
        for p in probes:
            by_set[p["dataset"]].append(p)
        for ds, rows in sorted(by_set.items()):
            # The label is the fidelity record's exact first-token agreement; the probe's own reading (its blend's
            # first token against the reference text tokenized again) is a check that the probe saw the same blend.
            flipped = [p["recorded_first_token"] < 1.0 for p in rows]
            probe_reads = [p["first_token_id"] != p["reference_first_id"] for p in rows]
            same = sum(f == r for f, r in zip(flipped, probe_reads, strict=True))
            print(f"\n{model} {ds}: {len(rows)} cases, blend first token differs from full recompute's on "
                  f"{sum(flipped)}; the probe's reading agrees with the record on {same}")  # fmt: skip
            margins = [p["risk"]["reuse_margin"] for p in rows]
            changed = [round(m, 3) for m, f in zip(margins, flipped, strict=True) if f]
            print(f"  reuse margin: median {statistics.median(margins):.3f}, on the changed cases {changed}")
            if not 0 < sum(flipped) < len(rows):
                print("  (one class only: no AUC)")
                continue
            for name, read in SIGNALS.items():
                point, lo, hi = auc_ci(flipped, [read(p["risk"]) for p in rows])
                print(f"  AUC {name:<32} {point:.2f} [{lo:.2f}, {hi:.2f}]")


if __name__ == "__main__":
    main()
