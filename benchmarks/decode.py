"""Decoding speed of one request, and what int8 decode weights cost in fidelity.

For each setting (--settings: `decode_weights` "native" fp32 and "int8"; "bf16", the whole engine in bfloat16, the
fast prefill on CPUs with AMX or AVX-512-BF16; "bf16-int8", bf16 with int8 decode weights): a warm blend request
over --chunks chunks of
--chunk-tokens tokens answers with up to --new-tokens tokens; reports the time to first token, decode tokens/s
and the time to the last token, median over --repeats. Answers stop early at end of turn, so the decode rate is
(tokens - 1) / decode time.

Fidelity: along the native answer of each of --cases prompts (teacher forcing), every decode step runs once with
native and once with int8 weights, each on its own cache from the same prefill; reports the mean
KL(native || int8) of the next-token distributions and the share of steps whose top-1 token agrees.
With a bf16 setting, bf16 is judged the same way against fp32: the first token of each engine's own blend
(its own chunk KV) and every decode step along fp32's answer. Writes OUT/results.json and summary.md.

    python benchmarks/decode.py                       # default model, 6 x 512-token chunks, 128 tokens
    python benchmarks/decode.py --model smollm2-135m-instruct --new-tokens 16 --cases 2 --out /tmp/decode
    python benchmarks/decode.py --settings native,int8,bf16 --cases 0 --out benchmarks/results/decode-amx
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from benchlib.cli import add_out_argument, cpu_name, model_name  # noqa: E402
from benchlib.load_requests import QUESTIONS  # noqa: E402
from benchlib.timing import add_data_dir_argument, chunk_texts  # noqa: E402

from cacheblend_rag import CacheBlendEngine, EngineConfig, ServingConfig  # noqa: E402
from cacheblend_rag.engine.serving.batch_decode import BatchDecoder, DecodeCache  # noqa: E402
from cacheblend_rag.models.int8 import int8_decode_lm  # noqa: E402


def timing(engine: CacheBlendEngine, chunks: list[str], args) -> dict:
    runs = []
    for r in range(args.repeats):
        result = engine.generate(chunks, QUESTIONS[r % len(QUESTIONS)], max_new_tokens=args.new_tokens)
        m = result.metrics
        runs.append(dict(ttft_s=m.ttft_s, decode_s=m.decode_s, tokens=m.generated_tokens,
                         tokens_per_s=(m.generated_tokens - 1) / m.decode_s if m.decode_s else float("nan"),
                         last_token_s=m.ttft_s + m.decode_s))  # fmt: skip
    return {k: statistics.median(run[k] for run in runs) for k in runs[0]} | {"runs": runs}


def fidelity(engine: CacheBlendEngine, pool: list[str], args) -> dict:
    """KL(native || int8) per decode step along native's greedy answer (teacher forcing): both start from the same
    prompt cache, and each keeps the keys and values its own weights compute for the answer's tokens, as in use."""
    native = BatchDecoder(engine.lm)
    int8 = BatchDecoder(int8_decode_lm(engine.model))
    kls, agree = [], []
    for case in range(args.cases):
        chunks = [pool[(case * 5 + j * 7) % len(pool)] for j in range(args.chunks)]
        answer = engine.generate(chunks, QUESTIONS[case % len(QUESTIONS)], max_new_tokens=args.new_tokens).token_ids
        prompt = engine.build_prompt(chunks, QUESTIONS[case % len(QUESTIONS)])
        pre = engine.prefill(prompt)
        room = pre.num_tokens + len(answer)
        a, b = DecodeCache(pre.cache, pre.num_tokens, room), DecodeCache(pre.cache, pre.num_tokens, room)
        along_answer(native, a, int8, b, answer, kls, agree)
    return dict(steps=len(kls), kl_mean=statistics.mean(kls), kl_max=max(kls), top1_agree=statistics.mean(agree))


def kl_and_agree(p_logits: torch.Tensor, q_logits: torch.Tensor) -> tuple[float, int]:
    """KL(p || q) of two next-token distributions given as logits, and whether their top-1 tokens agree."""
    p, q = torch.log_softmax(p_logits.float(), -1), torch.log_softmax(q_logits.float(), -1)
    return float((p.exp() * (p - q)).sum()), int(p.argmax() == q.argmax())


def along_answer(ref: BatchDecoder, a: DecodeCache, other: BatchDecoder, b: DecodeCache, answer: list[int],
                 kls: list[float], agree: list[int]) -> None:  # fmt: skip
    """Feed the answer's tokens to both decoders, each on its own cache (teacher forcing), and add each step's
    `kl_and_agree` to `kls` and `agree`."""
    for token in answer[:-1]:
        kl, same = kl_and_agree(ref.step([token], [a])[0], other.step([token], [b])[0])
        kls.append(kl)
        agree.append(same)


