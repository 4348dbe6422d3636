"""The paper's §3.3 example: two chunks of career statistics and one question that needs both.

On the same prompt, each way of prefilling it answers on the default model, and is measured against full
recompute (the reference):
- full recompute: every token computed, the two chunks in view of each other;
- full KV reuse: the two chunks' KV computed each on its own, glued at their real positions, nothing recomputed;
- blend at r = 0.15: full KV reuse, then the 15% of chunk tokens the question attends to most recomputed;
- guarded blend: the same blend, recomputed in full (r = 1.0) when the guard finds its first token risky: the
  default `Guard()` when the first token is a near tie (top-1 minus top-2 probability below 0.1), a stricter
  setting when its first-token KL to full KV reuse is above 0.2 nats.

For each: its answer; whether its first token is full recompute's; its teacher-forced mean KL(full || method) over
full's answer (`cacheblend_rag.evaluation.fidelity`); its compute share (token-layers computed / a full
prefill's); and, for the blends, the guard's signals (`metrics.risk`) and the ratios it escalated through
(`metrics.escalations`). One prompt is one case: the fidelity benchmark (docs/benchmarks.md) is where methods are
compared over many.

    python examples/messi_ronaldo.py [--model PRESET_OR_PATH] [--dtype float32]

On the default model (qwen2.5-coder-0.5b-instruct, float32; the output of that run closes this file), blend at
r = 0.15 gave full recompute's short answer ("13") at a compute share of 0.36, but not its free answer: "Messi
scored 8 goals more" where full says 13. The default guard escalated neither prompt (first-token margins 0.24 and
0.20, no near tie), so it answered as the fixed blend. The stricter guard escalated the short-answer prompt (KL to
reuse 0.256 > 0.2) to a full recompute (KL 0, compute share 1.23) and not the free one (0.150), whose answer
still parted from full's after the same first words: a first-token guard cannot see a change later in the
answer. Full recompute's own answers are wrong too (13, where 13 - 8 = 5): what is measured here is agreement
with full, not correctness.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cacheblend_rag import QA_SHORT_TEMPLATE, BlendConfig, CacheBlendEngine, EngineConfig, Guard, PromptTemplate
from cacheblend_rag.evaluation.fidelity import compare, measure, reference_answer

CHUNKS = [
    "Lionel Messi is an Argentine footballer who plays as a forward and captains the Argentina national team. "
    "He played at five FIFA World Cups, from 2006 in Germany to 2022 in Qatar, and made 26 World Cup "
    "appearances, a record. Messi scored 13 goals at FIFA World Cups: one in 2006, none in 2010, four in 2014, "
    "one in 2018 and seven in 2022, when Argentina won the tournament and he received the Golden Ball as its "
    "best player. He has won eight Ballon d'Or awards and more than 40 trophies with his clubs and country.",
    "Cristiano Ronaldo is a Portuguese footballer who plays as a forward and captains the Portugal national "
    "team. He also played at five FIFA World Cups, from 2006 to 2022, and became the first man to score at five "
    "different World Cups. Ronaldo made 22 World Cup appearances and scored 8 goals at FIFA World Cups: one in "
    "2006, one in 2010, one in 2014, four in 2018, including a hat-trick against Spain, and one in 2022. He is "
    "the all-time top scorer in men's international football and has won five Ballon d'Or awards.",
]
QUESTION = "How many goals did Messi score more than Cristiano Ronaldo at FIFA World Cups?"
MAX_NEW_TOKENS = 60


@dataclass(frozen=True)
class Method:
    label: str
    engine: CacheBlendEngine  # the guarded blends run on engines that share the model and the chunk store
    mode: str
    blend: BlendConfig | None = None


STRICT = Guard(min_margin=0.0, max_kl=0.2)  # the KL trigger: top-1 agreement 0.961 in the guard study, the highest


def methods(engine: CacheBlendEngine, ratio: float, dtype: str) -> list[Method]:
    def guarded(guard: Guard) -> CacheBlendEngine:
        config = EngineConfig(dtype=dtype, guard=guard)
        return CacheBlendEngine(engine.model, engine.tokenizer, config=config, store=engine.store)

    blend = BlendConfig(recompute_ratio=ratio)
    return [
        Method("full", engine, "full"),
        Method("reuse", engine, "reuse"),
        Method(f"blend r={ratio:g}", engine, "blend", blend),
        Method(f"guard, default ({Guard().describe()})", guarded(Guard()), "blend", blend),
        Method(f"guard, stricter ({STRICT.describe()})", guarded(STRICT), "blend", blend),
    ]


def fidelity(method: Method, prompt: Any, reference: Any) -> dict[str, Any]:
    """Teacher-forced figures against full recompute's reference (full against itself: KL 0, same tokens)."""
    if method.mode == "full":
        return compare(reference, reference.logprobs) | {"compute_share": 1.0, "risk": None, "escalations": [],
                                                         "guard_reason": None}  # fmt: skip
    return measure(method.engine, prompt, reference, method.blend)


def risk_text(record: dict[str, Any]) -> str:
    risk = record["risk"]
    if risk is None:
        return ""
    escalated = " -> ".join(f"r={r:g}" for r in record["escalations"]) or "none"
    if record["escalations"]:
        escalated += f" ({record['guard_reason']})"
    return (
        f"\n    guard signals: KL(blend || reuse) {risk['kl_reuse']:.3f}, first token as reuse's: "
        f"{'yes' if risk['agree_reuse'] else 'no'}, margin {risk['margin']:.2f}; escalated: {escalated}"
    )


