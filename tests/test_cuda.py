"""The exactness invariants on a CUDA device; skipped where none is present."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, EngineConfig, ServingConfig, blend_rule
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_cuda_blend_ends_match_full_and_reuse(family):
    engine = CacheBlendEngine(
        make_tiny_model(family),
        make_tiny_tokenizer(),
        config=EngineConfig(miss_policy="blend", device="cuda", chunk_separator=""),
    )
    prompt = engine.build_prompt(
        [random_words(s, 30) for s in (1, 2, 3)], prefix=random_words(4, 5), suffix=random_words(5, 6)
    )
    full = engine.prefill(prompt, "full").logits
    torch.testing.assert_close(engine.prefill(prompt, "blend", recompute_ratio=1.0).logits, full, atol=1e-4, rtol=0)
    reuse = engine.prefill(prompt, "reuse").logits
    torch.testing.assert_close(engine.prefill(prompt, "blend", recompute_ratio=0.0).logits, reuse, atol=1e-4, rtol=0)
    assert engine.lm.device.type == "cuda"


def test_cuda_bf16_generation_runs():
    engine = CacheBlendEngine(
        make_tiny_model("qwen2"),
        make_tiny_tokenizer(),
        config=EngineConfig(miss_policy="blend", device="cuda", dtype="bfloat16", chunk_separator=""),
    )
    out = engine.generate(
        [random_words(7, 20), random_words(8, 20)],
        prefix=random_words(4, 5),
        suffix=random_words(5, 6),
        max_new_tokens=5,
    )
    assert out.metrics.prompt_tokens == 51


def test_cuda_contextual_chunk_kv_after_its_predecessor_makes_reuse_exact():
    engine = CacheBlendEngine(
        make_tiny_model("qwen2"),
        make_tiny_tokenizer(),
        config=EngineConfig(miss_policy="full", device="cuda", chunk_separator=""),
    )
    a, b = random_words(31, 24), random_words(32, 20)
    prompt = engine.build_prompt([a, b], prefix=random_words(33, 5), suffix=random_words(34, 6))
    engine.set_chunk_context([a, b], [[], [a]], prefix=random_words(33, 5))
    cold = engine.generate(prompt, max_new_tokens=2)  # a full prefill; the chunks are stored in the background
    assert cold.metrics.mode == "full" and engine.wait_for_fills(timeout=60)
    full = engine.prefill(prompt, "full").logits
    warm = engine.prefill(prompt, "reuse")
    assert warm.metrics.chunks_hit == 2
    torch.testing.assert_close(warm.logits, full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_cuda_batched_decode_of_mixed_lengths_equals_the_models_own_forward(family):
    # The decode step's attention runs per request on the GPU's kernels (kept off cuDNN): every row of a batch of
    # caches of different lengths equals that request decoded alone by the model's own forward.
    from transformers import DynamicCache

    from cacheblend_rag.engine.serving.batch_decode import BatchDecoder, DecodeCache
    from cacheblend_rag.models.adapter import LayerwiseModel

    model = make_tiny_model(family).to("cuda")
    decoder = BatchDecoder(LayerwiseModel(model))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.config.vocab_size, (3 + 7 * b,), generator=g).cuda() for b in range(5)]
    alone, caches = [], []
    with torch.inference_mode():
        for ids in prompts:
            for keep in (alone, caches):
                cache = DynamicCache(config=model.config)
                model(input_ids=ids.unsqueeze(0), cache=cache, use_cache=True)
                keep.append(cache)
    caches = [DecodeCache(c, ids.numel(), ids.numel() + 4) for c, ids in zip(caches, prompts, strict=True)]
    lengths = [ids.numel() for ids in prompts]
    tokens = [int(ids[-1]) for ids in prompts]
    for _ in range(4):
        got = decoder.step(tokens, caches)
        for b in range(len(prompts)):
            with torch.inference_mode():
                token, position = torch.tensor([[tokens[b]]]).cuda(), torch.tensor([[lengths[b]]]).cuda()
                out = model(input_ids=token, position_ids=position, cache=alone[b], use_cache=True)
            torch.testing.assert_close(got[b], out.logits[0, -1].float(), atol=1e-4, rtol=1e-4)
            lengths[b] += 1
        tokens = [int(row.argmax()) for row in got]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cuda_slot_pool_steps_equal_each_requests_own_step(family):
    # one attention call per layer over the slot pool (masked to each request's length) on the GPU's kernels: the
    # logits of each request as its own cache gives them, and the same greedy tokens, with a gap in the slots
    from transformers import DynamicCache

    from cacheblend_rag.engine.serving.batch_decode import BatchDecoder, DecodeCache
    from cacheblend_rag.engine.serving.slots import SlotPool
    from cacheblend_rag.models.adapter import LayerwiseModel

    model = make_tiny_model(family).to("cuda")
    lm = LayerwiseModel(model)
    decoder, pool = BatchDecoder(lm), SlotPool(lm.shape, torch.float32, "cuda", slots=2, capacity=64)
    g = torch.Generator().manual_seed(7)
    own, slots, tokens = [], [], []
    for b in range(5):
        ids = torch.randint(0, model.config.vocab_size, (4 + 9 * b,), generator=g).cuda()
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            out = model(input_ids=ids.unsqueeze(0), cache=cache, use_cache=True)
        layers = [layer.keys[0] for layer in cache.layers], [layer.values[0] for layer in cache.layers]
        slots.append(pool.admit(*layers, ids.numel(), room=6))
        own.append(DecodeCache(cache, ids.numel(), ids.numel() + 6))
        tokens.append(int(out.logits[0, -1].argmax()))
    pool.release(slots.pop(1))  # a gap at slot 1
    del own[1], tokens[1]
    for _ in range(5):
        want, got = decoder.step(tokens, own), decoder.step_slots(tokens, pool, slots)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        tokens = want.argmax(-1).tolist()


def test_cuda_graph_replayed_steps_equal_the_eager_slot_steps():
    # the fixed-shape step captured once per bucket and replayed: the eager step's logits and greedy tokens, for
    # batches that change bucket (3 -> 2 -> 1 requests) and a request joining between replays
    from transformers import DynamicCache

    from cacheblend_rag.engine.serving.batch_decode import BatchDecoder
    from cacheblend_rag.engine.serving.graphs import GraphedSteps
    from cacheblend_rag.engine.serving.slots import SlotPool
    from cacheblend_rag.models.adapter import LayerwiseModel

    model = make_tiny_model("llama").to("cuda")
    lm = LayerwiseModel(model)
    decoder, graphed = BatchDecoder(lm), GraphedSteps(lm)
    pools = [SlotPool(lm.shape, torch.float32, "cuda", slots=8, capacity=128) for _ in range(2)]
    g = torch.Generator().manual_seed(9)

    def join(n):
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=g).cuda()
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            out = model(input_ids=ids.unsqueeze(0), cache=cache, use_cache=True)
        layers = [layer.keys[0] for layer in cache.layers], [layer.values[0] for layer in cache.layers]
        return [p.admit(*layers, n, room=40) for p in pools][0], int(out.logits[0, -1].argmax())

    live = [join(n) for n in (5, 17, 30)]
    for step in range(9):
        if step in (3, 6):  # the oldest leaves; at 6 another joins, into its slot
            for p in pools:
                p.release(live[0][0])
            live = live[1:] + ([join(12)] if step == 6 else [])
        slots, tokens = [s for s, _ in live], [t for _, t in live]
        want, got = decoder.step_slots(tokens, pools[0], slots), graphed.step(tokens, pools[1], slots)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        live = [(s, int(t)) for s, t in zip(slots, want.argmax(-1).tolist(), strict=True)]


def test_a_cuda_engine_with_decode_graphs_answers_concurrent_requests_as_alone():
    from concurrent.futures import ThreadPoolExecutor

    def engine(graphs):
        config = EngineConfig(
            device="cuda", miss_policy="blend", chunk_separator="", serving=ServingConfig(decode_graphs=graphs)
        )
        return CacheBlendEngine(make_tiny_model("qwen2", mute_eos=True), make_tiny_tokenizer(), config=config)

    chunks = [random_words(400 + i, 12) for i in range(4)]
    asks = [dict(suffix=random_words(410 + i, 4), max_new_tokens=5 + i) for i in range(6)]
    eager = engine(False)
    want = [eager.generate(chunks[i % 4 :][:2], **a).token_ids for i, a in enumerate(asks)]
    graphed = engine(True)
    with ThreadPoolExecutor(max_workers=6) as pool:
        got = list(pool.map(lambda i: graphed.generate(chunks[i % 4 :][:2], **asks[i]).token_ids, range(6)))
    assert got == want


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_cuda_prefill_graphs_equal_the_eager_layers(family):
    # The row-wise halves of every layer replayed as CUDA graphs over padded rows: r = 1 still a full prefill and
    # r = 0 full reuse, the default rule and `paper` as the eager layers give them, greedy answers equal.
    def engine(graphs):
        config = EngineConfig(device="cuda", miss_policy="blend", chunk_separator="", prefill_graphs=graphs)
        return CacheBlendEngine(make_tiny_model(family, mute_eos=True), make_tiny_tokenizer(), config=config)

    eager, graphed = engine(False), engine(True)
    prompt = eager.build_prompt([random_words(s, 30) for s in (1, 2, 3)], prefix=random_words(4, 5),
                                suffix=random_words(5, 6))  # fmt: skip
    full = eager.prefill(prompt, "full").logits
    torch.testing.assert_close(graphed.prefill(prompt, "blend", recompute_ratio=1.0).logits, full, atol=1e-4, rtol=0)
    reuse = eager.prefill(prompt, "reuse").logits
    torch.testing.assert_close(graphed.prefill(prompt, "blend", recompute_ratio=0.0).logits, reuse, atol=1e-4, rtol=0)
    torch.testing.assert_close(graphed.prefill(prompt, "reuse").logits, reuse, atol=1e-4, rtol=0)
    for opts in ({}, {"blend": blend_rule("paper", 0.3)}):
        want = eager.prefill(prompt, "blend", **opts)
        got = graphed.prefill(prompt, "blend", **opts)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=0)
        assert got.metrics.recomputed_tokens == want.metrics.recomputed_tokens
    answer = dict(mode="blend", max_new_tokens=6, stop=())
    assert graphed.generate(prompt, **answer).token_ids == eager.generate(prompt, **answer).token_ids
    assert graphed.prefiller.steps.bucket_sizes  # the rows did run as graphs


def test_a_cuda_engine_in_a_forked_child_refuses_with_advice():
    from test_faults_peers import in_a_child

    engine = CacheBlendEngine(
        make_tiny_model("qwen2"), make_tiny_tokenizer(), config=EngineConfig(device="cuda", chunk_separator="")
    )
    engine.generate([random_words(1, 10)], prefix=random_words(2, 3), suffix=random_words(3, 3), max_new_tokens=1)
    child = in_a_child(lambda: engine.generate([random_words(1, 10)], "q", max_new_tokens=1).text)
    assert "build the engine after forking" in child["error"] and child["error"].startswith("EngineClosedError")