def bf16_fidelity(base: CacheBlendEngine, bf16: CacheBlendEngine, pool: list[str], args) -> dict:
    """KL(fp32 || bf16) of the first token (each engine's own blend prefill, its own chunk KV) and of every decode
    step along the fp32 greedy answer (teacher forcing, each engine on its own cache): bf16 judged like a codec."""
    first, first_agree, kls, agree = [], [], [], []
    ref, other = BatchDecoder(base.lm), BatchDecoder(bf16.lm)
    for case in range(args.cases):
        chunks = [pool[(case * 5 + j * 7) % len(pool)] for j in range(args.chunks)]
        question = QUESTIONS[case % len(QUESTIONS)]
        answer = base.generate(chunks, question, max_new_tokens=args.new_tokens).token_ids
        pres = [engine.prefill(engine.build_prompt(chunks, question)) for engine in (base, bf16)]
        kl, same = kl_and_agree(pres[0].logits, pres[1].logits)
        first.append(kl)
        first_agree.append(same)
        a, b = (DecodeCache(pre.cache, pre.num_tokens, pre.num_tokens + len(answer)) for pre in pres)
        along_answer(ref, a, other, b, answer, kls, agree)
    return dict(cases=args.cases, first_kl_mean=statistics.mean(first), first_top1_agree=statistics.mean(first_agree),
                steps=len(kls), kl_mean=statistics.mean(kls), kl_max=max(kls),
                top1_agree=statistics.mean(agree))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cases", type=int, default=8, help="prompts of the fidelity check (0: skip it)")
    p.add_argument("--settings", default="native,int8", help="comma-separated: native, int8, bf16, bf16-int8")
    add_out_argument(p, "decode", "where the decode results go")
    add_data_dir_argument(p)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = CacheBlendEngine.from_pretrained(args.model, show_progress=False)
    pool = chunk_texts(base.tokenizer, 24, args.chunk_tokens, Path(args.data_dir) if args.data_dir else None)
    base.precompute(pool, QUESTIONS[0])
    chunks = pool[: args.chunks]
    results = dict(model=model_name(args.model), cpu=cpu_name(), threads=torch.get_num_threads(),
                   prompt_tokens=base.build_prompt(chunks, QUESTIONS[0]).num_tokens, new_tokens=args.new_tokens,
                   settings={})  # fmt: skip
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if unknown := set(settings) - {"native", "int8", "bf16", "bf16-int8"}:
        raise SystemExit(f"unknown --settings {sorted(unknown)}: choose among native, int8, bf16, bf16-int8")
    bf16_engine = None
    for weights in settings:
        if weights.startswith("bf16"):  # its own model copy and store: bf16 weights, bf16 chunk KV
            serving = ServingConfig(decode_weights="int8" if weights == "bf16-int8" else "native")
            config = EngineConfig(dtype="bfloat16", serving=serving)
            engine = CacheBlendEngine.from_pretrained(args.model, config=config, show_progress=False)
            engine.precompute(pool if args.cases else chunks, QUESTIONS[0])
            bf16_engine = bf16_engine or engine
        else:
            config = EngineConfig(serving=ServingConfig(decode_weights=weights))
            engine = CacheBlendEngine(base.model, base.tokenizer, config=config, store=base.store)
        engine.generate(chunks, QUESTIONS[0], max_new_tokens=4)  # warm the path
        results["settings"][weights] = timing(engine, chunks, args)
        print(weights, {k: v for k, v in results["settings"][weights].items() if k != "runs"}, flush=True)
    if args.cases:
        results["int8_fidelity"] = fidelity(base, pool, args)
        print("int8 fidelity", results["int8_fidelity"], flush=True)
        if bf16_engine is not None:
            results["bf16_fidelity"] = bf16_fidelity(base, bf16_engine, pool, args)
            print("bf16 fidelity", results["bf16_fidelity"], flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [f"Model {results['model']}, {results['cpu']}, {results['threads']} threads; warm blend (r = 0.15), "
             f"{results['prompt_tokens']}-token prompt, answers up to {args.new_tokens} tokens, median of "
             f"{args.repeats}.", "",
             "| decode weights | TTFT (s) | tokens | decode tokens/s | time to last token (s) |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    for weights, s in results["settings"].items():
        lines.append(f"| {weights} | {s['ttft_s']:.2f} | {s['tokens']:.0f} | {s['tokens_per_s']:.1f} | "
                     f"{s['last_token_s']:.1f} |")  # fmt: skip
    if args.cases:
        f = results["int8_fidelity"]
        lines += ["", f"int8 vs native along native's answers ({f['steps']} decode steps, {args.cases} prompts): "
                  f"mean KL {f['kl_mean']:.5f} nats (max {f['kl_max']:.4f}), "
                  f"top-1 agreement {f['top1_agree']:.3f}."]  # fmt: skip
    if "bf16_fidelity" in results:
        f = results["bf16_fidelity"]
        lines += ["", f"bf16 vs fp32, each with its own chunk KV and cache ({args.cases} prompts): first token mean KL "
                  f"{f['first_kl_mean']:.5f} nats, top-1 agreement {f['first_top1_agree']:.3f}; along fp32's answers "
                  f"({f['steps']} decode steps) mean KL {f['kl_mean']:.5f} (max {f['kl_max']:.4f}), "
                  f"top-1 agreement {f['top1_agree']:.3f}."]  # fmt: skip
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
