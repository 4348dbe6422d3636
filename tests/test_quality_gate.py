"""The quality gate: on a real packaged model (SmolLM2-135M-Instruct, fp32), the default blend must follow full
recompute closely, measured by teacher forcing along full recompute's own answer (the fidelity benchmark's measure).

Deterministic, not a timing. A change that breaks token selection (a wrong ranking, a budget spent on the wrong
tokens, a mask or position error in the fused prefill) raises the KL and fails here. The bounds were set from
measured values with some headroom; the measured figures are in the comments.
"""

from __future__ import annotations

import statistics

import pytest

from cacheblend_rag import BlendConfig, CacheBlendEngine, EngineConfig, blend_rule
from cacheblend_rag.evaluation.fidelity import Reference, measure, reference_answer
from cacheblend_rag.testing import GATE_ANSWER_TOKENS, GATE_PASSAGES, GATE_QUESTIONS

pytestmark = pytest.mark.real_model

CHUNKS = GATE_PASSAGES
QUESTIONS = GATE_QUESTIONS[:3]
ANSWER_TOKENS = GATE_ANSWER_TOKENS

# Bounds on the mean over the three questions of the per-token KL(full || method), in nats, with the values
# measured when they were set (full KV reuse: 0.114). The default rule is "attention" (the question's attention in
# a first reuse pass); the deviation rules are guarded by "paper" (value deviation on layer 1) at r = 0.5 and by
# "gradual" at 0.15.
# Picking the least attended or random tokens instead gives 0.114 / 0.098 for the default at 0.15 and 0.114 /
# 0.090 at r = 0.5: both above their bounds.
# When the deviation rules were the default, picking the least or random deviating tokens gave 0.114 / 0.111 for
# "gradual" at 0.15 and 0.103 / 0.079 for the layer-1 check at 0.5: both above their bounds.
DEFAULT_KL_BOUND = 0.07  # default rule (attention) at its default ratio (0.15): measured 0.058
REUSE_OVER_DEFAULT = 1.6  # reuse is at least this many times further from full than the default (1.96)
DEFAULT_HALF_KL_BOUND = 0.03  # default rule at r = 0.5: measured 0.0245
DEVIATION_HALF_KL_BOUND = 0.04  # value deviation on layer 1 (the "paper" rule) at r = 0.5: measured 0.029
GRADUAL_KL_BOUND = 0.09  # gradual filtering on layers 1-3 (the "gradual" rule) at r = 0.15: measured 0.080
REUSE_OVER_DEFAULT_HALF = 4.0  # reuse is at least this many times further from full than the default at 0.5 (4.6)
# Contextual chunk KV (each chunk prefilled after its 2 nearest other chunks, `context_neighbours=2`; a chunk whose
# context holds a chunk placed after it in the prompt reads its isolated entry): measured 0.0598 for full reuse,
# 0.0404 for the default at 0.15 and 0.0539 at 0.05. Isolated entries (0.114, 0.058, 0.085) fail every one of these
# bounds. (Reading every contextual entry wherever its context sits gave 0.0136 / 0.0127 / 0.0124 here, and took a
# MuSiQue answer far from full recompute: research/README.md, study 19.)
CONTEXT_REUSE_KL_BOUND = 0.08
CONTEXT_DEFAULT_KL_BOUND = 0.05
# Captured chunk KV (`capture="all"`: cut from a cold request's full prefill of the same passages, the first in
# place and the others in reverse order): measured 0.0465 for full reuse, 0.0217 for the default at 0.15 and 0.0430
# at 0.05. Isolated entries (0.114, 0.058, 0.085) fail every one of these bounds.
CAPTURED_REUSE_KL_BOUND = 0.07
CAPTURED_DEFAULT_KL_BOUND = 0.035
# Grouped precompute (`precompute_groups`: the passages chained by similarity into one group, each later passage's
# KV kept from the group's full prefill): measured 0.0234 for full reuse, 0.0126 for the default at 0.15 and 0.0217
# at 0.05. Isolated entries (0.114, 0.058, 0.085) fail every one of these bounds.
GROUPED_REUSE_KL_BOUND = 0.04
GROUPED_DEFAULT_KL_BOUND = 0.025


