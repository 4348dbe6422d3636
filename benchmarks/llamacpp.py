"""What a CPU user would run instead: llama.cpp's own prefill and decode on the GGUF file the preset ships.

Runs `llama-bench` (built from llama.cpp's sources, e.g. the copy inside the `llama-cpp-python` source package:
`cmake -B build -DGGML_NATIVE=ON && cmake --build build --target llama-bench llama-quantize`) on the preset's GGUF
(Q4_K_M for the default preset) and, with `--llama-quantize`, on copies requantized to q8_0 and f16 (their speed,
not their quality: they are made from the Q4 weights). Reports prompt tokens/s for a --prompt-tokens prompt,
decode tokens/s right after an empty context (llama-bench's own test, an upper bound) and after --decode-depth
tokens of context (default: the prompt's length, the decoding a RAG answer gets; `llama-bench -d`), and the time
to the last token of 128- and 256-token answers, counted with the decoding after the prompt. Writes OUT/results.json and
summary.md; compare with `benchmarks/decode.py` on the same machine, the same thread count.

    python benchmarks/llamacpp.py --llama-bench /path/to/build/bin/llama-bench \\
        --llama-quantize /path/to/build/bin/llama-quantize --prompt-tokens 3139
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch
from benchlib.cli import add_out_argument, cpu_name

from cacheblend_rag.models import DEFAULT_PRESET
from cacheblend_rag.models.gguf import assemble_preset_file
from cacheblend_rag.models.presets import find_preset


def run_json(cmd: list[str]) -> list[dict]:
    """llama-bench's rows, from its `-o json` output."""
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def bench(
    llama_bench: str, gguf: Path, prompt_tokens: int, new_tokens: int, threads: int, repeats: int, depth: int
) -> dict:
    cmd = [llama_bench, "-m", str(gguf), "-p", str(prompt_tokens), "-n", str(new_tokens), "-t", str(threads),
           "-r", str(repeats), "-o", "json"]  # fmt: skip
    rows = run_json(cmd)
    prompt = next(r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    gen = next(r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    row = dict(prompt_tokens_per_s=prompt["avg_ts"], decode_tokens_per_s_empty=gen["avg_ts"],
               decode_tokens_per_s=gen["avg_ts"], decode_depth=0, type=prompt.get("type_k"),
               model_type=prompt.get("model_type"), command=" ".join(cmd))  # fmt: skip
    if depth:  # decoding after `depth` tokens of context: the test's own prompt is left out (-p 0)
        deep = [llama_bench, "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-d", str(depth), "-t", str(threads),
                "-r", str(repeats), "-o", "json"]  # fmt: skip
        gen = next(r for r in run_json(deep) if r["n_gen"] > 0)
        row.update(decode_tokens_per_s=gen["avg_ts"], decode_depth=depth, command_depth=" ".join(deep))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-bench", required=True)
    p.add_argument("--llama-quantize", help="also time q8_0 and f16 copies of the GGUF")
    p.add_argument("--model", default=DEFAULT_PRESET)
    p.add_argument("--prompt-tokens", type=int, default=3139)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--decode-depth",
        type=int,
        default=None,
        help="tokens of context before the timed decoding (default: --prompt-tokens; 0: none)",
    )
    add_out_argument(p, "llamacpp", "where llama.cpp's results go")
    args = p.parse_args()
    depth = args.prompt_tokens if args.decode_depth is None else args.decode_depth
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    preset = find_preset(args.model)
    if preset is None:
        p.error(f"{args.model!r} is not a preset")
    gguf = assemble_preset_file(preset)
    files = {"shipped": gguf}
    with tempfile.TemporaryDirectory() as scratch:
        if args.llama_quantize:
            for kind in ("q8_0", "f16"):
                target = Path(scratch) / f"{kind}.gguf"
                subprocess.run([args.llama_quantize, "--allow-requantize", str(gguf), str(target), kind.upper()],
                               check=True, capture_output=True)  # fmt: skip
                files[kind] = target
        results = dict(model=preset.name, cpu=cpu_name(), threads=args.threads, prompt_tokens=args.prompt_tokens,
                       decode_depth=depth, rows={})  # fmt: skip
        for name, path in files.items():
            row = bench(args.llama_bench, path, args.prompt_tokens, args.new_tokens, args.threads, args.repeats, depth)
            ttft = args.prompt_tokens / row["prompt_tokens_per_s"]
            row.update(ttft_s=ttft, last_token_128_s=ttft + 127 / row["decode_tokens_per_s"],
                       last_token_256_s=ttft + 255 / row["decode_tokens_per_s"])  # fmt: skip
            results["rows"][name] = row
            print(name, {k: v for k, v in row.items() if k != "command"}, flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [f"llama.cpp (llama-bench), {preset.name}, {results['cpu']}, {args.threads} threads, "
             f"{args.prompt_tokens}-token prompt; decoding after {depth} tokens of context.", "",
             "| GGUF | prompt tok/s | TTFT (s) | decode tok/s, empty context | decode tok/s, after the prompt "
             "| last token, 128 (s) | last token, 256 (s) |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, r in results["rows"].items():
        cells = [r["prompt_tokens_per_s"], r["ttft_s"], r["decode_tokens_per_s_empty"], r["decode_tokens_per_s"],
                 r["last_token_128_s"], r["last_token_256_s"]]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
