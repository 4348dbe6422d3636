"""Where does KV captured in another prompt hurt? Full KV reuse and the default blend of one case on chunk KV cut
from an earlier request's full prefill (the same passages in another order), with some chunks' entries put back to
isolated ones.

Runs on `main` (the public API, and `engine.chunks` for putting one entry back). Variants: every chunk isolated;
every chunk captured (`EngineConfig(capture="all")`, the fidelity benchmark's `+cap`); captured but the prompt's
first chunk isolated (its real context is the prefix alone); captured but the first two isolated. Prints mean
KL(full || method) along full recompute's answer and the method's first token.

    python research/captured_position_case.py --dataset multi_news --case 0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from benchlib.fidelity_context import earlier_order  # noqa: E402

from cacheblend_rag import BlendConfig, CacheBlendEngine, EngineConfig  # noqa: E402
from cacheblend_rag.engine import TokenizedPrompt  # noqa: E402
from cacheblend_rag.evaluation import load_dataset  # noqa: E402
from cacheblend_rag.evaluation.fidelity import measure, prepare_case  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dataset", default="multi_news")
    p.add_argument("--case", type=int, default=0)
    p.add_argument("--data-dir", default="../shared/data")
    args = p.parse_args()
    ds = load_dataset(args.dataset, args.data_dir, args.case + 1)
    spec, case = ds.spec, ds.cases[args.case]
    engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig(miss_policy="blend"), show_progress=False)
    prompt, ref = prepare_case(engine, spec, case)
    capture = CacheBlendEngine(engine.model, engine.tokenizer, template=engine.template,
                               config=EngineConfig(miss_policy="full"))  # fmt: skip
    order = earlier_order(case.id, len(prompt.chunk_ids))
    earlier = TokenizedPrompt(prompt.prefix_ids, tuple(prompt.chunk_ids[i] for i in order), prompt.suffix_ids)
    print(f"{spec.name} {case.id}: {prompt.num_tokens} tokens, {len(order)} chunks, earlier order {order}")

    def isolate(positions: list[int]) -> None:
        capture.clear_store()
        capture.prefill(earlier, "full")
        prefix = capture.chunks.load_prefix(prompt.prefix_ids)
        for j in positions:  # under capture="all" a prefill has no context: the isolated KV, under the captured key
            capture.store.put(capture.chunks.prefill(prefix.kv, prompt.prefix_ids, prompt.chunk_ids[j]))

    variants = {"captured": [], "captured, first chunk isolated": [0],
                "captured, first two isolated": [0, 1]}  # fmt: skip
    for name, positions in [("isolated", None), *variants.items()]:
        if positions is not None:
            isolate(positions)
        eng = engine if positions is None else capture
        for label, blend in (("reuse", None), ("attention@0.15", BlendConfig())):
            rec = measure(eng, prompt, ref, blend)
            print(
                f"  {name:<32} {label:<15} KL {rec['kl_mean']:.4f}  first token {rec['first_token']:.0f}  "
                f"top-1 {rec['top1']:.3f}"
            )


if __name__ == "__main__":
    main()