@pytest.fixture(scope="module")
def engine() -> CacheBlendEngine:
    return CacheBlendEngine.from_pretrained(
        "smollm2-135m-instruct", config=EngineConfig(dtype="float32"), show_progress=False
    )


@pytest.fixture(scope="module")
def references(engine) -> list[tuple[object, Reference]]:
    out = []
    for question in QUESTIONS:
        engine.precompute(CHUNKS, question, context=None)  # isolated entries: the bounds above were set on them
        prompt = engine.build_prompt(CHUNKS, question)
        out.append((prompt, reference_answer(engine, prompt, ANSWER_TOKENS)))
    return out


def mean_kl(engine, references, blend: BlendConfig | None) -> float:
    """Mean over the questions of KL(full || blend) per answer token; `blend` None: full KV reuse."""
    return statistics.fmean(measure(engine, prompt, ref, blend)["kl_mean"] for prompt, ref in references)


def reuse_default_cheap(engine, references) -> tuple[float, float, float]:
    """Mean KL of full KV reuse, the default blend and the default rule at r = 0.05."""
    methods = (None, default_method(), default_method().with_ratio(0.05))
    return tuple(mean_kl(engine, references, blend) for blend in methods)  # type: ignore[return-value]


def default_method() -> BlendConfig:
    return BlendConfig()


def test_default_blend_stays_close_to_full_recompute_and_closer_than_reuse(engine, references):
    blend = mean_kl(engine, references, default_method())
    reuse = mean_kl(engine, references, None)
    assert blend < DEFAULT_KL_BOUND, f"default blend drifted from full recompute: mean KL {blend:.4f}"
    assert reuse > REUSE_OVER_DEFAULT * blend, f"blend ({blend:.4f}) is not clearly closer than reuse ({reuse:.4f})"


def test_default_rule_with_more_budget_is_far_closer_than_reuse(engine, references):
    blend = mean_kl(engine, references, default_method().with_ratio(0.5))
    reuse = mean_kl(engine, references, None)
    assert blend < DEFAULT_HALF_KL_BOUND, f"default rule at r = 0.5: mean KL {blend:.4f}"
    assert reuse > REUSE_OVER_DEFAULT_HALF * blend, f"blend ({blend:.4f}) is not far closer than reuse ({reuse:.4f})"


def test_the_deviation_rankings_find_the_tokens_that_matter(engine, references):
    deviation = mean_kl(engine, references, blend_rule("paper", 0.5))
    gradual = mean_kl(engine, references, blend_rule("gradual", 0.15))
    assert deviation < DEVIATION_HALF_KL_BOUND, f"key-deviation ranking: mean KL {deviation:.4f}"
    assert gradual < GRADUAL_KL_BOUND, f"gradual filtering: mean KL {gradual:.4f}"


def test_recomputing_everything_reproduces_full_recompute_on_the_real_model(engine, references):
    prompt, ref = references[0]
    exact = measure(engine, prompt, ref, default_method().with_ratio(1.0))
    assert exact["kl_max"] < 1e-4 and exact["top1"] == 1.0


def test_more_recompute_follows_full_recompute_more_closely(engine, references):
    rule = default_method().rule
    low, high = (mean_kl(engine, references, blend_rule(rule, r)) for r in (0.05, 0.5))
    assert high < low, (low, high)


def test_contextual_chunk_kv_brings_reuse_and_the_blend_closer_to_full_recompute(engine, references):
    isolated_default = mean_kl(engine, references, default_method())
    from cacheblend_rag.retrieval.neighbours import neighbour_context, neighbour_texts

    contexts = [neighbour_context(found) for found in neighbour_texts(CHUNKS, 2)]  # what context_neighbours=2 does
    try:
        for question in QUESTIONS:
            engine.precompute(CHUNKS, question, context=contexts)  # each chunk after its 2 nearest among CHUNKS
        reuse, default, cheap = reuse_default_cheap(engine, references)
    finally:
        engine.set_chunk_context(CHUNKS, None)  # the other tests' bounds are for isolated entries
    assert reuse < CONTEXT_REUSE_KL_BOUND, f"full reuse on contextual chunk KV: mean KL {reuse:.4f}"
    assert default < CONTEXT_DEFAULT_KL_BOUND, f"default blend on contextual chunk KV: mean KL {default:.4f}"
    assert cheap < isolated_default, (
        f"r = 0.05 on contextual KV ({cheap:.4f}) vs 0.15 isolated ({isolated_default:.4f})"
    )


