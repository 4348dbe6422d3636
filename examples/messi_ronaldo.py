"""The paper's §3.3 example: two chunks of career statistics and one question that needs both.

Each prefill mode answers on the default model. Full recompute and prefix caching see both chunks together;
full KV reuse glues two separately computed caches and misses the cross-attention between them; blend
recomputes the most deviating ~15% of tokens to restore it.

    python examples/messi_ronaldo.py [--model PRESET_OR_PATH] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cacheblend_rag import QA_SHORT_TEMPLATE, CacheBlendEngine, EngineConfig, PromptTemplate

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="preset or local checkpoint (default: the default preset)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--ratio", type=float, default=0.15)
    args = p.parse_args()

    engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig(dtype=args.dtype))
    print(f"Q: {QUESTION}\n(reference: 13 - 8 = 5 more goals)")
    runs = [("full", None), ("prefix", None), ("reuse", None), ("blend", args.ratio)]
    templates = [
        ("short answers (the research code's QA prompt)", QA_SHORT_TEMPLATE),
        ("free answers", PromptTemplate()),
    ]
    for title, template in templates:
        engine.precompute(CHUNKS, template=template)  # each chunk's KV computed once, on its own, after the prefix
        for mode, ratio in runs:  # warm-up, so that TTFT below is the steady state
            engine.generate(CHUNKS, QUESTION, mode=mode, recompute_ratio=ratio, template=template, max_new_tokens=1)
        print(f"\n== {title}")
        for mode, ratio in runs:
            result = engine.generate(
                CHUNKS, QUESTION, mode=mode, recompute_ratio=ratio, template=template, max_new_tokens=60
            )
            m = result.metrics
            label = mode if ratio is None else f"{mode} r={ratio}"
            print(f"[{label}] {result.text.strip()}")
            print(
                f"    TTFT {m.ttft_s * 1000:.0f} ms, recomputed {m.recomputed_tokens}/{m.prompt_tokens} tokens, "
                f"chunks hit {m.chunks_hit}"
            )


if __name__ == "__main__":
    main()
