"""Chunk texts tokenized once: the ids kept are the ids tokenizing gives, bounded by tokens, per tokenizer."""

from __future__ import annotations

import threading

import pytest

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.engine.request.prompt import tokenize_chunks
from cacheblend_rag.engine.request.token_cache import TokenCache
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words


def counting(tokenizer):
    """The tokenizer, and a list that grows by one for every text its `encode` is called on."""
    calls: list[str] = []
    original = tokenizer.encode

    def encode(text, *args, **kwargs):
        calls.append(text)
        return original(text, *args, **kwargs)

    tokenizer.encode = encode
    return tokenizer, calls


def test_kept_ids_are_the_ids_tokenizing_gives(tiny_tokenizer):
    chunks = [random_words(i, 40) for i in range(5)] + ["w3 w1 <s> w2"]  # a special-token string stays text
    cache = TokenCache(tiny_tokenizer)
    first = tokenize_chunks(tiny_tokenizer, chunks, "\n\n", cache)
    again = tokenize_chunks(tiny_tokenizer, chunks, "\n\n", cache)
    assert first == again == tokenize_chunks(tiny_tokenizer, chunks, "\n\n")
    assert cache.stats.hits == len(chunks) and cache.stats.misses == len(chunks)


def test_a_chunk_seen_before_is_not_tokenized_again_through_the_engine(tiny_tokenizer):
    tokenizer, calls = counting(tiny_tokenizer)
    engine = CacheBlendEngine(make_tiny_model("llama", 0), tokenizer, config=EngineConfig(miss_policy="blend"))
    chunks = [random_words(i, 30) for i in range(4)]
    engine.precompute(chunks, "w1 w2")
    assert all(c + engine.config.chunk_separator in calls for c in chunks)  # tokenized once, by the precompute
    calls.clear()
    prompt = engine.build_prompt(chunks[::-1], "w3 w4")  # the same chunks in another order, another question
    assert not any(c + engine.config.chunk_separator in calls for c in chunks)  # only the prefix and question
    assert prompt.chunk_ids == tokenize_chunks(tokenizer, chunks[::-1], engine.config.chunk_separator)
    engine.close()


def test_the_separator_is_part_of_the_key(tiny_tokenizer):
    cache = TokenCache(tiny_tokenizer)
    text = random_words(1, 10)
    plain = tokenize_chunks(tiny_tokenizer, [text], "", cache)
    spaced = tokenize_chunks(tiny_tokenizer, [text], " w5", cache)
    assert plain != spaced and spaced == tokenize_chunks(tiny_tokenizer, [text], " w5")


def test_least_recently_used_chunks_leave_past_the_token_budget(tiny_tokenizer):
    texts = [random_words(i, 10) for i in range(4)]
    lengths = [len(ids) for ids in tokenize_chunks(tiny_tokenizer, texts, "")]
    cache = TokenCache(tiny_tokenizer, max_tokens=lengths[0] + lengths[1] + lengths[2])
    tokenize_chunks(tiny_tokenizer, texts[:3], "", cache)
    tokenize_chunks(tiny_tokenizer, texts[:1], "", cache)  # text 0 used again: text 1 is now the oldest
    tokenize_chunks(tiny_tokenizer, texts[3:], "", cache)
    assert cache.stats.tokens <= cache.max_tokens
    hits = cache.stats.hits
    tokenize_chunks(tiny_tokenizer, texts[:1], "", cache)
    assert cache.stats.hits == hits + 1  # kept
    tokenize_chunks(tiny_tokenizer, texts[1:2], "", cache)
    assert cache.stats.hits == hits + 1  # dropped, tokenized again


def test_a_chunk_longer_than_the_budget_is_tokenized_and_not_kept(tiny_tokenizer):
    cache = TokenCache(tiny_tokenizer, max_tokens=3)
    (ids,) = tokenize_chunks(tiny_tokenizer, [random_words(0, 20)], "", cache)
    assert len(ids) == 20 and cache.stats.chunks == 0 and cache.stats.tokens == 0
    assert TokenCache(tiny_tokenizer, max_tokens=0).chunk_ids("w1", "", lambda t: (7,)) == (7,)


def test_a_cache_of_another_tokenizer_is_refused(tiny_tokenizer):
    with pytest.raises(ValueError, match="another tokenizer"):
        tokenize_chunks(tiny_tokenizer, ["w1 w2"], "", TokenCache(make_tiny_tokenizer()))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_a_bad_budget_is_refused_with_what_to_give(tiny_tokenizer, bad):
    with pytest.raises(ValueError, match="max_tokens must be an int >= 0"):
        TokenCache(tiny_tokenizer, max_tokens=bad)


def test_threads_tokenizing_the_same_chunks_get_the_same_ids(tiny_tokenizer):
    texts = [random_words(i, 25) for i in range(30)]
    expected = tokenize_chunks(tiny_tokenizer, texts, "")
    cache = TokenCache(tiny_tokenizer, max_tokens=400)  # some eviction while the threads run
    results, errors = [], []

    def work(offset: int) -> None:
        try:
            order = texts[offset:] + texts[:offset]
            for _ in range(5):
                got = tokenize_chunks(tiny_tokenizer, order, "", cache)
                results.append(dict(zip(order, got, strict=True)))
        except Exception as exc:  # noqa: BLE001 (reported by the test)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k * 7,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(r == dict(zip(texts, expected, strict=True)) for r in results)
    assert cache.stats.tokens <= 400


def test_a_forked_child_keeps_the_ids(tiny_tokenizer):
    cache = TokenCache(tiny_tokenizer)
    tokenize_chunks(tiny_tokenizer, ["w1 w2 w3"], "", cache)
    cache.after_fork_in_child()
    assert tokenize_chunks(tiny_tokenizer, ["w1 w2 w3"], "", cache) == tokenize_chunks(tiny_tokenizer, ["w1 w2 w3"], "")
    assert cache.stats.hits == 1
