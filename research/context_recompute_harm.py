"""Why does recomputing more tokens take a blend over contextual chunk KV further from full recompute?

On MuSiQue's first case with acyclic contexts (research/README.md, study 17), full KV reuse was at 0.050 nats and the
default blend went 0.040, 0.127, 0.541, 1.852 as r rose 0.05 -> 0.2. This script takes that case apart, on the
first answer token (the prefill's logits, KL(full || method) in nats, and whether its top token is full's):
- the blend at several ratios (the attention rule's selection, from its own full-reuse pass), as a check against
  the fidelity benchmark's records;
- at one ratio (`--ratio`), the selected tokens of one chunk only, and all selected tokens but one chunk's: which
  chunk's recompute does the harm;
- per chunk: which other chunks of the prompt its entry was cached after, and how many tokens were selected in it;
- the same selections over isolated entries (each chunk prefilled alone), where more recompute helps.

The "contextual" rows of research/README.md, study 19 were measured at commit 73aef61, before the engine read an entry
built after a later chunk from its isolated entry; from 78f0e19 on the engine applies that rule itself, so here
"contextual" reads like "ctx, later isolated".

Runs on `main` through the public API (the fusor and the planner with the engine's own store and loader); the
contexts are the fidelity benchmark's (`--chunk-context neighbours --context-order acyclic`: 2 neighbours among the
set's whole passage pool, only passages earlier in a fixed order of the pool).

    python research/context_recompute_harm.py --datasets musique --cases 0 --by-chunk --ratio 0.2
    python research/context_recompute_harm.py --datasets musique,wikimqa,multi_news,samsum --cases 1,2 \
        --ratios 0.05,0.15,0.3
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from benchlib.fidelity_context import PoolNeighbours, context_engine  # noqa: E402

from cacheblend_rag import BlendConfig, CacheBlendEngine, EngineConfig
from cacheblend_rag.engine.prefill.planning import (
    blend_plan,
    chosen_plan,
    prefix_and_chunk_masks,
    question_mask,
    reuse_plan,
)
from cacheblend_rag.evaluation import load_dataset
from cacheblend_rag.evaluation.fidelity import Reference, prepare_case, token_kl
from cacheblend_rag.fusion import FusionPlan, fuse


def first_token(engine: CacheBlendEngine, prompt, plan: FusionPlan, first: Reference) -> tuple[float, int]:
    """-> (KL(full || method) on the first answer token, the method's top token) for one plan over the store;
    `first`: full recompute's reference cut to its first token."""
    parts = [engine.store.get(k) for k in engine.prompt_keys(prompt)]
    result = fuse(engine.lm, plan, engine.chunks.prompt_kv(parts, prompt.num_tokens))
    return float(token_kl(first, result.logits[None])[0]), int(result.logits.argmax())


def question_scores(engine: CacheBlendEngine, prompt) -> torch.Tensor:
    """The attention rule's first pass over the store: how much the question attends to each prompt token."""
    parts = [engine.store.get(k) for k in engine.prompt_keys(prompt)]
    probe = fuse(engine.lm, reuse_plan(prompt), engine.chunks.prompt_kv(parts, prompt.num_tokens),
                 want_logits=False, attention_from=question_mask(prompt))  # fmt: skip
    assert probe.attention is not None
    return probe.attention.cpu()


def run_case(engine: CacheBlendEngine, full, case_index: int, args) -> list[dict]:
    spec, case = full.spec, full.cases[case_index]
    engine.clear_store()
    prompt, ref = prepare_case(engine, spec, case)
    first = replace(ref, token_ids=ref.token_ids[:1], logprobs=ref.logprobs[:1])
    ref_tok = ref.token_ids[0]
    chunks = list(case.chunks)
    print(f"{spec.name} {case.id}: {prompt.num_tokens} tokens, {len(chunks)} chunks, answer {ref.text!r}", flush=True)

    ctx = context_engine(engine, 2)
    contexts = PoolNeighbours(full, 2, acyclic=True).context(chunks)
    ctx.precompute(chunks, case.question, template=spec.template, context=contexts)
    index = {c: j for j, c in enumerate(chunks)}
    in_prompt = [[index[t] for t in contexts[j] if t in index] for j in range(len(chunks))]
    rows: list[dict] = []

    def record(kv: str, what: str, plan: FusionPlan, engine_: CacheBlendEngine, **extra) -> None:
        kl, tok = first_token(engine_, prompt, plan, first)
        row = dict(dataset=spec.name, case_id=case.id, kv=kv, what=what, kl_first=kl, first_kept=tok == ref_tok,
                   recomputed=int((~plan.exact).sum()), **extra)  # fmt: skip
        rows.append(row)
        print(f"  {kv:<22} {what:<28} KL {kl:.3f}  first {'kept' if tok == ref_tok else 'lost'}  "
              f"recomputed {row['recomputed']}", flush=True)  # fmt: skip

    # Chunk KV variants: each chunk after its context, or on its isolated entry (stored beside it) where its
    # context holds a chunk that comes later in this prompt ("later"), or any other chunk of this prompt ("any").
    variants = {
        "isolated": (engine, None),
        "contextual": (ctx, contexts),
        "ctx, later isolated": (ctx, [[] if any(i > j for i in in_prompt[j]) else c for j, c in enumerate(contexts)]),
        "ctx, any isolated": (ctx, [[] if in_prompt[j] else c for j, c in enumerate(contexts)]),
    }
    ratios = [float(x) for x in args.ratios.split(",")]
    _, chunk_mask = prefix_and_chunk_masks(prompt)
    for kv, (eng, context) in variants.items():
        if context is not None:
            eng.set_chunk_context(chunks, context, question=case.question, template=spec.template)
        scores = question_scores(eng, prompt)
        record(kv, "reuse", reuse_plan(prompt), eng)
        for r in ratios:
            plan = blend_plan(prompt, BlendConfig(rule="attention", recompute_ratio=r), scores)
            record(kv, f"attention@{r:g}", plan, eng, ratio=r)
        if not args.by_chunk or kv not in ("isolated", "contextual"):
            continue
        plan = blend_plan(prompt, BlendConfig(rule="attention", recompute_ratio=args.ratio), scores)
        chosen = chunk_mask & ~plan.exact
        for j, (start, end) in enumerate(prompt.chunk_spans):
            span = torch.zeros_like(chosen)
            span[start:end] = True
            info = dict(chunk=j, selected_in_chunk=int((chosen & span).sum()),
                        context_in_prompt=in_prompt[j] if kv == "contextual" else [])  # fmt: skip
            record(kv, f"r={args.ratio:g}, chunk {j} only", chosen_plan(prompt, chosen & span), eng, **info)
            record(kv, f"r={args.ratio:g}, all but chunk {j}", chosen_plan(prompt, chosen & ~span), eng, **info)
    print(f"  contexts in the prompt, per chunk: {in_prompt}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--datasets", default="musique")
    p.add_argument("--cases", default="0", help="comma-separated case indices of each data set")
    p.add_argument("--by-chunk", action="store_true", help="take the selection at --ratio apart, chunk by chunk")
    p.add_argument("--ratio", type=float, default=0.2, help="the ratio whose selection is taken apart by chunk")
    p.add_argument("--ratios", default="0.05,0.1,0.15,0.2,0.3", help="the blend's ratios")
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--out", type=Path, default=Path("research/results/context_recompute_harm"))
    args = p.parse_args()
    engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig(), show_progress=False)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.datasets.split(","):
        full = load_dataset(name, args.data_dir)
        for i in [int(x) for x in args.cases.split(",")]:
            rows = run_case(engine, full, i, args)
            with open(args.out / f"{full.spec.name}-{i}.jsonl", "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"records in {args.out}")


if __name__ == "__main__":
    main()
