"""Sizing a store without the model: the simulated store traffic equals the engine's request by request, the cost
model's curves, the streams, and `plan_store`."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.config import StoreConfig
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.retrieval import Chunk, ChunkIndex
from cacheblend_rag.sizing import (
    CostModel,
    Curve,
    KVShape,
    SimRequest,
    StoreSimulator,
    format_plan,
    plan_store,
    prompt_lengths,
    run_stream,
    stream_order,
    summarize,
)
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

COSTS = CostModel(full=Curve(0.1, 0.01, 1e-6), blend=Curve(0.05, 0.002), chunk=Curve(0.01, 0.01))


def corpus(n: int = 12) -> list[str]:
    rng = random.Random(5)
    return [random_words(100 + i, rng.randint(8, 30)) for i in range(n)]


def stream(n_chunks: int, n_requests: int, k: int, seed: int) -> list[list[int]]:
    """Requests that favour a few chunks, so that some come back while others are evicted."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(n_chunks)]
    out = []
    for _ in range(n_requests):
        picked: list[int] = []
        while len(picked) < k:
            c = rng.choices(range(n_chunks), weights)[0]
            if c not in picked:
                picked.append(c)
        out.append(picked)
    return out


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("miss_policy", ["auto", "blend"])
def test_the_simulator_hits_and_misses_as_the_engine_does(policy, miss_policy):
    """Same requests, same budget: every request finds and misses the same chunks, and the store ends holding the
    same bytes, in a real engine (tiny random model) and in the simulator."""
    tokenizer = make_tiny_tokenizer()
    texts = corpus()
    requests = stream(len(texts), 30, 3, seed=1)
    questions = [random_words(900 + i, 5) for i in range(len(requests))]
    lengths = prompt_lengths(tokenizer, texts, questions)
    model = make_tiny_model("qwen2")
    cfg = model.config
    shape = KVShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
    budget = int(shape.bytes_per_token * sum(lengths.chunks) * 0.4)
    store = StoreConfig(memory_budget_bytes=budget, memory_eviction=policy)
    engine = CacheBlendEngine(model, tokenizer, config=EngineConfig(store=store, miss_policy=miss_policy))
    sim = StoreSimulator(lengths.chunks, prefix_tokens=lengths.prefix, bytes_per_token=shape.bytes_per_token,
                         budget_bytes=budget, num_layers=shape.num_layers, costs=COSTS, eviction=policy,
                         miss_policy=miss_policy)  # fmt: skip
    simulated = run_stream(sim, requests, lengths.suffixes)
    modes = set()
    for chunks, question, expected in zip(requests, questions, simulated, strict=True):
        m = engine.generate([texts[c] for c in chunks], question, max_new_tokens=1).metrics
        engine.wait_for_fills()
        assert (m.chunks_hit, m.chunks_missed, m.mode) == (expected.hits, expected.misses, expected.mode)
        assert m.prompt_tokens == expected.prompt_tokens
        modes.add(m.mode)
    assert engine.store.tiers[0].nbytes == sim.store.nbytes
    assert engine.store.tiers[0].stats.evictions == sim.store.stats.evictions > 0
    assert modes == ({"full", "blend"} if miss_policy == "auto" else {"blend"})


def test_an_unbounded_store_misses_each_chunk_once_per_entry():
    sim = StoreSimulator([10, 20, 30], prefix_tokens=4, bytes_per_token=8.0, budget_bytes=2**40, num_layers=4,
                         costs=COSTS, miss_policy="blend")  # fmt: skip
    first, again = sim.request([0, 1, 2], 5), sim.request([0, 1, 2], 5)
    assert (first.hits, first.misses, again.hits, again.misses) == (0, 3, 3, 0)
    assert again.ttft_s == pytest.approx(COSTS.blend(4 + 60 + 5))
    assert first.ttft_s == pytest.approx(COSTS.blend(69) + sum(COSTS.chunk(t) for t in (4, 10, 20, 30)))
    assert sim.store.nbytes == 8 * (4 + 60)


