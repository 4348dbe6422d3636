"""Decode steps over one slot pool, attention batched across requests, give each request's own logits.

Against `BatchDecoder.step` over each request's own `DecodeCache` (itself tested against the model's forward):
batch sizes 1 to 8, mixed prompt lengths, requests joining and leaving between steps (so the batch's slots have
gaps), and the pool growing in slots and positions while it holds requests. Logits to 1e-4 on tiny fp32 models.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache

from cacheblend_rag.engine.serving.batch_decode import BatchDecoder, DecodeCache
from cacheblend_rag.engine.serving.slots import SlotPool
from cacheblend_rag.models.adapter import LayerwiseModel
from cacheblend_rag.testing import make_tiny_model


def prefilled(model, length: int, seed: int, room: int):
    """A prompt of random tokens prefilled by the model itself: its cache as a DecodeCache, its stacked KV, and
    the greedy first token."""
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(ids, cache=cache, use_cache=True)
    keys = torch.stack([layer.keys[0] for layer in cache.layers])  # [L, Hkv, N, D]
    values = torch.stack([layer.values[0] for layer in cache.layers])
    return DecodeCache(cache, length, length + room), keys, values, int(out.logits[0, -1].argmax())


@pytest.fixture(params=["llama", "qwen2"])
def lm(request):
    return LayerwiseModel(make_tiny_model(request.param).eval())


@pytest.mark.parametrize("batch", [1, 2, 3, 8])
def test_a_batched_step_over_slots_gives_each_requests_own_logits(lm, batch):
    decoder = BatchDecoder(lm)
    pool = SlotPool(lm.shape, torch.float32, "cpu", slots=2, capacity=16)  # grows as they come
    lengths = [5 + 7 * i for i in range(batch)]
    own, slots, tokens = [], [], []
    for i, n in enumerate(lengths):
        cache, keys, values, token = prefilled(lm.model, n, seed=i, room=6)
        own.append(cache)
        slots.append(pool.admit(keys, values, n, room=6))
        tokens.append(token)
    for _ in range(5):
        want = decoder.step(tokens, own)
        got = decoder.step_slots(tokens, pool, slots)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        tokens = [int(t) for t in want.argmax(-1)]
    assert pool.lengths[slots[0]] == lengths[0] + 5


def test_requests_join_and_leave_between_steps(lm):
    decoder = BatchDecoder(lm)
    pool = SlotPool(lm.shape, torch.float32, "cpu", slots=1, capacity=8)
    rng = random.Random(0)
    live: dict[int, tuple[DecodeCache, int, int]] = {}  # request -> (own cache, slot, next token)
    for step in range(14):
        if step % 3 == 0 or not live:  # one joins, with a prompt of its own length
            n = rng.randint(3, 30)
            cache, keys, values, token = prefilled(lm.model, n, seed=100 + step, room=12)
            live[step] = (cache, pool.admit(keys, values, n, room=12), token)
        if step % 4 == 3 and len(live) > 1:  # the oldest leaves: its slot is a gap until the next joins
            _, slot, _ = live.pop(min(live))
            pool.release(slot)
        order = sorted(live)
        tokens = [live[r][2] for r in order]
        want = decoder.step(tokens, [live[r][0] for r in order])
        got = decoder.step_slots(tokens, pool, [live[r][1] for r in order])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        for row, r in enumerate(order):
            live[r] = (live[r][0], live[r][1], int(want[row].argmax()))
    assert pool.slots >= 2 and pool.capacity >= 30


def test_a_step_is_masked_only_where_some_request_sees_fewer_positions(lm):
    """Requests of one length in slots 0..hi-1 see every position: no mask; else one additive mask for all layers
    (0 where a slot sees a position, -inf elsewhere); both give each request's own logits."""
    decoder = BatchDecoder(lm)
    pool = SlotPool(lm.shape, torch.float32, "cpu", slots=3, capacity=32)
    own, slots, tokens = [], [], []
    for seed, n in enumerate([9, 9, 4]):
        cache, keys, values, token = prefilled(lm.model, n, seed=seed, room=4)
        own.append(cache)
        slots.append(pool.admit(keys, values, n, room=4))
        tokens.append(token)
    assert pool.step_plan(slots[:2]).mask is None
    assert pool.step_plan(slots[:1]).mask is None
    mask = pool.step_plan(slots).mask
    assert mask is not None and mask.dtype == torch.float32 and mask.shape == (3, 1, 1, 10)
    assert torch.equal(mask[2, 0, 0] == 0, torch.arange(10) < 5) and torch.equal(mask[:2], torch.zeros(2, 1, 1, 10))
    gap = pool.step_plan([slots[1]]).mask  # slot 0 is not in this step: a gap before it
    assert gap is not None and torch.isinf(gap[0]).all() and torch.equal(gap[1], torch.zeros(1, 1, 10))
    for batch in (slice(0, 2), slice(0, 3)):
        got = decoder.step_slots(tokens[batch], pool, slots[batch])
        want = decoder.step(tokens[batch], own[batch])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)  # the second: the first two one position on


