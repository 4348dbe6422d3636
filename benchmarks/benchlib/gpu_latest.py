"""Add the load run's decode rates to the GPU check's headline figures (`latest.json`).

    python -m benchlib.gpu_latest LATEST.json LOAD_RESULTS.json

`decode_tps` maps concurrent clients to generated tokens per second of the batched blend (the mean over the load
run's repeats); the one-request figure of `gpu_check.py` stays under "1" when the load run has no such row.
`graphed_tps` is the same with decode steps replayed as CUDA graphs, `full_batched_tps` with full prefills.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def decode_rates(results: dict, setting: str = "blend-batched") -> dict[str, float]:
    rates = {}
    for row in results.get("rows", []):
        if row.get("setting") == setting and row.get("runs"):
            runs = row["runs"]
            rates[str(row["clients"])] = round(sum(r["tokens_per_s"] for r in runs) / len(runs), 1)
    return rates


def main(argv: list[str]) -> int:
    latest_path, results_path = Path(argv[0]), Path(argv[1])
    latest = json.loads(latest_path.read_text())
    results = json.loads(results_path.read_text())
    latest["decode_tps"] = {**latest.get("decode_tps", {}), **decode_rates(results)}
    latest["full_batched_tps"] = decode_rates(results, "full-batched")
    latest["graphed_tps"] = decode_rates(results, "blend-graphed")  # the batched blend, decode steps as CUDA graphs
    latest_path.write_text(json.dumps(latest, indent=2) + "\n")
    print(f"decode_tps {latest['decode_tps']}, graphed {latest['graphed_tps']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
