"""The "attention" rule with a shallow first pass (`BlendConfig.probe_depth` below 1): the question's attention read
on the first layers only, so that the blend costs one pass plus a few layers."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import BlendConfig, EngineConfig, Guard
from cacheblend_rag.config import blend_rule
from cacheblend_rag.engine.prefill.planning import cold_cost_share, question_mask, reuse_plan
from cacheblend_rag.errors import CacheBlendError, ConfigError
from cacheblend_rag.fusion import fuse
from cacheblend_rag.testing import random_words

pytestmark = pytest.mark.usefixtures("one_thread")


def prompt_of(engine, chunk_len: int = 24):
    chunks = [random_words(s, chunk_len) for s in (21, 22, 23)]
    return engine.build_prompt(chunks, prefix=random_words(3, 5), suffix=random_words(4, 6))


def probe(engine, prompt, layers):
    engine.prefill(prompt, "reuse")  # fills the store
    parts = [engine.store.get(k) for k in engine.prompt_keys(prompt)]
    kv = engine.chunks.prompt_kv(parts, prompt.num_tokens)
    return fuse(engine.lm, reuse_plan(prompt), kv, attention_from=question_mask(prompt), layers=layers)


def test_a_probe_over_all_layers_but_the_last_reads_the_same_attention_as_a_full_one(tiny_engine):
    # The full pass averages every layer but the last (whose output only the last token needs): a pass that stops
    # before the last layer averages the same layers.
    prompt = prompt_of(tiny_engine)
    layers = tiny_engine.lm.shape.num_layers
    full, shallow = probe(tiny_engine, prompt, None), probe(tiny_engine, prompt, layers - 1)
    torch.testing.assert_close(shallow.attention, full.attention, atol=1e-6, rtol=0)
    assert full.logits is not None and shallow.logits is None
    assert shallow.recomputed_per_layer == full.recomputed_per_layer[: layers - 1] + [0]  # the layer it does not run


def test_a_shallow_probe_writes_only_the_layers_it_runs(tiny_engine):
    prompt = prompt_of(tiny_engine)
    q = len(prompt.suffix_ids)
    full, shallow = probe(tiny_engine, prompt, None), probe(tiny_engine, prompt, 2)
    for layer in range(tiny_engine.lm.shape.num_layers):
        k_full, _ = full.kv.layer(layer)
        k_shallow, _ = shallow.kv.layer(layer)
        torch.testing.assert_close(k_shallow[:, :-q], k_full[:, :-q], atol=0, rtol=0)  # the loaded chunks: as loaded
        if layer < 2:
            torch.testing.assert_close(k_shallow[:, -q:], k_full[:, -q:], atol=1e-6, rtol=0)
        else:  # the question's KV past the probe is the blend pass's to write
            assert not torch.allclose(k_shallow[:, -q:], k_full[:, -q:])


def test_fuse_refuses_a_layer_count_the_model_does_not_have(tiny_engine):
    prompt = prompt_of(tiny_engine)
    with pytest.raises(CacheBlendError, match=r"layers must be in \[1, "):
        probe(tiny_engine, prompt, 0)


@pytest.mark.parametrize("depth", [0.25, 0.5])
def test_a_shallow_probe_keeps_the_ends_of_the_ratio_range(tiny_engine, depth):
    prompt = prompt_of(tiny_engine)
    full = tiny_engine.prefill(prompt, "full").logits
    reuse = tiny_engine.prefill(prompt, "reuse").logits
    at_one = tiny_engine.prefill(prompt, "blend", blend=BlendConfig(1.0, probe_depth=depth)).logits
    at_zero = tiny_engine.prefill(prompt, "blend", blend=BlendConfig(0.0, probe_depth=depth)).logits
    torch.testing.assert_close(at_one, full, atol=1e-4, rtol=0)
    torch.testing.assert_close(at_zero, reuse, atol=1e-4, rtol=0)


def test_a_shallow_probe_costs_its_layers_and_gives_no_risk_signals(tiny_engine):
    prompt = prompt_of(tiny_engine)
    layers = tiny_engine.lm.shape.num_layers
    deep = tiny_engine.prefill(prompt, "blend", blend=BlendConfig(0.15))
    shallow = tiny_engine.prefill(prompt, "blend", blend=BlendConfig(0.15, probe_depth=0.25))
    q = len(prompt.suffix_ids)
    spent = sum(deep.metrics.recomputed_per_layer) - sum(shallow.metrics.recomputed_per_layer)
    assert spent == q * (layers - BlendConfig(probe_depth=0.25).probe_layers(layers))  # the probe layers not run
    assert deep.metrics.risk is not None and shallow.metrics.risk is None
    share = cold_cost_share(prompt, [], BlendConfig(0.15, probe_depth=0.25), layers)
    assert share < cold_cost_share(prompt, [], BlendConfig(0.15), layers)


def test_probe_depth_is_checked_and_named():
    assert BlendConfig(probe_depth=0.25).probe_layers(24) == 6
    assert BlendConfig(probe_depth=0.01).probe_layers(24) == 1  # at least one layer
    assert BlendConfig().probe_layers(24) == 24 and BlendConfig().full_probe
    blend = blend_rule("attention:0.25", 0.15)
    assert blend.probe_depth == 0.25 and blend.name == "attention:0.25@0.15"
    assert blend_rule(blend.name.partition("@")[0], 0.15) == blend  # the name reads back
    assert blend_rule("attention:1", 0.15).name == "attention@0.15"
    with pytest.raises(ConfigError, match="probe_depth must be above 0"):
        BlendConfig(probe_depth=0.0)
    with pytest.raises(ConfigError, match=r"probe_depth must be in \[0, 1\]"):
        BlendConfig(probe_depth=1.5)
    with pytest.raises(ConfigError, match="rule 'paper' runs no first pass"):
        BlendConfig(rule="paper", probe_depth=0.5)
    with pytest.raises(ConfigError, match=r"attention:D needs a share D of the layers in \(0, 1\]"):
        blend_rule("attention:deep")


def test_the_guard_needs_the_full_first_pass():
    with pytest.raises(ConfigError, match="probe_depth is 0.25; use probe_depth=1.0 or guard=None"):
        EngineConfig(blend=BlendConfig(probe_depth=0.25), guard=Guard())


def test_calibration_needs_the_full_first_pass(tiny_tokenizer):
    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.controller import measure_fidelity
    from cacheblend_rag.testing import make_tiny_model

    config = EngineConfig(blend=BlendConfig(probe_depth=0.5))
    engine = CacheBlendEngine(make_tiny_model("llama"), tiny_tokenizer, config=config)
    with pytest.raises(ConfigError, match="probe_depth=0.5; calibrate an engine with probe_depth=1.0"):
        measure_fidelity(engine, [])
