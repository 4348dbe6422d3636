"""A request is checked once, before any compute, with one clear message per mistake that names the method called;
and no store content can make a request fail."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cacheblend_rag import CacheBlendEngine, EngineConfig, Request, StoreConfig
from cacheblend_rag.config.store_config import STORE_FIELDS
from cacheblend_rag.errors import ConfigError, PromptError
from cacheblend_rag.store import DiskStore, MemoryStore, TieredStore
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

CHUNKS = [random_words(s, 40) for s in (601, 602, 603, 604)]
# The disk tiers below keep the exact codec, not the lossy default (int8): these tests check their bookkeeping, and
# only exact entries of these chunks are large enough to be value files to damage. The default codec has its own
# tests in test_codec_store.py and test_codec.py.
EXACT_CODEC = "native"


@pytest.fixture(scope="module")
def engine():
    return CacheBlendEngine(make_tiny_model("qwen2"), make_tiny_tokenizer(), config=EngineConfig(chunk_separator=""))


def ask(engine, method="generate", chunks=CHUNKS, question=None, **options):
    question = random_words(9, 5) if question is None else question
    out = getattr(engine, method)(chunks, question, **options)
    return out if method == "generate" else "".join(out)


# ---------------------------------------------------------------- one vocabulary, errors that name the method


@pytest.mark.parametrize("method", ["generate", "stream"])
def test_max_tokens_is_read_as_max_new_tokens(engine, method):
    result = engine.generate(CHUNKS, random_words(9, 5), max_tokens=3)
    assert result.metrics.generated_tokens <= 3
    with pytest.raises(ConfigError, match=rf"^{method}\(\) got both 'max_new_tokens' and 'max_tokens'"):
        ask(engine, method, max_new_tokens=3, max_tokens=3)


@pytest.mark.parametrize("method", ["generate", "stream"])
def test_an_unknown_argument_names_the_method_called(engine, method):
    with pytest.raises(ConfigError, match=rf"^{method}\(\) got an unexpected keyword argument 'max_lenght'"):
        ask(engine, method, max_lenght=3)


@pytest.mark.parametrize("method", ["generate", "stream"])
def test_a_bad_value_names_the_method_called(engine, method):
    with pytest.raises(ConfigError, match=rf"^{method}\(\): top_p must be in \(0, 1\]"):
        ask(engine, method, top_p=0)
    with pytest.raises(PromptError, match=rf"^{method}\(\): prompt of \d+ tokens \+ 9999 new tokens exceeds"):
        ask(engine, method, max_new_tokens=9999)


def test_an_integer_temperature_samples(engine):
    result = engine.generate(CHUNKS, random_words(9, 5), temperature=1, seed=5, max_new_tokens=4)
    assert result.metrics.generated_tokens >= 1
    assert Request.from_options("generate", {"temperature": 1}).sampling.temperature == 1.0


@pytest.mark.parametrize("seed, ok", [(2**64 - 1, True), (2**64, False), (2**70, False), (-1, False)])
def test_a_seed_beyond_64_bits_is_refused_before_any_compute(engine, seed, ok):
    if ok:
        assert engine.generate(CHUNKS, random_words(9, 5), temperature=0.7, seed=seed, max_new_tokens=2).text
    else:
        with pytest.raises(ConfigError, match="seed must be"):
            engine.generate(CHUNKS, random_words(9, 5), temperature=0.7, seed=seed, max_new_tokens=2)


@pytest.mark.parametrize(
    "chunks, question, options, match",
    [
        (CHUNKS, 123, {}, "question must be a string or None, got int"),
        (CHUNKS, b"w1 w2", {}, r"question must be a string or None, got bytes \(decode bytes first"),
        (None, "w1", {}, "chunks must be a list of strings, got NoneType"),
        ({"w1 w2": 1}, "w1", {}, "chunks must be a list of strings, got dict"),
        ("w1 w2 w3", "w1", {}, r"chunks must be a list of strings, got str; wrap a single text in a list"),
        ([*CHUNKS[:1], 7], "w1", {}, "chunk 1 must be a string, got int"),
        (CHUNKS, None, {"prefix": 123, "suffix": "w3"}, "prefix must be a string or None, got int"),
    ],
)
def test_arguments_of_the_wrong_type_are_refused_by_name(engine, chunks, question, options, match):
    with pytest.raises(PromptError, match=match):
        engine.generate(chunks, question, **options) if question is not None else engine.generate(chunks, **options)


def test_precompute_refuses_the_same_wrong_types(engine):
    with pytest.raises(PromptError, match="chunks must be a list of strings, got dict"):
        engine.precompute({"a": 1})
    with pytest.raises(PromptError, match="question must be a string or None, got bytes"):
        engine.precompute(CHUNKS, b"?")


# ---------------------------------------------------------------- engine settings of the wrong type or value


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("memory_budget_bytes", float("nan"), "memory_budget_bytes must be an integer >= 0"),
        ("disk_budget_bytes", float("nan"), "disk_budget_bytes must be an integer >= 0"),
        ("memory_budget_bytes", "1GB", r"must be an integer >= 0 \(a number of bytes"),
        ("redis_budget_bytes", None, "redis_budget_bytes must be an integer"),
        ("memory_budget_bytes", True, "memory_budget_bytes must be an integer"),
        ("disk_dir", 123, "disk_dir must be a path string or None, got 123"),
        ("max_prompt_tokens", 1.5, "max_prompt_tokens must be an integer >= 1"),
        ("max_prompt_tokens", True, "max_prompt_tokens must be an integer >= 1"),
        ("max_prompt_tokens", float("nan"), "max_prompt_tokens must be an integer >= 1"),
        ("chunk_context", "neighbours", "chunk_context must be one of grouped, captured, isolated"),
        ("store", {"disk_dir": "kv"}, "store must be a StoreConfig, got dict"),
    ],
)
def test_engine_settings_of_the_wrong_type_are_refused_by_name(field, value, match):
    with pytest.raises(ConfigError, match=match):
        if field in STORE_FIELDS:
            StoreConfig(**{field: value})
        else:
            EngineConfig(**{field: value})


@pytest.mark.parametrize(
    "field, value, replacement",
    [
        ("disk_dir", "kv", r"EngineConfig\(store=StoreConfig\(disk_dir=...\)\)"),
        ("store_hmac_key", "k" * 16, r"StoreConfig\(hmac_key=...\)"),
        ("capture", "exact", "chunk_context='isolated'"),
        ("precompute_groups", 0, "chunk_context"),
        ("context_neighbours", 2, "context=\\[\\[text"),
        ("stale_key_temperature", 1.25, "left the product"),
        ("pipelined_loading", False, "always on"),
    ],
)
def test_a_setting_that_left_engine_config_names_its_replacement(field, value, replacement):
    with pytest.raises(ConfigError, match=replacement):
        EngineConfig(**{field: value})
    with pytest.raises(ConfigError, match=replacement):
        replace(EngineConfig(), **{field: value})


def test_a_path_object_is_a_disk_folder(tmp_path):
    assert StoreConfig(disk_dir=tmp_path / "kv").disk_dir == str(tmp_path / "kv")


# ---------------------------------------------------------------- store contents never fail a request


def damage_every_value_file(folder: Path) -> int:
    """Flip a byte in the last layer of every stored value file: found only once the fusor has started."""
    files = list(folder.rglob("*.val"))
    for f in files:
        raw = bytearray(f.read_bytes())
        raw[-5] ^= 0x01
        f.write_bytes(bytes(raw))
    return len(files)


def test_the_same_chunks_damaged_in_two_lower_tiers_still_answer(tmp_path):
    # Two tiers below memory each hold every chunk damaged where only a layer-wise read finds it: the request
    # has to drop 2 x chunks entries before it recomputes them all, and must still answer as before.
    tiers = [
        MemoryStore(0),
        DiskStore(tmp_path / "a", budget_bytes=2**30, codec=EXACT_CODEC),
        DiskStore(tmp_path / "b", budget_bytes=2**30, codec=EXACT_CODEC),
    ]
    store = TieredStore(tiers, names=["memory", "near", "far"])
    engine = CacheBlendEngine(
        make_tiny_model("qwen2"),
        make_tiny_tokenizer(),
        config=EngineConfig(chunk_separator=""),
        store=store,
    )
    prefix, suffix = random_words(1, 4), random_words(2, 5)
    reference = engine.generate(CHUNKS, prefix=prefix, suffix=suffix, max_new_tokens=6, mode="full")
    engine.precompute(CHUNKS, prefix=prefix)
    store.flush()  # the lower tiers are written on a background thread
    assert damage_every_value_file(tmp_path / "a") >= len(CHUNKS)
    assert damage_every_value_file(tmp_path / "b") >= len(CHUNKS)
    again = engine.generate(CHUNKS, prefix=prefix, suffix=suffix, max_new_tokens=6, mode="reuse")
    assert again.metrics.chunks_missed == len(CHUNKS) and again.metrics.chunks_hit == 0
    assert engine.generate(CHUNKS, prefix=prefix, suffix=suffix, max_new_tokens=6, mode="reuse").metrics.chunks_hit
    assert len(again.token_ids) == len(reference.token_ids)


def test_precompute_refuses_a_chunk_longer_than_the_model_can_take_before_computing_it():
    from cacheblend_rag import CacheBlendEngine, EngineConfig
    from cacheblend_rag.errors import PromptError
    from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

    engine = CacheBlendEngine(make_tiny_model("llama"), make_tiny_tokenizer(),
                              config=EngineConfig(chunk_separator="", max_prompt_tokens=64))  # fmt: skip
    with pytest.raises(PromptError, match="chunk 1 has 80 tokens.*limit of 64; split it smaller"):
        engine.precompute([random_words(1, 10), random_words(2, 80)], prefix=random_words(3, 4))
    assert len(engine.store) == 0  # nothing computed, not even the short chunk


def test_the_answer_methods_name_every_request_option_for_editors_and_type_checkers():
    import typing

    from cacheblend_rag.engine import RequestOptions
    from cacheblend_rag.engine.request.request import ALIASES, REQUEST_DEFAULTS

    assert set(RequestOptions.__annotations__) == {*REQUEST_DEFAULTS, *ALIASES}  # one list, no option left out
    for method in ("generate", "stream", "agenerate", "astream"):
        hint = typing.get_type_hints(getattr(CacheBlendEngine, method), include_extras=True)["options"]
        assert typing.get_args(hint) == (RequestOptions,), (method, hint)
