"""Selection rules (which chunk tokens a blend recomputes): every named rule keeps the exactness of the ratio's
ends, the plans spend the budget as the rule says, and the question-attention probe measures what the model's
own attention gives."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cacheblend_rag import BlendConfig, CacheBlendEngine, EngineConfig
from cacheblend_rag.config import RULE_NAMES, blend_rule, rule_name
from cacheblend_rag.engine.planning import anchor_mask, blend_plan, reuse_plan
from cacheblend_rag.engine.prompt import TokenizedPrompt
from cacheblend_rag.errors import CacheBlendError, ConfigError
from cacheblend_rag.fusion import anchor_counts, budget, chunk_quotas, fuse
from cacheblend_rag.testing import make_tiny_model, random_words

pytestmark = pytest.mark.usefixtures("one_thread")


def three_chunk_prompt(engine, chunk_len: int = 24):
    chunks = [random_words(s, chunk_len) for s in (11, 12, 13)]
    return engine.build_prompt(chunks, prefix=random_words(1, 5), suffix=random_words(2, 6))


def eager_engine(family, tokenizer):
    """A tiny model with eager attention (transformers then returns its attention weights) and its engine."""
    model = make_tiny_model(family)
    model.set_attn_implementation("eager")
    return model, CacheBlendEngine(model, tokenizer, config=EngineConfig(chunk_separator=""))


def toy_prompt(lengths=(10, 20, 30), prefix=4, suffix=3) -> TokenizedPrompt:
    chunks = tuple(tuple(range(100 + 50 * i, 100 + 50 * i + n)) for i, n in enumerate(lengths))
    return TokenizedPrompt(tuple(range(1, prefix + 1)), chunks, tuple(range(90, 90 + suffix)))


# -- the ends of the ratio range, for every rule ---------------------------------------------------------------


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_every_rule_at_ratio_one_equals_full_prefill(tiny_engine, rule):
    prompt = three_chunk_prompt(tiny_engine)
    full = tiny_engine.prefill(prompt, "full").logits
    blend = tiny_engine.prefill(prompt, "blend", blend=blend_rule(rule, 1.0)).logits
    torch.testing.assert_close(blend, full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_every_rule_at_ratio_zero_equals_full_reuse(tiny_engine, rule):
    prompt = three_chunk_prompt(tiny_engine)
    reuse = tiny_engine.prefill(prompt, "reuse").logits
    blend = tiny_engine.prefill(prompt, "blend", blend=blend_rule(rule, 0.0)).logits
    torch.testing.assert_close(blend, reuse, atol=1e-4, rtol=0)


# -- how plans spend the budget --------------------------------------------------------------------------------


def test_budget_and_anchor_counts_round_up_and_never_exceed_the_budget():
    assert budget(60, 0.05) == 3 and budget(60, 0.0) == 0 and budget(60, 1.0) == 60
    assert anchor_counts([10, 20, 30], 0.1, 1.0) == (1, 2, 3)
    assert anchor_counts([10, 20, 30], 0.1, 0.5) == (1, 1, 2)  # 0.5, 1, 1.5 rounded up: within 6
    assert sum(anchor_counts([3] * 10, 0.1, 1.0)) <= budget(30, 0.1)  # rounding up cannot overspend
    assert anchor_counts([10, 20], 0.5, 0.0) == (0, 0)


def test_epic_plan_recomputes_exactly_the_chunk_starts():
    prompt = toy_prompt()
    plan = blend_plan(prompt, blend_rule("epic", 0.1))
    computed = ~plan.exact & ~plan.reused
    spans = prompt.chunk_spans
    expected = torch.zeros(prompt.num_tokens, dtype=torch.bool)
    for (start, _), k in zip(spans, (1, 2, 3), strict=True):
        expected[start : start + k] = True
    expected[-3:] = True  # the question
    assert torch.equal(computed, expected)
    assert plan.check_layers == () and not plan.reused.any()


def test_hybrid_plan_gives_the_check_layer_only_what_the_anchors_left():
    prompt = toy_prompt()
    blend = blend_rule("hybrid", 0.2)  # budget 12 of 60: anchors 1 + 2 + 3, deviation picks 6
    plan = blend_plan(prompt, blend)
    anchors = anchor_mask(prompt, blend)
    assert int(anchors.sum()) == 6 and plan.keep_counts == (6,) and plan.check_layers == (1,)
    assert not (plan.reused & anchors).any() and not (plan.exact & anchors).any()
    assert int(plan.reused.sum()) == 60 - 6


def test_deviation_plan_keeps_the_gradual_schedule():
    plan = blend_plan(toy_prompt(), blend_rule("gradual", 0.1))
    assert plan.check_layers == (1, 2, 3) and plan.keep_counts == (9, 8, 6)
    assert plan.deviation == "key" and blend_plan(toy_prompt(), blend_rule("paper", 0.1)).deviation == "value"


def test_attention_plan_takes_the_highest_scored_tokens_outside_the_anchors():
    prompt = toy_prompt()
    scores = torch.zeros(prompt.num_tokens)
    hot = [5, 20, 40, 60]  # chunk tokens (4..63), token 5 is no chunk start
    scores[hot] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    scores[0] = 100.0  # a prefix token: never a candidate
    plan = blend_plan(prompt, blend_rule("attention", 0.05), scores)  # budget 3
    chosen = ~plan.exact & ~plan.reused
    assert chosen[:64].nonzero().squeeze(1).tolist() == [5, 20, 40]
    with pytest.raises(ConfigError, match="one score per prompt token"):
        blend_plan(prompt, blend_rule("attention", 0.05))


def test_chunk_quotas_split_by_size_and_add_up():
    assert chunk_quotas([10, 20, 30], 6) == (1, 2, 3)
    assert chunk_quotas([10, 20, 30], 7) == (1, 2, 4)  # 1.17, 2.33, 3.5: the largest remainder gets the spare
    assert chunk_quotas([1, 1, 1], 2) == (1, 1, 0)  # ties: earlier chunks first
    assert chunk_quotas([5, 0, 5], 20) == (5, 0, 5)  # never more than a chunk holds
    assert chunk_quotas([3, 4], 0) == (0, 0) and chunk_quotas([], 0) == ()
    for sizes, count in (([7, 1, 300, 41], 33), ([2, 2, 2, 2, 2], 9), ([100], 17)):
        q = chunk_quotas(sizes, count)
        assert sum(q) == count and all(0 <= a <= n for a, n in zip(q, sizes, strict=True))
    with pytest.raises(ConfigError, match=">= 0"):
        chunk_quotas([3], -1)


def test_per_chunk_attention_ranks_each_chunk_on_its_own():
    prompt = toy_prompt()  # chunks at 4..13, 14..33, 34..63
    scores = torch.zeros(prompt.num_tokens)
    scores[34:64] = torch.arange(30, 60, dtype=torch.float32)  # the last chunk outscores every other token
    scores[[6, 20, 25]] = torch.tensor([0.5, 0.2, 0.3])
    blend = blend_rule("attention-quota", 0.1)  # budget 6: quotas 1, 2, 3
    chosen = ~blend_plan(prompt, blend, scores).exact
    assert chosen[:64].nonzero().squeeze(1).tolist() == [6, 20, 25, 61, 62, 63]
    plain = ~blend_plan(prompt, blend_rule("attention", 0.1), scores).exact
    assert plain[:64].nonzero().squeeze(1).tolist() == [58, 59, 60, 61, 62, 63]  # recency takes it all


def test_reuse_plan_loads_the_prefix_and_the_named_chunks():
    prompt = toy_prompt()
    assert int(reuse_plan(prompt).exact.sum()) == 64
    assert int(reuse_plan(prompt, 1).exact.sum()) == 14  # prefix caching: prefix + first chunk
    with pytest.raises(ConfigError, match="loaded_chunks"):
        reuse_plan(prompt, 4)


# -- honest cost ---------------------------------------------------------------------------------------------


def test_compute_share_counts_check_layers_and_the_attention_probe(tiny_engine):
    prompt = three_chunk_prompt(tiny_engine)
    share = {
        rule: tiny_engine.prefill(prompt, "blend", blend=blend_rule(rule, 0.1)).metrics.compute_share
        for rule in ("paper", "gradual", "epic", "attention")
    }
    reuse = tiny_engine.prefill(prompt, "reuse").metrics.compute_share
    # Static rules skip the check layers' full recompute; gradual filtering pays for three of them.
    assert share["epic"] < share["paper"] < share["gradual"]
    # The probe computes the question once more on every layer: exactly reuse's cost on top of the static plan.
    assert share["attention"] == pytest.approx(share["epic"] + reuse, abs=1e-9)


# -- the question-attention probe against the model's own attention ---------------------------------------------


@pytest.mark.parametrize("depth", [None, 2])
def test_attention_probe_equals_the_models_own_attention_weights(family, tiny_tokenizer, depth):
    from transformers import DynamicCache

    from cacheblend_rag.models import rotate_keys

    model, engine = eager_engine(family, tiny_tokenizer)
    prompt = three_chunk_prompt(engine)
    engine.prefill(prompt, "reuse")  # fills the store
    parts = [engine.store.get(k) for k in engine.prompt_keys(prompt)]
    n, q = prompt.num_tokens, len(prompt.suffix_ids)

    def load(layer_idx):  # the stored KV, then zeros for the question: [Hkv, N, D] each
        k = torch.cat([p.keys[layer_idx] for p in parts], 1)
        v = torch.cat([p.values[layer_idx] for p in parts], 1)
        pad = torch.zeros(k.shape[0], q, k.shape[2])
        return torch.cat([k, pad], 1), torch.cat([v, pad], 1)

    question = torch.zeros(n, dtype=torch.bool)
    question[-q:] = True
    probe = fuse(engine.lm, reuse_plan(prompt), load, want_logits=False, attention_from=question, compute_layers=depth)
    layers = engine.lm.shape.num_layers
    computed = layers if depth is None else depth
    assert probe.recomputed_per_layer == [q] * computed + [0] * (layers - computed)

    # Independent: transformers' eager attention over a cache of the stored KV rotated to its offsets.
    cached = n - q
    cos, sin = engine.lm.rope(torch.arange(cached))
    cache = DynamicCache(config=model.config)
    for layer_idx in range(engine.lm.shape.num_layers):
        k, v = load(layer_idx)
        cache.update(rotate_keys(k[:, :cached], cos, sin)[None], v[None, :, :cached], layer_idx)
    with torch.no_grad():
        out = model(
            input_ids=prompt.input_ids()[cached:][None],
            position_ids=torch.arange(cached, n)[None],
            past_key_values=cache,
            output_attentions=True,
        )
    # The probe averages every computed layer but its last (nothing reads that layer's output).
    expected = torch.stack([a[0].float().mean(dim=(0, 1)) for a in out.attentions[: computed - 1]]).mean(0)  # [N]
    torch.testing.assert_close(probe.attention, expected, atol=1e-5, rtol=1e-4)
    for layer_idx in range(computed, layers):  # past a shallow probe: the loaded KV, untouched
        k, v = load(layer_idx)
        torch.testing.assert_close(probe.values[layer_idx], v, atol=0, rtol=0)
        cos_all, sin_all = engine.lm.rope(torch.arange(n))
        torch.testing.assert_close(probe.keys[layer_idx], rotate_keys(k, cos_all, sin_all), atol=0, rtol=0)


def test_a_shallow_probe_costs_its_share_of_the_layers(tiny_engine):
    prompt = three_chunk_prompt(tiny_engine)
    layers = tiny_engine.lm.shape.num_layers
    reuse = tiny_engine.prefill(prompt, "reuse").metrics.compute_share
    deep = blend_rule("attention", 0.1)
    shallow = dataclasses.replace(deep, probe_depth=0.5)
    assert shallow.probe_layers(layers) == max(2, math.ceil(layers / 2)) and deep.probe_layers(layers) == layers
    assert BlendConfig(probe_depth=0.01).probe_layers(layers) == 2  # the probe reads attention below its last layer
    share = {
        c.probe_depth: tiny_engine.prefill(prompt, "blend", blend=c).metrics.compute_share for c in (deep, shallow)
    }
    assert share[1.0] - share[0.5] == pytest.approx(reuse * (1 - shallow.probe_layers(layers) / layers), abs=1e-9)


def test_fuse_refuses_a_shallow_pass_that_must_give_logits(tiny_engine):
    prompt = three_chunk_prompt(tiny_engine)
    with pytest.raises(CacheBlendError, match="compute_layers"):
        fuse(tiny_engine.lm, reuse_plan(prompt), lambda i: None, compute_layers=2)


# -- scores given by the caller in place of the attention pass ----------------------------------------------------


def test_given_token_scores_choose_the_recomputed_tokens_and_skip_the_probe(tiny_engine):
    prompt = three_chunk_prompt(tiny_engine)  # 3 chunks of 24 tokens
    (s1, e1), _, (s3, e3) = prompt.chunk_spans
    blend = blend_rule("attention", 24 / 72)  # a budget of exactly one chunk
    first, last = torch.zeros(prompt.num_tokens), torch.zeros(prompt.num_tokens)
    first[s1:e1], last[s3:e3] = 1.0, 1.0
    reuse = tiny_engine.prefill(prompt, "reuse")
    on_first = tiny_engine.prefill(prompt, "blend", blend=blend, token_scores=first)
    on_last = tiny_engine.prefill(prompt, "blend", blend=blend, token_scores=last)
    # The first chunk was precomputed right after the prefix, so its cached KV is exact: recomputing it changes
    # nothing. Recomputing the last chunk lets it see the other two.
    torch.testing.assert_close(on_first.logits, reuse.logits, atol=1e-4, rtol=0)
    assert (on_last.logits - reuse.logits).abs().max() > 1e-3
    assert on_first.metrics.recomputed_tokens == on_last.metrics.recomputed_tokens == 24 + len(prompt.suffix_ids)
    # No probe: the cost is the attention rule's less the question-only pass (full reuse's cost).
    probed = tiny_engine.prefill(prompt, "blend", blend=blend).metrics.compute_share
    assert on_last.metrics.compute_share == pytest.approx(probed - reuse.metrics.compute_share, abs=1e-9)


def test_given_layer_one_value_deviation_reproduces_the_paper_rule(tiny_engine):
    # The paper's rule ranks chunk tokens by how far their layer-1 values move when recomputed in context, which
    # is full prefill's layer-1 values against the cached ones. Given as scores, that ranking picks the same
    # tokens, and the blend is the same (the check layer's extra work changes only the cost).
    prompt = three_chunk_prompt(tiny_engine)
    full = tiny_engine.prefill(prompt, "full").cache.layers[1].values[0]
    cached = tiny_engine.prefill(prompt, "reuse").cache.layers[1].values[0]
    deviation = (full - cached).float().pow(2).sum(dim=(0, 2))
    paper = tiny_engine.prefill(prompt, "blend", blend=blend_rule("paper", 0.1))
    given = tiny_engine.prefill(prompt, "blend", blend=blend_rule("attention", 0.1), token_scores=deviation)
    torch.testing.assert_close(given.logits, paper.logits, atol=1e-4, rtol=0)
    assert given.metrics.recomputed_tokens == paper.metrics.recomputed_tokens
    assert given.metrics.compute_share < paper.metrics.compute_share


def test_weighted_deviation_ranks_by_the_questions_attention_times_the_value_error(family, tiny_tokenizer):
    model, engine = eager_engine(family, tiny_tokenizer)
    prompt = three_chunk_prompt(engine)
    q = len(prompt.suffix_ids)
    # Independent: on check layer 1 every chunk token is fresh, so the question's attention there is a full
    # prefill's (transformers' eager weights), and the value error is full prefill's against the cached values.
    with torch.no_grad():
        out = model(input_ids=prompt.input_ids()[None], output_attentions=True, use_cache=True)
    attention = out.attentions[1][0, :, -q:].float().mean(dim=(0, 1))  # [N]
    cached = engine.prefill(prompt, "reuse").cache.layers[1].values[0]
    error = (out.past_key_values.layers[1].values[0] - cached).float().pow(2).sum(dim=(0, 2)).sqrt()
    rule = blend_rule("weighted-deviation", 0.1)
    weighted = engine.prefill(prompt, "blend", blend=rule)
    given = engine.prefill(prompt, "blend", blend=blend_rule("attention", 0.1), token_scores=attention * error)
    torch.testing.assert_close(weighted.logits, given.logits, atol=1e-4, rtol=0)
    # and it is not the unweighted rule's choice
    plain = engine.prefill(prompt, "blend", blend=dataclasses.replace(rule, selection="deviation"))
    assert (plain.logits - weighted.logits).abs().max() > 1e-4


@pytest.mark.parametrize(
    "mode, rule, scores, match",
    [
        ("reuse", "attention", "ok", "mode 'reuse' recomputes none"),
        ("blend", "paper", "ok", "selection 'deviation' does not have"),
        ("blend", "attention", "short", r"shape \(\d+,\), one per token, got \(3,\)"),
        ("blend", "attention", "list", "got list"),
        ("blend", "attention", "nan", "must be finite"),
    ],
)
def test_given_token_scores_are_refused_where_they_cannot_rank(tiny_engine, mode, rule, scores, match):
    prompt = three_chunk_prompt(tiny_engine)
    given = {
        "ok": torch.ones(prompt.num_tokens),
        "short": torch.ones(3),
        "list": [1.0] * prompt.num_tokens,
        "nan": torch.full((prompt.num_tokens,), float("nan")),
    }[scores]
    blend = blend_rule(rule, 0.1) if mode == "blend" else None
    with pytest.raises(ConfigError, match=match):
        tiny_engine.prefill(prompt, mode, blend=blend, token_scores=given)


# -- settings ------------------------------------------------------------------------------------------------


def test_rule_names_round_trip_and_unknown_names_are_refused():
    for name in RULE_NAMES:
        assert rule_name(blend_rule(name, 0.07)) == name
    assert rule_name(BlendConfig(check_layers=(2,), deviation="both")) is None
    with pytest.raises(ConfigError, match="unknown blend rule 'nope'; choose one of paper"):
        blend_rule("nope")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"selection": "random"}, "selection must be one of"),
        ({"selection": "none"}, "anchor_share must be 1.0"),
        ({"anchor_share": 1.5}, r"anchor_share must be in \[0, 1\]"),
        ({"recompute_ratio": True}, r"recompute_ratio must be in \[0, 1\], got True"),
        ({"check_layers": (True,)}, "check_layers must be layer indices"),
        ({"probe_depth": 0.0}, "probe_depth must be above 0"),
        ({"selection": "deviation", "per_chunk": True}, "per_chunk applies to the attention rankings"),
        ({"selection": "attention", "per_chunk": 1}, "per_chunk must be True or False"),
        ({"probe_depth": 1.5}, r"probe_depth must be in \[0, 1\]"),
    ],
)
def test_rule_settings_are_validated(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        BlendConfig(**kwargs)


def test_with_ratio_keeps_the_rule():
    blend = blend_rule("attention-anchors", 0.15).with_ratio(0.05)
    assert rule_name(blend) == "attention-anchors" and blend.recompute_ratio == 0.05
