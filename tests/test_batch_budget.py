"""`ServingConfig.max_batch_tokens`: the KV the requests decoding together may hold bounds the batch, a request
past it waits for room in arrival order, and one that could never fit is refused before anything runs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from cacheblend_rag import CacheBlendEngine, EngineConfig, ServingConfig
from cacheblend_rag.errors import ConfigError, PromptError
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

POOL = [random_words(500 + i, 10) for i in range(4)]
NEW_TOKENS = 6


def engine_for(max_batch_tokens: int | None) -> CacheBlendEngine:
    return CacheBlendEngine(
        make_tiny_model("qwen2", mute_eos=True),
        make_tiny_tokenizer(),
        config=EngineConfig(
            miss_policy="blend", chunk_separator="", serving=ServingConfig(max_batch_tokens=max_batch_tokens)
        ),
    )


def ask(engine: CacheBlendEngine, i: int) -> list[int]:
    return engine.generate([POOL[i % 4], POOL[(i + 1) % 4]], suffix=random_words(i, 4), mode="blend",
                           max_new_tokens=NEW_TOKENS).token_ids  # fmt: skip


def positions(engine: CacheBlendEngine, i: int) -> int:
    prompt = engine.build_prompt([POOL[i % 4], POOL[(i + 1) % 4]], suffix=random_words(i, 4))
    return prompt.num_tokens + NEW_TOKENS


@pytest.mark.parametrize("fit", [1, 2])
def test_the_batch_holds_no_more_kv_than_allowed_and_answers_stay_the_same(fit):
    free = engine_for(None)
    serial = [ask(free, i) for i in range(8)]
    sizes = [positions(free, i) for i in range(8)]
    budget = sum(sorted(sizes)[-fit:])  # room for the `fit` largest requests at once
    engine = engine_for(budget)
    with ThreadPoolExecutor(max_workers=8) as pool:
        together = list(pool.map(lambda i: ask(engine, i), range(8)))
    assert together == serial
    assert 0 < engine.scheduler.largest_batch_tokens <= budget
    if fit == 1:
        assert engine.scheduler.largest_batch == 1
    else:
        assert engine.scheduler.largest_batch == 2  # two always fit, a third never does (the sizes are close)
        assert 3 * min(sizes) > budget


def test_a_request_that_could_never_fit_is_refused_and_the_engine_goes_on():
    free = engine_for(None)
    size = positions(free, 0)
    engine = engine_for(size - 1)
    with pytest.raises(PromptError, match=f"needs {size} KV positions.*max_batch_tokens={size - 1}"):
        ask(engine, 0)
    assert engine.scheduler.busy == 0  # nothing was queued
    small = [POOL[0][:20]]
    assert (
        engine.generate(small, suffix="x", mode="blend", max_new_tokens=2).token_ids
        == free.generate(small, suffix="x", mode="blend", max_new_tokens=2).token_ids
    )


@pytest.mark.parametrize("bad", [0, -5, 2.5, "100"])
def test_max_batch_tokens_is_checked(bad):
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        ServingConfig(max_batch_tokens=bad)