def test_captured_chunk_kv_brings_reuse_and_the_blend_closer_to_full_recompute(engine, references):
    from dataclasses import replace

    isolated_default = mean_kl(engine, references, default_method())
    # an engine on the same model with a store of its own, and the cold request that fills it: its miss policy
    # answers in full, and that prefill's chunk KV is kept as `capture="all"` (the default) keeps it
    measuring = CacheBlendEngine(engine.model, engine.tokenizer, config=replace(engine.config, miss_policy="blend"))
    cold = CacheBlendEngine(engine.model, engine.tokenizer, config=replace(engine.config, miss_policy="full"),
                            store=measuring.store)  # fmt: skip
    earlier = cold.build_prompt([CHUNKS[0], *reversed(CHUNKS[1:])], GATE_QUESTIONS[3])
    first = cold.prefill(earlier, "blend").metrics
    assert (first.mode, first.chunks_captured) == ("full", len(CHUNKS))
    cold.wait_for_fills()
    prompt = references[0][0]
    read = measuring.prompt_keys(prompt, with_prefix=False)
    captured = [measuring.chunk_key(prompt.prefix_ids, ids, captured=True) for ids in prompt.chunk_ids]
    assert read == [measuring.chunk_key(prompt.prefix_ids, prompt.chunk_ids[0]), *captured[1:]]
    reuse, default, cheap = reuse_default_cheap(measuring, references)
    assert reuse < CAPTURED_REUSE_KL_BOUND, f"full reuse on captured chunk KV: mean KL {reuse:.4f}"
    assert default < CAPTURED_DEFAULT_KL_BOUND, f"default blend on captured chunk KV: mean KL {default:.4f}"
    assert cheap < isolated_default, f"r = 0.05 on captured KV ({cheap:.4f}) vs 0.15 isolated ({isolated_default:.4f})"


def test_grouped_precompute_brings_reuse_and_the_blend_closer_to_full_recompute(engine, references):
    from dataclasses import replace

    isolated_default = mean_kl(engine, references, default_method())
    # an engine on the same model with a store of its own, its corpus precomputed in groups of similar passages
    # (the passages chained by similarity: not the order the measured prompts put them in)
    grouped = CacheBlendEngine(engine.model, engine.tokenizer,
                               config=replace(engine.config, chunk_context="grouped"))  # fmt: skip
    done = [grouped.precompute(CHUNKS, question) for question in QUESTIONS]  # the setting means "groups"
    assert done[0][1] > 0 and all(computed == 0 for _, computed in done[1:])  # the prefix is the same
    prompt = references[0][0]
    read = grouped.prompt_keys(prompt, with_prefix=False)
    # one group, chained from the first passage: the prompt's first chunk reads its isolated entry (its real
    # context is the prefix alone), every later one the entry from the group's prefill
    later = [grouped.chunk_key(prompt.prefix_ids, ids, captured=True) for ids in prompt.chunk_ids[1:]]
    assert read == [grouped.chunk_key(prompt.prefix_ids, prompt.chunk_ids[0]), *later]
    reuse, default, cheap = reuse_default_cheap(grouped, references)
    assert reuse < GROUPED_REUSE_KL_BOUND, f"full reuse on grouped chunk KV: mean KL {reuse:.4f}"
    assert default < GROUPED_DEFAULT_KL_BOUND, f"default blend on grouped chunk KV: mean KL {default:.4f}"
    assert cheap < isolated_default, f"r = 0.05 on grouped KV ({cheap:.4f}) vs 0.15 isolated ({isolated_default:.4f})"
