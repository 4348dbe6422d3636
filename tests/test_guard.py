"""The fidelity guard: its risk signals, and escalation to a larger recompute budget over the same first pass."""

from __future__ import annotations

import math

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, EngineConfig, Guard, blend_rule
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.guard import agrees, escalate, first_token_signals, kl
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

CHUNKS = [random_words(s, 30) for s in (701, 702, 703)]


def engine_with(guard, model=None, tokenizer=None):
    config = EngineConfig(chunk_separator="", guard=guard, miss_policy="blend")
    return CacheBlendEngine(model or make_tiny_model("qwen2"), tokenizer or make_tiny_tokenizer(), config=config)


def prompt_of(engine):
    return engine.build_prompt(CHUNKS, prefix=random_words(1, 4), suffix=random_words(2, 6))


def test_kl_is_zero_for_equal_logits_and_positive_otherwise():
    a = torch.tensor([2.0, 0.5, -1.0])
    assert kl(a, a) == pytest.approx(0.0, abs=1e-7)
    assert kl(a, torch.tensor([0.0, 2.0, -1.0])) > 0.5


def test_signals_read_agreement_margin_and_stale_attention():
    blend = torch.tensor([3.0, 1.0, 0.0])
    attention = torch.tensor([0.1, 0.2, 0.3, 0.4])
    chunks = torch.tensor([True, True, True, False])
    recomputed = torch.tensor([False, True, False, False])
    s = first_token_signals(blend, torch.tensor([0.0, 3.0, 0.0]), attention, chunks, recomputed)
    assert s["agree_reuse"] is False and s["kl_reuse"] > 1.0
    probs = torch.softmax(blend, -1)
    assert s["margin"] == pytest.approx(float(probs[0] - probs[1]))
    reuse_probs = torch.softmax(torch.tensor([0.0, 3.0, 0.0]), -1)
    assert s["reuse_margin"] == pytest.approx(float(reuse_probs[1] - reuse_probs[0]))
    assert s["stale_attention"] == pytest.approx((0.1 + 0.3) / 0.6)
    assert agrees(blend, blend + 0.01, 0.01) and not agrees(blend, torch.tensor([0.0, 3.0, 0.0]), 10.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_kl=-1), "max_kl must be a number >= 0"),
        (dict(min_margin=1.5), r"min_margin must be a probability in \[0, 1\]"),
        (dict(min_margin=True), "min_margin must be a probability"),
        (dict(ratios=()), r"ratios must be one or more numbers in \(0, 1\]"),
        (dict(ratios=(1.0, 0.5)), "must increase"),
        (dict(ratios=(0.5, 1.5)), r"in \(0, 1\]"),
    ],
)
def test_guard_settings_are_checked(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Guard(**kwargs)


def test_a_guard_needs_the_attention_rules_first_pass():
    with pytest.raises(ConfigError, match="the guard reads the 'attention' rule's first pass"):
        EngineConfig(guard=Guard(), blend=blend_rule("paper"))


def test_every_blend_records_its_risk_signals_and_no_guard_changes_nothing():
    engine = engine_with(None)
    prompt = prompt_of(engine)
    pre = engine.prefill(prompt, "blend")
    assert set(pre.metrics.risk) == {"kl_reuse", "agree_reuse", "margin", "reuse_margin", "stale_attention"}
    assert pre.metrics.escalations == [] and math.isfinite(pre.metrics.risk["kl_reuse"])
    assert engine.prefill(prompt, "blend", blend=blend_rule("paper")).metrics.risk is None


def test_at_threshold_zero_every_request_ends_in_a_full_prefill():
    model, tokenizer = make_tiny_model("qwen2"), make_tiny_tokenizer()
    guarded = engine_with(Guard(max_kl=0.0, ratios=(0.5, 1.0)), model, tokenizer)
    prompt = prompt_of(guarded)
    full = guarded.prefill(prompt, "full").logits
    pre = guarded.prefill(prompt, "blend")
    assert pre.metrics.escalations == [0.5, 1.0] and pre.metrics.recompute_ratio == 1.0
    torch.testing.assert_close(pre.logits, full, atol=1e-4, rtol=1e-4)
    plain = engine_with(None, model, tokenizer).prefill(prompt, "blend").metrics
    assert pre.metrics.compute_share > plain.compute_share + 1.0  # the probe, the blend and two more passes


def test_a_guard_that_never_fires_leaves_the_blend_as_it_was():
    model, tokenizer = make_tiny_model("qwen2"), make_tiny_tokenizer()
    plain = engine_with(None, model, tokenizer)
    prompt = prompt_of(plain)
    expected = plain.prefill(prompt, "blend")
    guarded = engine_with(Guard(max_kl=math.inf, min_margin=0.0), model, tokenizer).prefill(prompt, "blend")
    assert guarded.metrics.escalations == [] and guarded.metrics.guard_reason is None
    torch.testing.assert_close(guarded.logits, expected.logits, atol=0, rtol=0)


def test_the_margin_trigger_escalates_near_ties_and_says_why():
    model, tokenizer = make_tiny_model("qwen2"), make_tiny_tokenizer()
    plain = engine_with(None, model, tokenizer)
    prompt = prompt_of(plain)
    margin = plain.prefill(prompt, "blend").metrics.risk["margin"]
    calm = engine_with(Guard(min_margin=margin), model, tokenizer).prefill(prompt, "blend").metrics
    assert calm.escalations == [] and calm.guard_reason is None  # not below its own margin
    tight = Guard(min_margin=min(margin + 1e-4, 1.0), ratios=(1.0,))
    m = engine_with(tight, model, tokenizer).prefill(prompt, "blend").metrics
    assert m.escalations == [1.0] and m.recompute_ratio == 1.0
    assert m.guard_reason == tight.reason(m.risk) and m.guard_reason.startswith("first-token margin")
    assert "guard: first-token margin" in m.summary() and "escalated to r=1" in m.summary()
    assert m.to_dict()["guard_reason"] == m.guard_reason


def test_guard_reasons_and_description():
    near_tie = {"margin": 0.01, "kl_reuse": 0.0}
    moved = {"margin": 0.9, "kl_reuse": 2.0}
    guard = Guard(min_margin=0.05, max_kl=1.0)
    assert guard.reason(near_tie) == "first-token margin 0.010 < 0.05"
    assert guard.reason(moved) == "first-token KL to reuse 2.000 > 1"
    assert guard.reason({"margin": 0.9, "kl_reuse": 0.5}) is None
    assert guard.describe() == "margin < 0.05 or KL to reuse > 1 -> r=1"
    assert Guard(min_margin=0.0).describe() == "never -> r=1"


def test_escalation_stops_when_two_blends_agree():
    engine = engine_with(Guard(max_kl=0.0, ratios=(0.4, 0.6, 0.8, 1.0)))
    prompt = prompt_of(engine)
    assert engine.prefill(prompt, "blend").metrics.escalations == [0.4, 0.6, 0.8, 1.0]  # KL 0 never agrees
    relaxed = engine_with(Guard(max_kl=1e9, ratios=(0.4, 0.6, 0.8, 1.0)), engine.model, engine.tokenizer)
    steps = relaxed.prefill(prompt, "blend").metrics.escalations
    assert steps in ([], [0.4], [0.4, 0.6], [0.4, 0.6, 0.8], [0.4, 0.6, 0.8, 1.0])  # stops at the first agreement


def test_escalate_climbs_the_ladder_above_the_ratio_until_two_blends_agree():
    from types import SimpleNamespace

    a, b = torch.tensor([2.0, 0.0, 0.0]), torch.tensor([0.0, 2.0, 0.0])
    firsts = {0.3: a, 0.5: b, 0.8: b, 1.0: a}  # the blend at each ratio: its first token's logits
    calls = []

    def blend_at(r):
        calls.append(r)
        return SimpleNamespace(logits=firsts[r])

    guard = Guard(ratios=(0.1, 0.3, 0.5, 0.8, 1.0))
    result, steps = escalate(guard, SimpleNamespace(logits=b), 0.15, blend_at)
    assert steps == calls == [0.3, 0.5, 0.8] and result.logits is b  # 0.8 agrees with 0.5: it stops there
    result, steps = escalate(Guard(ratios=(0.3, 1.0)), SimpleNamespace(logits=b), 0.15, blend_at)
    assert steps == [0.3, 1.0] and result.logits is a  # the ladder ends without agreement
    assert escalate(guard, SimpleNamespace(logits=b), 1.0, blend_at)[1] == []  # nothing above r = 1
