"""The engine end to end on a tiny random model: decoding, streaming, stop strings, the chunk cache, metrics,
and clear errors for bad requests."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import (
    BlendConfig,
    CacheBlendEngine,
    ConfigError,
    EngineConfig,
    MemoryStore,
    PromptError,
    PromptTemplate,
    StoreConfig,
    blend_rule,
)
from cacheblend_rag.engine.request.request import SamplingParams
from cacheblend_rag.engine.serving.tokens import TextAssembler
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words


@pytest.fixture(scope="module")
def engine() -> CacheBlendEngine:
    return CacheBlendEngine(
        make_tiny_model("qwen2"), make_tiny_tokenizer(), config=EngineConfig(miss_policy="blend", chunk_separator="")
    )


def ask(engine, chunks=None, **kw):
    chunks = chunks or [random_words(31, 20), random_words(32, 20)]
    return engine.generate(chunks, prefix=random_words(1, 4), suffix=random_words(2, 5), **kw)


def test_blend_at_ratio_one_generates_the_same_tokens_as_full(engine):
    full = ask(engine, mode="full", max_new_tokens=12)
    blend = ask(engine, mode="blend", recompute_ratio=1.0, max_new_tokens=12)
    assert blend.token_ids == full.token_ids
    assert len(full.token_ids) > 0


@pytest.mark.parametrize("rule", ["paper", "attention", "epic"])
def test_a_rule_pinned_per_request_is_full_at_one_and_reuse_at_zero(engine, rule):
    full = ask(engine, mode="full", max_new_tokens=8)
    reuse = ask(engine, mode="reuse", max_new_tokens=8)
    at_one = ask(engine, blend=blend_rule(rule, 1.0), max_new_tokens=8)
    assert at_one.token_ids == full.token_ids
    m = at_one.metrics  # every loaded chunk token recomputed on every layer, with the question
    assert m.recomputed_tokens > m.reused_tokens and min(m.recomputed_per_layer) >= m.recomputed_tokens
    if rule != "paper":  # paper's check layers recompute every chunk token up to layer 1, even at r = 0
        at_zero = ask(engine, blend=blend_rule(rule, 0.0), max_new_tokens=8)
        assert at_zero.token_ids == reuse.token_ids


def test_a_per_request_rule_is_checked_before_any_compute(engine):
    with pytest.raises(ConfigError, match="apply to mode 'blend' only"):
        ask(engine, mode="full", blend=blend_rule("gradual"))
    with pytest.raises(ConfigError, match="blend must be a BlendConfig"):
        ask(engine, blend="gradual")
    with pytest.raises(ConfigError, match="no rule named|rule must be one of"):
        ask(engine, blend=BlendConfig(rule="lmcache"))


def test_stream_yields_the_same_text_as_generate(engine):
    result = ask(engine, max_new_tokens=10)
    stream = engine.stream(
        [random_words(31, 20), random_words(32, 20)],
        prefix=random_words(1, 4),
        suffix=random_words(2, 5),
        max_new_tokens=10,
    )
    pieces = list(stream)
    assert "".join(pieces) == result.text
    assert stream.result is not None and stream.result.token_ids == result.token_ids


def test_max_new_tokens_and_finish_reason(engine):
    result = ask(engine, max_new_tokens=3)
    if result.finish_reason == "length":
        assert len(result.token_ids) == 3
    else:
        assert len(result.token_ids) < 3
    assert result.metrics.generated_tokens == len(result.token_ids)


def test_stop_string_cuts_the_answer(engine):
    free = ask(engine, max_new_tokens=8)
    toks = free.text.split()
    if len(toks) < 3:
        pytest.skip("the random model ended too early to place a stop string")
    stop = toks[2]
    cut = ask(engine, max_new_tokens=8, stop=[stop])
    assert stop not in cut.text
    assert free.text.startswith(cut.text)
    assert cut.finish_reason == "stop"


def test_text_assembler_holds_back_a_partial_stop_string(tiny_tokenizer):
    ids = tiny_tokenizer.encode("w1 w2 w3 w4", add_special_tokens=False)
    asm = TextAssembler(tiny_tokenizer, ["w3 w4"])
    out = [asm.add(i) for i in ids]
    assert "".join(out) + asm.flush() == "w1 w2 "
    assert asm.stopped


def test_sampling_is_reproducible_with_a_seed(engine):
    a = ask(engine, temperature=1.0, top_p=0.9, top_k=20, seed=7, max_new_tokens=8)
    b = ask(engine, temperature=1.0, top_p=0.9, top_k=20, seed=7, max_new_tokens=8)
    assert a.token_ids == b.token_ids


def test_second_request_hits_the_chunk_cache():
    eng = CacheBlendEngine(
        make_tiny_model("llama"), make_tiny_tokenizer(), config=EngineConfig(miss_policy="blend", chunk_separator="")
    )
    first = ask(eng, [random_words(41, 15), random_words(42, 15)], max_new_tokens=1)
    assert (first.metrics.chunks_hit, first.metrics.chunks_missed) == (0, 2)
    second = ask(eng, [random_words(42, 15), random_words(43, 15)], max_new_tokens=1)  # one chunk shared, one new
    assert (second.metrics.chunks_hit, second.metrics.chunks_missed) == (1, 1)
    assert second.metrics.bytes_loaded > 0
    # only the stored chunk's tokens count as reused; the new one's are cold (prefilled in the request)
    assert (second.metrics.reused_tokens, second.metrics.cold_tokens) == (15, 15)
    assert (first.metrics.reused_tokens, first.metrics.cold_tokens) == (0, 30)


@pytest.mark.parametrize("codec", ["native", "int8"])
def test_bytes_loaded_are_the_stored_bytes_whether_or_not_loading_is_pipelined(codec):
    chunks = [random_words(44, 15), random_words(45, 15)]
    loaded = {}
    for pipelined in (False, True):
        config = EngineConfig(miss_policy="blend", chunk_separator="", store=StoreConfig(memory_codec=codec))
        eng = CacheBlendEngine(make_tiny_model("llama"), make_tiny_tokenizer(), config=config)
        eng.prefiller.pipelined = pipelined
        ask(eng, chunks, max_new_tokens=1)
        loaded[pipelined] = ask(eng, chunks, max_new_tokens=1).metrics.bytes_loaded
    assert loaded[False] == loaded[True] > 0
    if codec == "int8":  # read as stored: about a quarter of the fp32 bytes, not the decoded size
        native = EngineConfig(miss_policy="blend", chunk_separator="")
        eng = CacheBlendEngine(make_tiny_model("llama"), make_tiny_tokenizer(), config=native)
        ask(eng, chunks, max_new_tokens=1)
        assert loaded[False] < 0.5 * ask(eng, chunks, max_new_tokens=1).metrics.bytes_loaded


def test_cold_chunks_give_the_same_answer_as_warm_ones():
    chunks = [random_words(51, 15), random_words(52, 15), random_words(53, 15)]
    contexts = [[chunks[2]], [chunks[0]], [chunks[1], chunks[0]]]
    config = EngineConfig(miss_policy="blend", chunk_separator="", chunk_context="isolated")
    cold = CacheBlendEngine(make_tiny_model("qwen3"), make_tiny_tokenizer(), config=config)
    warm = CacheBlendEngine(make_tiny_model("qwen3"), make_tiny_tokenizer(), config=config)
    # The same corpus on both: the cold engine only records each chunk's context, the warm one also computes the
    # entries; a miss is prefilled after the same context, so the answers agree.
    cold.set_chunk_context(chunks, contexts, prefix=random_words(1, 4))
    warm.precompute(chunks, prefix=random_words(1, 4), context=contexts)
    a, b = ask(cold, chunks, max_new_tokens=6), ask(warm, chunks, max_new_tokens=6)
    assert a.metrics.chunks_missed == 3 and b.metrics.chunks_hit == 3
    assert a.token_ids == b.token_ids


def test_memory_store_evicts_least_recently_used():
    eng = CacheBlendEngine(
        make_tiny_model("llama"), make_tiny_tokenizer(), config=EngineConfig(miss_policy="blend", chunk_separator="")
    )
    chunk = random_words(61, 10)
    ask(eng, [chunk], max_new_tokens=1)
    prompt = eng.build_prompt([chunk], prefix=random_words(1, 4), suffix=random_words(2, 5))
    one = eng.store.get(eng.chunk_key(prompt.prefix_ids, prompt.chunk_ids[0])).nbytes  # every chunk has 10 tokens
    small = MemoryStore(budget_bytes=4 * one)  # room for the prefix entry and three chunks
    eng.store = small
    for s in range(62, 67):
        ask(eng, [random_words(s, 10)], max_new_tokens=1)
    assert small.nbytes <= 4 * one
    assert small.stats.evictions >= 2


def test_metrics_account_for_the_request(engine):
    r = ask(engine, mode="blend", recompute_ratio=0.15, max_new_tokens=2)
    m = r.metrics
    assert m.mode == "blend" and m.recompute_ratio == 0.15
    assert m.prompt_tokens == 4 + 40 + 5
    assert m.ttft_s > 0 and m.compute_s > 0 and m.load_s >= 0
    assert 0 < m.compute_share < 1
    assert m.recomputed_tokens == 5 + 6  # the suffix + ceil(0.15 * 40)
    assert "ttft=" in m.summary()
    assert (m.dtype, m.device) == ("float32", "cpu") and m.summary().endswith("(float32 on cpu)")
    assert m.to_dict()["recompute_share"] == pytest.approx(m.recomputed_tokens / m.prompt_tokens)


def test_the_template_renders_chunks_between_prefix_and_question(tiny_tokenizer):
    tpl = PromptTemplate(system="w1", instruction="w2 ", question_template=" w3 {question}", use_chat_template=False)
    prefix, suffix = tpl.render(tiny_tokenizer, "w4")
    assert prefix == "w1\n\nw2 " and suffix == " w3 w4\n"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(chunks=["w1", "   "]), PromptError, "chunk 1 is empty"),
        (dict(chunks="w1 w2"), PromptError, "list of strings"),
        (dict(recompute_ratio=1.5), ConfigError, r"recompute_ratio must be in \[0, 1\], got 1.5"),
        (dict(mode="fast"), ConfigError, "mode must be one of"),
        (dict(mode="full", recompute_ratio=0.2), ConfigError, "blend' only"),
        (dict(max_new_tokens=0), ConfigError, "max_new_tokens"),
        (dict(chunks=[random_words(70, 300), random_words(71, 300)]), PromptError, "exceeds the model's limit of 512"),
    ],
)
def test_bad_requests_get_clear_errors(engine, kwargs, error, match):
    chunks = kwargs.pop("chunks", [random_words(31, 20)])
    with pytest.raises(error, match=match):
        engine.generate(chunks, prefix=random_words(1, 4), suffix=random_words(2, 5), **kwargs)


@pytest.mark.parametrize("mode", ["full", "prefix", "reuse", "blend"])
def test_a_prompt_without_chunks_is_a_plain_full_prefill(engine, mode):
    plain = engine.generate([], prefix=random_words(1, 4), suffix=random_words(2, 5), mode="full", max_new_tokens=6)
    out = engine.generate([], prefix=random_words(1, 4), suffix=random_words(2, 5), mode=mode, max_new_tokens=6)
    assert out.token_ids == plain.token_ids
    assert out.metrics.mode == "full" and out.metrics.chunks_hit == out.metrics.chunks_missed == 0


def test_empty_question_and_missing_suffix_are_errors(engine):
    with pytest.raises(PromptError, match="question is empty"):
        engine.generate(["w1 w2"], "  ")
    with pytest.raises(PromptError, match="give a question"):
        engine.generate(["w1 w2"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(recompute_ratio=-0.1), r"recompute_ratio must be in \[0, 1\], got -0.1"),
        (dict(recompute_ratio=True), r"recompute_ratio must be a number, got True \(bool\)"),
        (dict(recompute_ratio=float("nan")), r"recompute_ratio must be in \[0, 1\], got nan"),
        (dict(rule="weighted-deviation"), "rule must be one of attention, paper, gradual, epic"),
    ],
)
def test_blend_config_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        BlendConfig(**kwargs)


def test_engine_config_validation():
    with pytest.raises(ConfigError, match="dtype must be one of"):
        EngineConfig(miss_policy="blend", dtype="int8")
    with pytest.raises(ConfigError, match="device must be"):
        EngineConfig(miss_policy="blend", device="tpu")
    assert EngineConfig(miss_policy="blend", dtype="bf16").dtype == "bfloat16"
    with pytest.raises(ConfigError, match="has layer 3, but the model has 2 layers"):
        CacheBlendEngine(
            make_tiny_model("llama", num_layers=2),
            make_tiny_tokenizer(),
            config=EngineConfig(miss_policy="blend", blend=blend_rule("gradual")),
        )


def test_gradual_schedule_falls_to_the_ratio():
    assert blend_rule("gradual", 0.2).schedule() == pytest.approx((0.3, 0.25, 0.2))
    assert blend_rule("paper", 0.2).schedule() == (0.2,)
    assert blend_rule("attention", 0.2).schedule() == ()
    assert SamplingParams(stop="x").stop == ("x",)


@pytest.mark.filterwarnings("ignore:this CPU has no bf16 instructions")  # the dtype is the point here, not speed
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_blend_stays_close_to_full(dtype):
    eng = CacheBlendEngine(
        make_tiny_model("qwen2"),
        make_tiny_tokenizer(),
        config=EngineConfig(miss_policy="blend", dtype=dtype, chunk_separator=""),
    )
    prompt = eng.build_prompt(
        [random_words(81, 20), random_words(82, 20)], prefix=random_words(1, 4), suffix=random_words(2, 5)
    )
    full = eng.prefill(prompt, "full").logits
    blend = eng.prefill(prompt, "blend", recompute_ratio=1.0).logits
    assert eng.store.get(eng.chunk_key(prompt.prefix_ids, prompt.chunk_ids[0])).dtype == getattr(torch, dtype)
    assert torch.argmax(full) == torch.argmax(blend)
    assert (full - blend).abs().max() < 0.1 * full.abs().max()


def test_a_damaged_store_entry_is_recomputed_not_used(caplog):
    from cacheblend_rag import ChunkKV

    eng = CacheBlendEngine(
        make_tiny_model("llama"), make_tiny_tokenizer(), config=EngineConfig(miss_policy="blend", chunk_separator="")
    )
    chunks = [random_words(91, 12), random_words(92, 12)]
    good = ask(eng, chunks, max_new_tokens=4)
    prompt = eng.build_prompt(chunks, prefix=random_words(1, 4), suffix=random_words(2, 5))
    key = eng.chunk_key(prompt.prefix_ids, prompt.chunk_ids[0])
    stored = eng.store.get(key)
    eng.store.put(ChunkKV(key, stored.keys[:, :, :5].clone(), stored.values[:, :, :5].clone()))  # truncated
    with caplog.at_level("WARNING"):
        again = ask(eng, chunks, max_new_tokens=4)
    assert "recomputing" in caplog.text
    assert again.metrics.chunks_missed == 1 and again.metrics.chunks_hit == 1
    assert again.token_ids == good.token_ids
    assert eng.store.get(key).num_tokens == 12


def test_chunks_come_back_from_the_disk_tier_in_a_new_engine(tmp_path):
    config = EngineConfig(miss_policy="blend", chunk_separator="", store=StoreConfig(disk_dir=str(tmp_path / "kv")))
    chunks = [random_words(101, 12), random_words(102, 12)]
    first = CacheBlendEngine(make_tiny_model("qwen2"), make_tiny_tokenizer(), config=config)
    a = ask(first, chunks, max_new_tokens=4)
    first.store.flush()  # written to disk in the background
    second = CacheBlendEngine(make_tiny_model("qwen2"), make_tiny_tokenizer(), config=config)  # a new worker
    b = ask(second, chunks, max_new_tokens=4)
    assert a.metrics.chunks_missed == 2
    assert b.metrics.chunks_hit == 2 and b.metrics.hits_by_tier == {"disk": 2}
    assert "disk 2" in b.metrics.summary()
    assert a.token_ids == b.token_ids
    c = ask(second, chunks, max_new_tokens=4)
    assert c.metrics.hits_by_tier == {"memory": 2}  # promoted on the disk hit


def test_engine_config_checks_the_redis_url():
    with pytest.raises(ConfigError, match="redis_url must start with"):
        EngineConfig(miss_policy="blend", store=StoreConfig(redis_url="localhost:6379"))


def test_a_closed_stream_stops_generating(engine):
    stream = engine.stream(
        [random_words(31, 20)], prefix=random_words(1, 4), suffix=random_words(2, 5), max_new_tokens=50
    )
    with stream:
        first = next(stream)
    assert first and stream.result is None
    with pytest.raises(StopIteration):
        next(stream)
