"""What a store's bytes buy under a smaller codec on SQuAD traffic: the traffic benchmark's simulation (LFU) at the
int8 corpus's budget shares, against the shares the same bytes hold in a codec `--ratio` times smaller.

    python benchmarks/traffic.py simulate --data-dir DATA --grid-shares 0.1 0.172 0.25 0.43 0.5 0.86 --out OUT
    python research/traffic_codec_shares.py OUT/simulated.json --ratio 1.72      # int8 bits / pca bits per value

Each (stream, seed, share) keeps its last window (the whole stream); hit rate and speed-up over full prefill are
means over the seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict


def final_rows(path: str, policy: str) -> dict[tuple[str, float], tuple[float, float, int]]:
    last: dict[tuple, dict] = {}
    for row in json.load(open(path))["rows"]:
        if row["policy"] != policy:
            continue
        key = (row["stream"], row["seed"], row["share"])
        window = float("inf") if row["window"] is None else row["window"]
        if key not in last or window > (float("inf") if last[key]["window"] is None else last[key]["window"]):
            last[key] = row
    by: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for (stream, _, share), row in last.items():
        by[stream, round(share, 3)].append(row)
    return {k: (statistics.mean(r["hit_rate"] for r in v), statistics.mean(r["speedup"] for r in v), len(v))
            for k, v in by.items()}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("simulated")
    p.add_argument("--ratio", type=float, required=True, help="how many times fewer bytes the codec stores than int8")
    p.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    p.add_argument("--policy", default="lfu")
    args = p.parse_args()
    rows = final_rows(args.simulated, args.policy)
    print("| stream | budget (of the int8 corpus's bytes) | hit rate, int8 -> codec | speed-up, int8 -> codec "
          "| seeds |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    for stream in sorted({s for s, _ in rows}):
        for share in args.shares:
            a, b = rows[stream, round(share, 3)], rows[stream, round(share * args.ratio, 3)]
            print(f"| {stream} | {share:.0%} | {a[0]:.1%} -> {b[0]:.1%} | {a[1]:.2f}x -> {b[1]:.2f}x | {a[2]} |")


if __name__ == "__main__":
    main()