def test_a_cold_prompt_is_answered_in_full_and_its_chunks_stored_after():
    sim = StoreSimulator([50, 50], prefix_tokens=4, bytes_per_token=2.0, budget_bytes=2**40, num_layers=4, costs=COSTS)
    cold = sim.request([0, 1], 6)
    assert cold.mode == "full" and cold.ttft_s == cold.full_s == pytest.approx(COSTS.full(110))
    warm = sim.request([0, 1], 6)
    assert (warm.mode, warm.hits) == ("blend", 2)
    assert sim.request([1, 0], 6).hits == 1  # chunk 1 first reads its isolated entry, which no one stored


def test_curve_fit_recovers_a_quadratic_and_drops_a_negative_term():
    xs = [100, 400, 900, 1600]
    curve = Curve.fit(xs, [0.2 + 0.003 * x + 2e-7 * x * x for x in xs])
    assert (curve.c0, curve.c1, curve.c2) == pytest.approx((0.2, 0.003, 2e-7), rel=1e-6)
    falling = Curve.fit(xs, [5.0 - 0.001 * x for x in xs])  # time never falls with tokens: no negative slope
    assert falling.c1 >= 0 and falling.c2 >= 0 and falling(100) > 0
    with pytest.raises(ConfigError, match=">= 0"):
        Curve(-1.0, 0.0)


def test_cost_model_round_trips_and_a_foreign_file_is_refused(tmp_path):
    path = tmp_path / "costs.json"
    COSTS.save(path)
    assert CostModel.load(path) == COSTS
    path.write_text('{"format": "something else"}')
    with pytest.raises(ConfigError, match="cost-model"):
        CostModel.load(path)


def test_streams_are_seeded_and_zipf_favours_one_topic():
    topics = [t for t in range(10) for _ in range(20)]
    assert stream_order(topics, "clustered") == list(range(200))
    uniform = stream_order(topics, "uniform", seed=3)
    assert sorted(uniform) == list(range(200)) and uniform != list(range(200))
    assert uniform == stream_order(topics, "uniform", seed=3) != stream_order(topics, "uniform", seed=4)
    zipf = stream_order(topics, "zipf", seed=1, length=2000)
    counts = np.bincount([topics[i] for i in zipf], minlength=10)
    assert counts.max() > 3 * 2000 / 10 and counts.min() < 2000 / 10
    with pytest.raises(ConfigError, match="stream must be one of clustered, uniform, zipf"):
        stream_order(topics, "bursty")


def test_summaries_count_chunks_and_average_over_requests():
    results = [SimRequest(5, 0, "blend", 100, 1.0, 4.0, 0.2), SimRequest(0, 5, "full", 100, 4.0, 4.0, 1.0)]
    s = summarize(results)
    assert (s.requests, s.hit_rate, s.speedup) == (2, 0.5, pytest.approx(8.0 / 5.0))
    assert summarize(results, 1).speedup == 4.0


class WordEmbedder:
    """Bag of words hashed into 64 dimensions: similar texts get similar vectors, no model needed."""

    def get_sentence_embedding_dimension(self) -> int:
        return 64

    def encode(self, sentences, **kwargs):
        out = np.zeros((len(sentences), 64), dtype=np.float32)
        for i, s in enumerate(sentences):
            for w in s.split():
                out[i, zlib.crc32(w.encode()) % 64] += 1.0
        return out


def test_plan_store_reports_more_hits_for_a_larger_budget():
    tokenizer = make_tiny_tokenizer()
    texts = corpus(20)
    index = ChunkIndex.build([Chunk(t, "doc", i, len(t.split())) for i, t in enumerate(texts)], WordEmbedder(),
                             show_progress=False, model_name="words")  # fmt: skip
    rng = random.Random(2)
    questions = [" ".join(rng.sample(texts[rng.choice([0, 1, 2, 3, rng.randrange(20)])].split(), 4)) for _ in range(60)]
    plan = plan_store(index, questions, tokenizer, KVShape(2, 2, 8), COSTS, top_k=3, shares=(0.1, 0.5, None))
    rates = [row.summary.hit_rate for row in plan.rows]
    assert rates[0] < rates[1] <= rates[2] and rates[2] > 0.5
    assert [row.share for row in plan.rows] == [0.1, 0.5, None]
    assert plan.bytes_per_token == 2 * 2 * 2 * 8 * 4 and len(plan.chunk_bytes) == 20
    text = format_plan(plan)
    assert "unbounded" in text and "hit rate" in text and "no model run" in text
