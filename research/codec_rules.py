"""Which selection rules does a quantizing codec disturb?

Per rule at r = 0.15, the paired difference KL(full || rule, chunk KV read through the codec) minus
KL(full || rule, uncompressed store), over the guard gate's 12 questions on SmolLM2-135M-Instruct (fp32), with 95%
bootstrap intervals. Runs on the current code:

    python research/codec_rules.py > research/results/codec_rules.txt
"""

import argparse
import dataclasses
import statistics

from cacheblend_rag import CacheBlendEngine, EngineConfig, blend_rule
from cacheblend_rag.evaluation import bootstrap_ci
from cacheblend_rag.evaluation.fidelity import measure, reference_answer
from cacheblend_rag.testing import GATE_ANSWER_TOKENS, GATE_PASSAGES, GATE_QUESTIONS

RULES = ("attention", "paper", "gradual", "epic")
RATIO = 0.15


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    config = EngineConfig(dtype="float32", miss_policy="blend")
    engine = CacheBlendEngine.from_pretrained("smollm2-135m-instruct", config=config, show_progress=False)
    coded = {  # engines on the same model whose memory tier keeps chunk KV through each codec
        codec: CacheBlendEngine(
            engine.model,
            engine.tokenizer,
            config=dataclasses.replace(config, store=dataclasses.replace(config.store, memory_codec=codec)),
        )
        for codec in ("int8", "int4")
    }
    native: dict[str, list[float]] = {rule: [] for rule in RULES}
    diffs: dict[tuple[str, str], list[float]] = {(codec, rule): [] for codec in coded for rule in RULES}
    for question in GATE_QUESTIONS:
        for each in (engine, *coded.values()):
            each.precompute(GATE_PASSAGES, question)
        prompt = engine.build_prompt(GATE_PASSAGES, question)
        reference = reference_answer(engine, prompt, GATE_ANSWER_TOKENS)
        for rule in RULES:
            base = measure(engine, prompt, reference, blend_rule(rule, RATIO))["kl_mean"]
            native[rule].append(base)
            for codec, coded_engine in coded.items():
                kl = measure(coded_engine, prompt, reference, blend_rule(rule, RATIO))["kl_mean"]
                diffs[(codec, rule)].append(kl - base)
    for (codec, rule), d in diffs.items():
        lo, hi = bootstrap_ci(d)
        mean_native = statistics.fmean(native[rule])
        print(f"| {codec} | {rule}@{RATIO} | {mean_native:.4f} | {statistics.fmean(d):+.4f} [{lo:+.4f}, {hi:+.4f}] |")


if __name__ == "__main__":
    main()
