"""One prompt's KV in one buffer (`fusion.PromptKV`): stored keys rotated once as the model rotates them, in-memory
and layer-by-layer loading alike, the decode cache over the buffers without a copy, and a layer loop that reads
nothing back from the device (counted with a dispatch mode: deterministic, no timing)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cacheblend_rag import BlendConfig, CacheBlendEngine, EngineConfig
from cacheblend_rag.engine.prefill.planning import blend_plan, question_mask, reuse_plan
from cacheblend_rag.fusion import fuse
from cacheblend_rag.models.adapter import rope_rotate, rotate_keys, signed_sin
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

# aten ops that read a device tensor back to the host (a stall on a GPU)
HOST_READS = {"nonzero", "_local_scalar_dense", "unique_consecutive", "masked_select", "unique", "_unique2", "equal",
              "is_nonzero", "nonzero_static"}  # fmt: skip


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def host_reads(self) -> int:
        return sum(v for k, v in self.ops.items() if k in HOST_READS)


def engine_with_prompt(family: str = "llama", **config):
    engine = CacheBlendEngine(make_tiny_model(family), make_tiny_tokenizer(),
                              config=EngineConfig(miss_policy="blend", chunk_separator="", **config))  # fmt: skip
    chunks = [random_words(s, 30) for s in (21, 22, 23)]
    prompt = engine.build_prompt(chunks, prefix=random_words(1, 4), suffix=random_words(2, 5))
    engine.prefill(prompt, "reuse")  # fills the store
    parts = [engine.store.get(k) for k in engine.prompt_keys(prompt)]
    return engine, prompt, parts


def test_rope_rotate_gives_the_models_rotation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 17, 16, generator=g)
    cos, sin = torch.randn(17, 16, generator=g), torch.randn(17, 16, generator=g)
    torch.testing.assert_close(rope_rotate(x, cos, signed_sin(sin)), rotate_keys(x, cos, sin), atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_buffer_holds_stored_keys_rotated_to_their_offsets_whether_whole_or_layer_by_layer(family):
    engine, prompt, parts = engine_with_prompt(family)
    n, stored = prompt.num_tokens, sum(p.num_tokens for p in parts)
    whole = engine.chunks.prompt_kv(parts, n, keep_raw=True)
    layerwise = engine.chunks.prompt_kv(parts, n, keep_raw=True, load=engine.chunks.layer_loader(parts))
    cos, sin = engine.lm.rope(torch.arange(n))
    for layer_idx in range(engine.lm.shape.num_layers):
        raw = torch.cat([p.keys[layer_idx] for p in parts], dim=1)
        values = torch.cat([p.values[layer_idx] for p in parts], dim=1)
        for kv in (whole, layerwise):
            k, v = kv.layer(layer_idx)
            assert k.shape == (engine.lm.shape.num_kv_heads, n, engine.lm.shape.head_dim)
            torch.testing.assert_close(k[:, :stored], rotate_keys(raw, cos[:stored], sin[:stored]), atol=1e-6,
                                       rtol=0)  # fmt: skip
            assert torch.equal(v[:, :stored], values) and torch.equal(kv.raw_keys[layer_idx][:, :stored], raw)
            assert not k[:, stored:].any() and not v[:, stored:].any()  # the question's tokens: not written yet


def test_writing_into_the_buffer_leaves_the_stored_entry_alone():
    engine, prompt, parts = engine_with_prompt()
    before = [p.values.clone() for p in parts]
    kv = engine.chunks.prompt_kv(parts[:1], parts[0].num_tokens + 3)
    kv.layer(0)[1].fill_(7.0)
    single = engine.chunks.prompt_kv(parts[:1], parts[0].num_tokens)  # one part filling the whole buffer
    single.layer(0)[1].fill_(7.0)
    assert all(torch.equal(p.values, b) for p, b in zip(parts, before, strict=True))


def test_layers_are_first_read_in_order():
    engine, prompt, parts = engine_with_prompt()
    kv = engine.chunks.prompt_kv(parts, prompt.num_tokens, load=engine.chunks.layer_loader(parts))
    with pytest.raises(Exception, match="in order"):
        kv.layer(1)
    kv.layer(0)
    assert kv.copy().layer(1)[0].shape == kv.layer(1)[0].shape  # a copy reads every layer first


def test_the_decode_cache_is_the_prefills_buffer():
    engine, prompt, _ = engine_with_prompt()
    pre = engine.prefill(prompt, "blend", recompute_ratio=0.2)
    assert pre.model_cache is None  # made only when asked for: the engine's decoding reads the buffers themselves
    layers = pre.cache.layers
    assert pre.cache is pre.cache  # made once
    assert layers[0].keys.untyped_storage().data_ptr() == pre.kv.key_buffer.untyped_storage().data_ptr()
    base = layers[0].keys.untyped_storage().data_ptr()
    assert all(layer.keys.untyped_storage().data_ptr() == base for layer in layers)  # one buffer, every layer
    assert layers[0].keys.shape == (1, engine.lm.shape.num_kv_heads, prompt.num_tokens, engine.lm.shape.head_dim)
    assert pre.cache.get_seq_length() == prompt.num_tokens


@pytest.mark.parametrize("rule", ["attention", "paper"])
def test_the_layer_loop_reads_nothing_back_from_the_device(rule):
    # The GPU's path (one attention call per layer, block_size=0): every index, count and mask is worked out on
    # the host from the plan before the loop; the attention rule's choice and the check layers' top-k stay on
    # the device. No aten op that reads a tensor back may run: neither in the reuse pass nor in the blend.
    engine, prompt, parts = engine_with_prompt()
    n = prompt.num_tokens
    blend = BlendConfig(rule=rule, recompute_ratio=0.15)
    with CountOps() as counted:
        kv = engine.chunks.prompt_kv(parts, n)
        if rule == "attention":
            probe = fuse(engine.lm, reuse_plan(prompt), kv, block_size=0, attention_from=question_mask(prompt))
            plan = blend_plan(prompt, blend, probe.attention)
        else:
            plan = blend_plan(prompt, blend)
        result = fuse(engine.lm, plan, kv, block_size=0)
    assert counted.host_reads == 0, counted.ops
    chunk_picks = plan.keep_counts[-1] if rule == "paper" else plan.chosen.numel()
    assert result.selected_positions.numel() == len(prompt.suffix_ids) + chunk_picks


def test_the_one_buffer_path_equals_the_cpu_path_of_position_blocks():
    engine, prompt, parts = engine_with_prompt()
    n = prompt.num_tokens
    plan = blend_plan(prompt, BlendConfig(rule="paper", recompute_ratio=0.3))
    one_call = fuse(engine.lm, plan, engine.chunks.prompt_kv(parts, n), block_size=0)
    blocks = fuse(engine.lm, plan, engine.chunks.prompt_kv(parts, n, load=engine.chunks.layer_loader(parts)),
                  block_size=8)  # fmt: skip
    assert torch.equal(one_call.selected_positions, blocks.selected_positions)
    torch.testing.assert_close(one_call.logits, blocks.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(one_call.kv.keys, blocks.kv.keys, atol=1e-5, rtol=0)
    torch.testing.assert_close(one_call.kv.values, blocks.kv.values, atol=1e-5, rtol=0)


def test_the_default_rule_costs_at_most_one_and_a_half_full_prefills_in_operations():
    # On a GPU each aten op is about one kernel launch: the default rule's two passes (the question over full KV
    # reuse, then the blend) must together issue at most 1.5x the ops of the model's own full prefill of the
    # prompt, with no host read (the GPU's path, block_size=0; counted, so deterministic).
    engine, prompt, parts = engine_with_prompt()
    n = prompt.num_tokens
    with CountOps() as full, torch.inference_mode():
        engine.model(input_ids=prompt.input_ids()[None], logits_to_keep=1)
    with CountOps() as blend:
        kv = engine.chunks.prompt_kv(parts, n)
        probe = fuse(engine.lm, reuse_plan(prompt), kv, block_size=0, attention_from=question_mask(prompt))
        fuse(engine.lm, blend_plan(prompt, BlendConfig(), probe.attention), kv, block_size=0)
    assert blend.host_reads == 0, blend.ops
    ratio = sum(blend.ops.values()) / sum(full.ops.values())
    assert ratio <= 1.5, (ratio, blend.ops, full.ops)