def test_a_slot_must_hold_a_request_and_room_to_write():
    lm = LayerwiseModel(make_tiny_model("llama").eval())
    pool = SlotPool(lm.shape, torch.float32, torch.device("cpu"), slots=2, capacity=8)
    _, keys, values, _ = prefilled(lm.model, 4, seed=0, room=0)
    slot = pool.admit(keys, values, 4, room=0)
    with pytest.raises(ValueError, match="holds no request"):
        pool.step_plan([1])
    pool.release(slot)
    with pytest.raises(ValueError, match="free already"):
        pool.release(slot)
    slot = pool.admit(keys, values, 4, room=4)
    pool.lengths[slot] = pool.capacity
    with pytest.raises(RuntimeError, match="full"):
        pool.step_plan([slot])


def test_a_fixed_shape_step_gives_the_slot_steps_logits(lm):
    # what a CUDA graph replays, run eagerly: padded to its bucket into the scratch slot, attending over every slot
    # and position of the pool; each request's logits as `step_slots` gives them, and the pool left the same
    from cacheblend_rag.engine.serving.graphs import StaticStep, bucket_for

    decoder = BatchDecoder(lm)
    pools = [SlotPool(lm.shape, torch.float32, "cpu", slots=6, capacity=64) for _ in range(2)]
    slots, tokens = [], []
    for i, n in enumerate([7, 19, 4, 30, 11]):
        _, keys, values, token = prefilled(lm.model, n, seed=i, room=8)
        slots.append([pool.admit(keys, values, n, room=8) for pool in pools][0])
        tokens.append(token)
    for pool in pools:
        pool.release(slots[1])  # a gap
    live = [s for s in slots if s != slots[1]]
    tokens = [t for s, t in zip(slots, tokens, strict=True) if s != slots[1]]
    statics = {}
    for _ in range(4):
        size = bucket_for(len(live))
        static = statics.setdefault(size, StaticStep(lm, pools[1], size))
        static.load(tokens, live)
        got = static.run()[: len(live)]
        pools[1].advance(live)
        want = decoder.step_slots(tokens, pools[0], live)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        tokens = want.argmax(-1).tolist()
    for s in live:
        n = pools[0].lengths[s]
        assert pools[1].lengths[s] == n
        torch.testing.assert_close(pools[1].keys[:, s, :, :n], pools[0].keys[:, s, :, :n], atol=1e-5, rtol=0)
    assert pools[1].scratch not in live and pools[1].scratch is not None
    with pytest.raises(ValueError, match="holds no request"):
        static.load([1], [pools[1].scratch])


def test_buckets():
    from cacheblend_rag.engine.serving.graphs import bucket_for

    assert [bucket_for(b) for b in (1, 2, 3, 5, 8, 9, 32)] == [1, 2, 4, 8, 8, 16, 32]
    with pytest.raises(ValueError, match="largest bucket"):
        bucket_for(33)


def test_decode_graphs_need_cuda_and_native_weights():
    from cacheblend_rag import EngineConfig, ServingConfig
    from cacheblend_rag.errors import ConfigError

    assert EngineConfig().serving.decode_graphs is False
    with pytest.raises(ConfigError, match="needs device='cuda'"):
        EngineConfig(serving=ServingConfig(decode_graphs=True))
    with pytest.raises(ConfigError, match="True or False"):
        ServingConfig(decode_graphs="yes")
    with pytest.raises(ConfigError, match="decode_weights='native'"):
        ServingConfig(decode_graphs=True, decode_weights="int8")
    with pytest.raises(
        ConfigError, match=r"moved to ServingConfig: EngineConfig\(serving=ServingConfig\(decode_graphs="
    ):
        EngineConfig(decode_graphs=True)  # the settings that moved are refused with the way to give them


