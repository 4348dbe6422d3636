"""Selection rules (which chunk tokens a blend recomputes): every named rule keeps the exactness of the ratio's
ends, the plans spend the budget as the rule says, and the question-attention probe measures what the model's
own attention gives."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.config import RULE_NAMES, blend_rule
from cacheblend_rag.engine.prefill.planning import blend_plan, reuse_plan
from cacheblend_rag.engine.request.prompt import TokenizedPrompt
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.fusion import anchor_counts, budget, fuse
from cacheblend_rag.testing import make_tiny_model, random_words

pytestmark = pytest.mark.usefixtures("one_thread")


def three_chunk_prompt(engine, chunk_len: int = 24):
    chunks = [random_words(s, chunk_len) for s in (11, 12, 13)]
    return engine.build_prompt(chunks, prefix=random_words(1, 5), suffix=random_words(2, 6))


def eager_engine(family, tokenizer):
    """A tiny model with eager attention (transformers then returns its attention weights) and its engine."""
    model = make_tiny_model(family)
    model.set_attn_implementation("eager")
    return model, CacheBlendEngine(model, tokenizer, config=EngineConfig(miss_policy="blend", chunk_separator=""))


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
    assert anchor_counts([10, 20, 30], 0.1) == (1, 2, 3)
    assert sum(anchor_counts([3] * 10, 0.1)) <= budget(30, 0.1)  # rounding up cannot overspend
    assert anchor_counts([10, 20], 0.0) == (0, 0)


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
    assert plan.chosen is not None and plan.chosen.tolist() == [5, 20, 40]  # recomputed besides the question
    with pytest.raises(ConfigError, match="one score per prompt token"):
        blend_plan(prompt, blend_rule("attention", 0.05))


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


def test_attention_probe_equals_the_models_own_attention_weights(family, tiny_tokenizer):
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
    probe = fuse(engine.lm, reuse_plan(prompt), engine.chunks.prompt_kv(parts, n, load=load), want_logits=False,
                 attention_from=question)  # fmt: skip
    layers = engine.lm.shape.num_layers
    assert probe.recomputed_per_layer == [q] * layers

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
            cache=cache,
            output_attentions=True,
        )
    # The probe averages every layer but the last (nothing reads that layer's output).
    expected = torch.stack([a[0].float().mean(dim=(0, 1)) for a in out.attentions[: layers - 1]]).mean(0)  # [N]
    torch.testing.assert_close(probe.attention, expected, atol=1e-5, rtol=1e-4)


def test_rule_names_round_trip_and_unknown_names_are_refused():
    for name in RULE_NAMES:
        blend = blend_rule(name, 0.07)
        assert blend.rule == name and blend.name == f"{name}@0.07"
    assert RULE_NAMES == ("attention", "paper", "gradual", "epic")
    with pytest.raises(ConfigError, match="unknown blend rule 'nope'; choose one of attention, paper"):
        blend_rule("nope")


def test_each_rule_says_what_it_checks():
    assert blend_rule("paper").check_layers == (1,) and blend_rule("paper").deviation == "value"
    assert blend_rule("gradual").check_layers == (1, 2, 3) and blend_rule("gradual").deviation == "key"
    assert blend_rule("attention").uses_attention_pass and not blend_rule("attention").uses_check_layers
    assert blend_rule("epic").check_layers == () and not blend_rule("epic").uses_attention_pass


def test_with_ratio_keeps_the_rule():
    blend = blend_rule("epic", 0.15).with_ratio(0.05)
    assert blend.rule == "epic" and blend.recompute_ratio == 0.05
