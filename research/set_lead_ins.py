# A study, kept for reading. It runs at the git tag lab-2026-11-25, where it is
# benchmarks/set_lead_ins.py: see research/README.md.
"""Write a lead-in file per data set from one of its cases outside the measured ones, for `--lead-in FILE`.

`EngineConfig.lead_in` caches every chunk but a prompt's first after a fixed text. `DEFAULT_LEAD_IN` is neutral
prose; this script makes the alternative a user might try first: text of the same kind as the documents. For
each data set it joins the chunks of case `--case` (100 by default, outside the first 50 that `bench fidelity`
measures) with blank lines and keeps the first `--chars` characters, cut at a space (1,100 characters is about
256 tokens of English for the default model's tokenizer).

    python benchmarks/set_lead_ins.py --out benchmarks/results/fidelity-set-lead-in --data-dir ../shared/data
    cacheblend-rag bench fidelity --datasets musique \\
        --lead-in benchmarks/results/fidelity-set-lead-in/musique.txt ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cacheblend_rag.evaluation.datasets import DATASETS, Case, DatasetError, load_dataset


def lead_in_text(case: Case, chars: int) -> str:
    """The first `chars` characters of the case's chunks joined by blank lines, cut at the last space."""
    text = "\n\n".join(case.chunks)
    if len(text) > chars:
        text = text[:chars]
        text = text[: text.rfind(" ")] if " " in text else text
    return text.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", default=",".join(DATASETS), help="comma-separated (default: all four)")
    p.add_argument("--case", type=int, default=100, help="the case whose chunks give the text (default 100)")
    p.add_argument("--chars", type=int, default=1100, help="characters kept (default 1100, ~256 tokens)")
    p.add_argument("--out", required=True, help="folder for NAME.txt, one per data set")
    p.add_argument("--data-dir", default=None)
    args = p.parse_args(argv)
    if args.case < 0 or args.chars < 1:
        p.error("--case must be >= 0 and --chars >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.datasets.split(","):
        try:
            ds = load_dataset(name, args.data_dir, limit=args.case + 1)
        except DatasetError as exc:  # an unknown name, a missing folder or file: say so, without a traceback
            print(exc, file=sys.stderr)
            return 2
        if len(ds.cases) <= args.case:
            print(f"{name} has {len(ds.cases)} cases; choose --case below that", file=sys.stderr)
            return 2
        text = lead_in_text(ds.cases[args.case], args.chars)
        (out / f"{ds.spec.name}.txt").write_text(text + "\n", encoding="utf-8")
        print(f"{out / (ds.spec.name + '.txt')}: {len(text)} characters from case {ds.cases[args.case].id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
