"""Rebuild the tables of docs/benchmarks.md from the committed results files, or check that they agree.

    python benchmarks/tables.py            # rewrite every generated table in place
    python benchmarks/tables.py --check    # exit 1, naming each table, where the doc and the results disagree
    python benchmarks/tables.py --list     # the generated tables and the results files each reads

A generated table sits between two markers in the doc, `<!-- table:NAME -->` and `<!-- /table:NAME -->`; the
builders are in `benchlib/doc_tables.py`, one per table, each reading `benchmarks/results/<folder>/`. A new run
written to the same folder replaces the table's rows: rerun this script and commit the doc with the results.

Generated here: ttft, ttft-bf16, dtype-fidelity, fidelity, guard, guard-grouped, codecs, codecs-pca, codec-bytes,
traffic-real, traffic-simulated, load, llamacpp, sweep, throughput, ask-index, precompute-cost.

Still written by hand in the doc (their figures come from text reports, research scripts or runs whose files
hold no table): the GPU check (`gpu-h200/check-3/*.txt`), the operation counts per layer (`research/opcount_*.py`),
grouped against isolated entries paired (`research/chunk_kv_paired.py`), captured chunk KV, the guard on the
1.5B preset, quality (F1 / Rouge-L), cold requests (`benchmarks/cold.py` keeps no results folder), the folder's
first hour and disk against memory, decoding settings and bf16 fidelity of decoding, the AVX2 and Zen 4 llama.cpp
comparisons, Poisson arrivals and token gaps of the load benchmark, store tiers (`tiers/summary.txt`) and the
loading controller.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from benchlib.doc_tables import TABLES

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "benchmarks" / "results"

_BLOCK = re.compile(r"(<!-- table:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table:(?P=name) -->)", re.DOTALL)


def rebuild(text: str, results: Path = RESULTS) -> tuple[str, list[str]]:
    """The doc with every generated table rebuilt, and the names of the tables that changed or are missing."""
    seen: set[str] = set()
    changed: list[str] = []

    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in TABLES:
            raise SystemExit(f"docs/benchmarks.md names a table {name!r} that benchmarks/tables.py does not build")
        seen.add(name)
        body = "\n".join(TABLES[name].build(results)) + "\n"
        if body != match["body"]:
            changed.append(name)
        return match.group(1) + body + match.group(4)

    new = _BLOCK.sub(replace, text)
    missing = [f"{name} (no <!-- table:{name} --> markers in the doc)" for name in TABLES if name not in seen]
    return new, changed + missing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 where the doc is out of date")
    p.add_argument("--list", action="store_true", help="print each generated table and the files it reads")
    p.add_argument("--doc", type=Path, default=DOC, help="(default: docs/benchmarks.md)")
    args = p.parse_args(argv)
    if args.list:
        for name, table in TABLES.items():
            print(f"{name}: " + ", ".join(f"benchmarks/results/{s}" for s in table.sources))
        return 0
    text = args.doc.read_text(encoding="utf-8")
    new, stale = rebuild(text)
    if args.check:
        if stale:
            print("out of date in docs/benchmarks.md: " + ", ".join(stale), file=sys.stderr)
            print("run `python benchmarks/tables.py` and commit the doc with the results", file=sys.stderr)
            return 1
        print(f"{len(TABLES)} generated tables agree with benchmarks/results/")
        return 0
    if new != text:
        args.doc.write_text(new, encoding="utf-8")
    print(f"rebuilt {len(TABLES)} tables; changed: {', '.join(stale) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