def run(engine: CacheBlendEngine, template: PromptTemplate, ratio: float, dtype: str) -> None:
    prompt = engine.build_prompt(CHUNKS, QUESTION, template=template)
    # each chunk's KV computed on its own after the prefix, as in the paper (not grouped with the other chunk)
    engine.precompute(CHUNKS, QUESTION, template=template, context=None)
    reference = reference_answer(engine, prompt, MAX_NEW_TOKENS)
    print(f"prompt {prompt.num_tokens} tokens; full recompute's answer: {reference.text.strip()!r}")
    mismatched = []
    for method in methods(engine, ratio, dtype):
        result = method.engine.generate(prompt, mode=method.mode, blend=method.blend, max_new_tokens=MAX_NEW_TOKENS)
        record = fidelity(method, prompt, reference)
        same = bool(record["first_token"])
        print(f"[{method.label}] {result.text.strip()}")
        print(
            f"    first token as full's: {'yes' if same else 'no'}, mean KL(full || method) "
            f"{record['kl_mean']:.4f} nats, top-1 agreement {record['top1']:.2f}, "
            f"compute share {record['compute_share']:.2f}" + risk_text(record)
        )
        if method.mode == "blend" and (not same or result.text.strip() != reference.text.strip()):
            mismatched.append(method.label)
    if mismatched:
        print(
            f"=> {', '.join(mismatched)}: on this prompt the answer is not full recompute's; the recomputed tokens "
            "did not restore all that the separately computed chunks miss of each other."
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="preset or local checkpoint (default: the default preset)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--ratio", type=float, default=0.15)
    args = p.parse_args()

    engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig(dtype=args.dtype))
    print(f"Q: {QUESTION}\n(reference: 13 - 8 = 5 more goals)")
    templates = [
        ("short answers (the research code's QA prompt)", QA_SHORT_TEMPLATE),
        ("free answers", PromptTemplate()),
    ]
    for title, template in templates:
        print(f"\n== {title}")
        run(engine, template, args.ratio, args.dtype)


if __name__ == "__main__":
    main()


# Output of `OMP_NUM_THREADS=1 python examples/messi_ronaldo.py` (default model, float32, CPU; long lines wrapped):
#
#   Q: How many goals did Messi score more than Cristiano Ronaldo at FIFA World Cups?
#   (reference: 13 - 8 = 5 more goals)
#
#   == short answers (the research code's QA prompt)
#   prompt 398 tokens; full recompute's answer: '13'
#   [full] 13
#       first token as full's: yes, mean KL(full || method) 0.0000 nats, top-1 agreement 1.00, compute share 1.00
#   [reuse] 14
#       first token as full's: yes, mean KL(full || method) 0.1467 nats, top-1 agreement 0.67, compute share 0.13
#   [blend r=0.15] 13
#       first token as full's: yes, mean KL(full || method) 0.0220 nats, top-1 agreement 1.00, compute share 0.36
#       guard signals: KL(blend || reuse) 0.256, first token as reuse's: yes, margin 0.24; escalated: none
#   [guard, default (margin < 0.1 -> r=1)] 13
#       first token as full's: yes, mean KL(full || method) 0.0220 nats, top-1 agreement 1.00, compute share 0.36
#       guard signals: KL(blend || reuse) 0.256, first token as reuse's: yes, margin 0.24; escalated: none
#   [guard, stricter (KL to reuse > 0.2 -> r=1)] 13
#       first token as full's: yes, mean KL(full || method) 0.0000 nats, top-1 agreement 1.00, compute share 1.23
#       guard signals: KL(blend || reuse) 0.256, first token as reuse's: yes, margin 0.24; escalated: r=1 (first-
#         token KL to reuse 0.256 > 0.2)
#
#   == free answers
#   prompt 361 tokens; full recompute's answer: 'Based on the information provided in the passages, Messi scored 13
#     goals more than Cristiano Ronaldo at FIFA World Cups.'
#   [full] Based on the information provided in the passages, Messi scored 13 goals more than Cristiano Ronaldo at
#     FIFA World Cups.
#       first token as full's: yes, mean KL(full || method) 0.0000 nats, top-1 agreement 1.00, compute share 1.00
#   [reuse] Based on the passage, Cristiano Ronaldo scored 8 goals at FIFA World Cups.
#       first token as full's: yes, mean KL(full || method) 0.0935 nats, top-1 agreement 0.84, compute share 0.08
#   [blend r=0.15] Based on the information provided in the passages, Messi scored 8 goals more than Cristiano
#     Ronaldo at FIFA World Cups.
#       first token as full's: yes, mean KL(full || method) 0.0060 nats, top-1 agreement 0.96, compute share 0.29
#       guard signals: KL(blend || reuse) 0.150, first token as reuse's: yes, margin 0.20; escalated: none
#   [guard, default (margin < 0.1 -> r=1)] Based on the information provided in the passages, Messi scored 8 goals
#     more than Cristiano Ronaldo at FIFA World Cups.
#       first token as full's: yes, mean KL(full || method) 0.0060 nats, top-1 agreement 0.96, compute share 0.29
#       guard signals: KL(blend || reuse) 0.150, first token as reuse's: yes, margin 0.20; escalated: none
#   [guard, stricter (KL to reuse > 0.2 -> r=1)] Based on the information provided in the passages, Messi scored 8
#     goals more than Cristiano Ronaldo at FIFA World Cups.
#       first token as full's: yes, mean KL(full || method) 0.0060 nats, top-1 agreement 0.96, compute share 0.29
#       guard signals: KL(blend || reuse) 0.150, first token as reuse's: yes, margin 0.20; escalated: none
#   => blend r=0.15, guard, default (margin < 0.1 -> r=1), guard, stricter (KL to reuse > 0.2 -> r=1): on this
#     prompt the answer is not full recompute's; the recomputed tokens did not restore all that the separately
#     computed chunks miss of each other.
