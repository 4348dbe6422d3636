"""Throughput under Poisson arrivals with chunks reused across requests (the paper's Fig. 14).

A thin wrapper around `cacheblend-rag bench throughput` (see `cacheblend_rag/evaluation/throughput.py` for the
workload, the queue and what is reported); every option of that command works here.

    python benchmarks/throughput.py --limit 20 --ttft-slo 10            # default model, musique + wikimqa
    python benchmarks/throughput.py --model smollm2-135m-instruct --limit 2 --repeats 2 --rates 0.5,1 \\
        --top-k 3 --chunk-tokens 128 --max-new-tokens 4 --out /tmp/throughput   # a quick smoke run
    python benchmarks/throughput.py --mode live --rates 0.05,0.1 --limit 10   # real arrivals, one pass per rate

Each question is asked --repeats times (the paper used three GPT-4 paraphrases, which cannot be made offline).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cacheblend_rag.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "throughput", *sys.argv[1:]]))