def test_memory_the_pool_never_wrote_cannot_reach_a_request(lm, monkeypatch):
    # the pool's memory is left uninitialised until a slot is given out: make every new tensor NaN (what fresh
    # memory may hold), and every request, admitted, grown into and re-admitted after another left, still gets its
    # own logits
    empty = torch.empty

    def nan_empty(*size, **kwargs):
        out = empty(*size, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    decoder = BatchDecoder(lm)
    prompts = [prefilled(lm.model, n, seed=i, room=30) for i, n in enumerate([5, 20])]
    own = [cache for cache, _, _, _ in prompts]
    tokens = [token for _, _, _, token in prompts]
    monkeypatch.setattr(torch, "empty", nan_empty)
    pool = SlotPool(lm.shape, torch.float32, "cpu", slots=1, capacity=12)
    assert torch.isnan(pool.values).all()
    # the second reads past the first pool's positions (so must the first's mask), and the pool grows in slots and
    # positions for it: its new memory is NaN too
    (_, keys0, values0, _), (_, keys1, values1, _) = prompts
    slots = [pool.admit(keys0, values0, 5, room=4), pool.admit(keys1, values1, 20, room=30)]
    assert pool.slots == 2 and pool.capacity > 12
    for _ in range(3):
        want = decoder.step(tokens, own)
        got = decoder.step_slots(tokens, pool, slots)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        tokens = [int(t) for t in want.argmax(-1)]
    pool.release(slots[0])  # its slot holds an old answer's KV now; the next request gets it
    monkeypatch.undo()
    cache, keys, values, token = prefilled(lm.model, 3, seed=7, room=6)
    assert pool.admit(keys, values, 3, room=6) == slots[0]
    own[0], tokens[0] = cache, token
    for _ in range(3):
        want = decoder.step(tokens, own)
        got = decoder.step_slots(tokens, pool, slots)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        tokens = [int(t) for t in want.argmax(-1)]


@pytest.mark.parametrize("mode", ["blend", "reuse"])
@pytest.mark.parametrize("where", ["memory", "disk"])
def test_a_prefill_laid_in_its_decode_slot_is_the_prefill_and_needs_no_copy(mode, where, tmp_path):
    # The scheduler gives a request its slot before the prefill, which lays the prompt's KV there (strided views of
    # the pool): the same KV as in buffers of its own, whole or read layer by layer from disk, and decoding from the
    # slot as it is gives the steps of a copy of it.
    from cacheblend_rag import CacheBlendEngine, EngineConfig, StoreConfig
    from cacheblend_rag.engine.request.request import Request
    from cacheblend_rag.testing import make_tiny_tokenizer, random_words

    store = StoreConfig(disk_dir=str(tmp_path / "kv"), kv_codec="native") if where == "disk" else StoreConfig()
    engine = CacheBlendEngine(make_tiny_model("qwen2"), make_tiny_tokenizer(),
                              config=EngineConfig(miss_policy="blend", chunk_separator="", store=store))  # fmt: skip
    chunks = [random_words(60 + i, 25) for i in range(3)]
    engine.precompute(chunks, "w1 w2")
    if where == "disk":
        engine.store.tiers[0].clear()  # the memory tier: every chunk is read from disk, layer by layer
    prompt = engine.build_prompt(chunks, "w3 w4 w5")
    request = Request(mode=mode, recompute_ratio=0.3) if mode == "blend" else Request(mode=mode)
    own = engine.prefiller.run(prompt, request)
    pool = SlotPool(engine.lm.shape, engine.dtype, "cpu", slots=3, capacity=8)
    pool.admit(own.kv.key_buffer, own.kv.value_buffer, prompt.num_tokens, room=4)  # another request in slot 0
    slot = pool.take(prompt.num_tokens + 4)
    if where == "disk":
        engine.store.tiers[0].clear()  # read from disk again (the first read promoted them to memory)
    laid = engine.prefiller.run(prompt, request, buffers=pool.buffers(slot))
    assert laid.metrics.hits_by_tier == own.metrics.hits_by_tier
    n = prompt.num_tokens
    assert laid.kv.key_buffer.data_ptr() == pool.keys[:, slot].data_ptr()
    torch.testing.assert_close(laid.logits, own.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(pool.keys[:, slot, :, :n], own.kv.keys, atol=1e-5, rtol=0)
    torch.testing.assert_close(pool.values[:, slot, :, :n], own.kv.values, atol=1e-5, rtol=0)
    before = pool.keys.clone()
    pool.fill(slot, laid.kv.key_buffer, laid.kv.value_buffer, n)  # its own memory: nothing copied
    assert torch.equal(pool.keys[:, slot, :, :n], before[:, slot, :, :n])
    copied = pool.admit(own.kv.key_buffer, own.kv.value_buffer, n, room=4)
    decoder, token = BatchDecoder(engine.lm), int(own.logits.argmax())
    for _ in range(3):
        got = decoder.step_slots([token, token], pool, [slot, copied])
        torch.testing.assert_close(got[0], got[1], atol=1e-5, rtol=0)
        token = int(got[0].argmax())
    engine.close()


def test_a_slot_is_filled_only_once_taken_and_within_its_positions(lm):
    pool = SlotPool(lm.shape, torch.float32, "cpu", slots=2, capacity=8)
    keys = torch.zeros(lm.shape.num_layers, lm.shape.num_kv_heads, 4, lm.shape.head_dim)
    with pytest.raises(ValueError, match="was not taken"):
        pool.fill(0, keys, keys, 4)
    slot = pool.take(6)
    with pytest.raises(ValueError, match="do not fit"):
        pool.fill(slot, keys, keys, 9)
    pool.fill(slot, keys, keys, 4)
    assert pool.lengths[slot] == 4
