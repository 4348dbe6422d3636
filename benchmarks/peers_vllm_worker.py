"""vLLM's side of the peer benchmark (`peers.py`), run inside vLLM's own virtual environment.

Imports only vLLM and the standard library: the benchmark's venv pins vLLM's own torch and transformers. Loads the
model once, warms up, then waits on stdin: each line `run N` times every prompt once (one at a time, max_tokens=1,
greedy), prefix cache emptied first so that a prompt finds only what the other prompts of the same round left (the
shared template header), and writes OUT/vllm-run-N.json ({"ttft_s": [...], "first_token": [...]}) by rename;
`decode N` answers every prompt greedily with up to N tokens and writes OUT/vllm-decode.json (tokens per second
after the first token, and how many). The
environment (thread binding, LD_PRELOAD) is set by the parent; this script records what it saw.

    python peers_vllm_worker.py --model HF_FOLDER --prompts prompts.json --out DIR   # then "run 0" on stdin
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

ENV_SHOWN = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD")


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)  # the parent polls for `path`: it never sees half a file


def first_token(llm: LLM, ids: list[int], params: SamplingParams) -> tuple[float, int]:
    """(seconds from the call to the first token, that token's id) for one prompt."""
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    return time.perf_counter() - t0, out[0].outputs[0].token_ids[0]


def decode_rate(llm: LLM, ids: list[int], new_tokens: int) -> tuple[float, int]:
    """(tokens per second after the first, tokens generated) of a greedy answer of up to `new_tokens` tokens: its
    time less the first token's, each call from an emptied prefix cache (so both prefill the whole prompt)."""
    llm.reset_prefix_cache()
    first, _ = first_token(llm, ids, SamplingParams(max_tokens=1, temperature=0.0))
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=new_tokens, temperature=0.0),
                       use_tqdm=False)  # fmt: skip
    total, n = time.perf_counter() - t0, len(out[0].outputs[0].token_ids)
    return (n - 1) / max(total - first, 1e-9), n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face folder")
    p.add_argument("--prompts", type=Path, required=True, help='JSON {"token_ids": [[...], ...]}')
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    args = p.parse_args()
    prompts = json.loads(args.prompts.read_text())["token_ids"]
    settings = dict(model=args.model, dtype=args.dtype, enable_prefix_caching=True, max_model_len=args.max_model_len,
                    max_num_batched_tokens=args.max_model_len)  # fmt: skip
    t0 = time.perf_counter()
    llm = LLM(**settings, seed=0)
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=1, temperature=0.0)
    t0 = time.perf_counter()
    for ids in prompts[:2]:  # warm-up: the compiled graphs and the kernels of a prompt of this length
        first_token(llm, ids, params)
    warm_s = time.perf_counter() - t0
    env = {k: os.environ.get(k) for k in ENV_SHOWN}
    write_json(args.out / "vllm-ready.json", dict(settings=settings, env=env, version=vllm.__version__,
                                                  load_s=load_s, warm_up_s=warm_s))  # fmt: skip
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["decode"] and len(words) == 2:
            rows = [decode_rate(llm, ids, int(words[1])) for ids in prompts]
            write_json(args.out / "vllm-decode.json", dict(tokens_per_s=[r[0] for r in rows],
                                                           tokens=[r[1] for r in rows]))  # fmt: skip
            continue
        if words[:1] != ["run"] or len(words) != 2:
            continue
        llm.reset_prefix_cache()
        times, tokens = [], []
        for ids in prompts:
            s, tok = first_token(llm, ids, params)
            times.append(s)
            tokens.append(tok)
        write_json(args.out / f"vllm-run-{words[1]}.json", dict(ttft_s=times, first_token=tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
