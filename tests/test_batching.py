"""Batched decoding gives each request what it gets alone: the step's math, then the engine's answers.

The step is checked against the model's own forward (transformers, one request, `DynamicCache`) at every step, for
batch sizes 1-8 of prompts of mixed lengths, with requests joining and leaving the batch. The engine is checked by
answers: many threads and asyncio tasks at once give the answers of the same requests served one at a time, on tiny
models and, for 16 concurrent greedy requests, on SmolLM2-135M.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import DynamicCache

from cacheblend_rag import CacheBlendEngine, EngineConfig, ServingConfig
from cacheblend_rag.engine.serving.batch_decode import BatchDecoder, DecodeCache
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.models.adapter import LayerwiseModel
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words


class Alone:
    """One request decoded by the model's own forward: the reference a batched row must equal."""

    def __init__(self, model, ids: torch.Tensor) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=ids.unsqueeze(0), cache=self.cache, use_cache=True)
        self.length = ids.numel()

    def step(self, token: int) -> torch.Tensor:
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([[token]]),
                position_ids=torch.tensor([[self.length]]),
                cache=self.cache,
                use_cache=True,
            )
        self.length += 1
        return out.logits[0, -1].float()


def prompt_cache(model, ids: torch.Tensor, room: int) -> DecodeCache:
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids.unsqueeze(0), cache=cache, use_cache=True)
    return DecodeCache(cache, ids.numel(), ids.numel() + room)


@pytest.mark.parametrize("batch", [1, 2, 5, 8])
def test_a_batched_step_equals_each_request_alone(family, batch):
    model = make_tiny_model(family)
    decoder = BatchDecoder(LayerwiseModel(model))
    g = torch.Generator().manual_seed(batch)
    lengths = [3 + 7 * b for b in range(batch)]  # mixed lengths
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in lengths]
    alone = [Alone(model, ids) for ids in prompts]
    caches = [prompt_cache(model, ids, room=6) for ids in prompts]
    tokens = [int(ids[-1]) for ids in prompts]
    for _ in range(6):
        got = decoder.step(tokens, caches)
        for b in range(batch):
            want = alone[b].step(tokens[b])
            torch.testing.assert_close(got[b], want, atol=1e-4, rtol=1e-4)
        tokens = [int(row.argmax()) for row in got]


def test_requests_join_and_leave_the_batch_mid_answer(family):
    model = make_tiny_model(family)
    decoder = BatchDecoder(LayerwiseModel(model))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (4, 11, 19, 6)]
    alone = [Alone(model, ids) for ids in prompts]
    caches = [prompt_cache(model, ids, room=12) for ids in prompts]
    tokens = {b: int(ids[-1]) for b, ids in enumerate(prompts)}
    # who is in the batch at each step: 0 alone, 1 joins, 2 joins, 0 leaves, 3 joins, 1 leaves
    schedule = [[0], [0, 1], [0, 1, 2], [1, 2], [1, 2, 3], [2, 3], [3]]
    for members in schedule:
        got = decoder.step([tokens[b] for b in members], [caches[b] for b in members])
        for row, b in enumerate(members):
            torch.testing.assert_close(got[row], alone[b].step(tokens[b]), atol=1e-4, rtol=1e-4)
            tokens[b] = int(got[row].argmax())


def test_a_full_decode_cache_says_so():
    model = make_tiny_model("llama")
    cache = prompt_cache(model, torch.tensor([5, 6, 7]), room=1)
    decoder = BatchDecoder(LayerwiseModel(model))
    decoder.step([3], [cache])
    with pytest.raises(RuntimeError, match="full"):
        decoder.step([3], [cache])


def engine_for(max_batch: int, tmp_path=None) -> CacheBlendEngine:
    return CacheBlendEngine(
        make_tiny_model("qwen2", mute_eos=True),
        make_tiny_tokenizer(),
        config=EngineConfig(miss_policy="blend", chunk_separator="", serving=ServingConfig(max_batch_size=max_batch)),
    )


POOL = [random_words(300 + i, 10) for i in range(6)]


def request_args(i: int) -> tuple[list[str], dict]:
    mode = ("blend", "full", "reuse")[i % 3]
    chunks = [POOL[i % 6], POOL[(i + 2) % 6]][: 1 + i % 2]
    args = dict(prefix=random_words(1, 3), suffix=random_words(i, 4), mode=mode, max_new_tokens=4 + i % 5)
    if i % 4 == 3:
        args.update(temperature=0.8, seed=i)  # sampling stays per request
    return chunks, args


def test_concurrent_threads_decode_together_and_answer_as_alone():
    serial_engine = engine_for(1)
    serial = [serial_engine.generate(c, **a).token_ids for c, a in map(request_args, range(16))]
    engine = engine_for(8)
    barrier = threading.Barrier(8)

    def ask(i: int) -> list[int]:
        if i < 8:
            barrier.wait()
        chunks, args = request_args(i)
        if i % 2:
            stream = engine.stream(chunks, **args)
            "".join(stream)
            return stream.result.token_ids
        return engine.generate(chunks, **args).token_ids

    with ThreadPoolExecutor(max_workers=8) as pool:
        together = list(pool.map(ask, range(16)))
    assert together == serial
    assert engine.scheduler.largest_batch > 1  # they really were decoded together
    assert serial_engine.scheduler.largest_batch == 1
    for _ in range(200):  # their KV pool is let go once the last one ends
        if engine.scheduler.decode_pool == (0, 0):
            break
        threading.Event().wait(0.01)
    assert engine.scheduler.decode_pool == (0, 0)


def test_a_decoding_request_holds_a_slot_of_the_pool_and_gives_it_back():
    engine = engine_for(4)
    chunks, args = request_args(0)
    stream = engine.stream(chunks, **{**args, "max_new_tokens": 8})
    next(iter(stream))
    slots, positions = engine.scheduler.decode_pool
    assert slots >= 1 and positions >= engine.build_prompt(chunks, prefix=args["prefix"],
                                                           suffix=args["suffix"]).num_tokens + 8  # fmt: skip
    stream.close()  # abandoned mid-answer: its slot goes back at the next turn, and the pool with it
    assert engine.generate(chunks, **args).token_ids
    assert engine.scheduler.decode_pool == (0, 0)


def test_asyncio_tasks_overlap_and_answer_as_alone():
    serial_engine = engine_for(1)
    serial = [serial_engine.generate(c, **a).text for c, a in map(request_args, range(10))]
    engine = engine_for(4)

    async def main() -> list[str]:
        async def streamed(i: int) -> str:
            chunks, args = request_args(i)
            parts = [delta async for delta in engine.astream(chunks, **args)]
            return "".join(parts)

        async def whole(i: int) -> str:
            chunks, args = request_args(i)
            return (await engine.agenerate(chunks, **args)).text

        return await asyncio.gather(*((streamed if i % 2 else whole)(i) for i in range(10)))

    assert asyncio.run(main()) == serial
    assert engine.scheduler.largest_batch > 1


def test_an_abandoned_stream_leaves_the_batch_and_never_blocks_the_others():
    engine = engine_for(4)
    chunks, args = request_args(0)
    args["max_new_tokens"] = 40
    want = engine_for(1).generate(*request_args(1)[:1], **request_args(1)[1]).token_ids
    left = engine.stream(chunks, **args)
    next(left)  # read one delta, then never again
    other = engine.generate(*request_args(1)[:1], **request_args(1)[1])
    assert other.token_ids == want
    left.close()
    assert left.result is None
    for _ in range(200):  # the worker drops the job at its next step, then stops
        if engine.scheduler.busy == 0:
            break
        threading.Event().wait(0.01)
    assert engine.scheduler.busy == 0


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(monkeypatch):
    engine = engine_for(2)
    chunks, args = request_args(1)
    want = engine.generate(chunks, **args).token_ids
    real = engine.scheduler.decoder.step_slots
    calls = {"n": 0}

    def flaky(tokens, pool, slots):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("out of memory (simulated)")
        return real(tokens, pool, slots)

    monkeypatch.setattr(engine.scheduler.decoder, "step_slots", flaky)
    with pytest.raises(RuntimeError, match="simulated"):
        engine.generate(chunks, **args)
    assert engine.generate(chunks, **args).token_ids == want


def test_max_batch_size_is_checked():
    with pytest.raises(ConfigError, match="max_batch_size"):
        ServingConfig(max_batch_size=0)


def test_int8_decode_rows_are_batch_invariant_and_close_to_exact(family):
    from cacheblend_rag.models.int8 import int8_decode_lm

    model = make_tiny_model(family)
    int8 = BatchDecoder(int8_decode_lm(model))
    exact = BatchDecoder(LayerwiseModel(model))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (4, 9, 15, 6)]
    tokens = [int(ids[-1]) for ids in prompts]
    together = int8.step(tokens, [prompt_cache(model, ids, 2) for ids in prompts])
    for b, ids in enumerate(prompts):  # bit for bit what the row gets alone
        assert torch.equal(together[b], int8.step([tokens[b]], [prompt_cache(model, ids, 2)])[0])
    reference = exact.step(tokens, [prompt_cache(model, ids, 2) for ids in prompts])
    assert float((together - reference).norm() / reference.norm()) < 0.1  # int8 weights: close, not equal


def test_fused_int8_products_give_the_outputs_of_the_products_they_replace(family):
    from cacheblend_rag.models.int8 import int8_decode_lm, int8_decode_model

    model = make_tiny_model(family)
    fused = BatchDecoder(int8_decode_lm(model))
    plain = BatchDecoder(LayerwiseModel(int8_decode_model(model)))
    assert fused.lm.fused_qkv is not None and plain.lm.fused_qkv is None
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (5, 11, 3)]
    tokens = [int(ids[-1]) for ids in prompts]
    a, b = [prompt_cache(model, ids, 3) for ids in prompts], [prompt_cache(model, ids, 3) for ids in prompts]
    for _ in range(3):  # three steps: the keys and values each writes are the same too
        want, got = plain.step(tokens, a), fused.step(tokens, b)
        assert torch.equal(got, want)
        tokens = [int(t) for t in want.argmax(-1)]


def test_int8_products_on_many_threads_each_get_their_own_rows():
    """An int8 product writes its scaled input into a buffer it reuses; two threads running products of the same
    shape at once must not see each other's rows. Large inputs (a prompt's rows) are not kept, and agree too."""
    from torch import nn

    from cacheblend_rag.models.int8 import Int8Linear

    torch.manual_seed(0)
    product = Int8Linear(nn.Linear(64, 48))
    inputs = [torch.randn(3, 64) * (i + 1) for i in range(4)]
    want = [product(x) for x in inputs]
    barrier = threading.Barrier(4)

    def run(i: int) -> bool:
        barrier.wait()
        return all(torch.equal(product(inputs[i]), want[i]) for _ in range(200))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(run, range(4)))
    prompt = torch.randn(100, 64)
    rows = torch.cat([product(prompt[i : i + 1]) for i in range(100)])
    assert torch.equal(product(prompt), rows)  # each of 100 rows as it is alone


def test_an_engine_with_int8_decode_weights_keeps_the_exact_first_token():
    chunks, args = request_args(0)
    exact = engine_for(2).generate(chunks, **args)
    engine = CacheBlendEngine(
        make_tiny_model("qwen2", mute_eos=True),
        make_tiny_tokenizer(),
        config=EngineConfig(miss_policy="blend", chunk_separator="", serving=ServingConfig(decode_weights="int8")),
    )
    fast = engine.generate(chunks, **args)
    assert fast.token_ids[0] == exact.token_ids[0]  # from the prefill, which keeps the exact weights
    assert len(fast.token_ids) == len(exact.token_ids)


def test_decode_weights_are_checked():
    with pytest.raises(ConfigError, match="decode_weights"):
        ServingConfig(decode_weights="int4")
    with pytest.raises(ConfigError, match="CPU"):
        EngineConfig(device="cuda", serving=ServingConfig(decode_weights="int8"))


PASSAGES = [
    "The kingdom of Zorbania lies in the northern mountains. Its capital is Quillton, on the river Vess.",
    "Zorbania exports wool, copper and a blue cheese called vessa. The copper mines are in the east.",
    "The national sport of Zorbania is ice rowing. The yearly championship is held on Lake Marn.",
    "Queen Ilsa the Second founded the university of Quillton in 1388. It teaches law and medicine.",
]
ASKED = ["What is the capital?", "What does Zorbania export?", "Where is the championship?", "Who founded it?"]


@pytest.mark.real_model
def test_sixteen_concurrent_greedy_answers_on_a_real_model_equal_each_served_alone():
    """16 threads at once on SmolLM2-135M: every greedy answer, token for token, is the one the same request gets
    with max_batch_size=1 (the load benchmark's --check-serial, on a model whose logits have near ties)."""
    engine = CacheBlendEngine.from_pretrained(
        "smollm2-135m-instruct", config=EngineConfig(serving=ServingConfig(max_batch_size=16)), show_progress=False
    )
    alone = CacheBlendEngine(
        engine.model, engine.tokenizer, config=EngineConfig(serving=ServingConfig(max_batch_size=1)), store=engine.store
    )
    engine.precompute(PASSAGES)  # warm: every request blends stored chunks, alone or not
    requests = [([PASSAGES[i % 4], PASSAGES[(i + 1 + i // 4) % 4]], ASKED[i // 4]) for i in range(16)]
    serial = [alone.generate(chunks, q, max_new_tokens=12).token_ids for chunks, q in requests]
    barrier = threading.Barrier(16)

    def ask(i: int) -> list[int]:
        barrier.wait()
        stream = engine.stream(*requests[i], max_new_tokens=12)
        "".join(stream)
        return stream.result.token_ids

    with ThreadPoolExecutor(max_workers=16) as pool:
        together = list(pool.map(ask, range(16)))
    differing = [i for i in range(16) if together[i] != serial[i]]
    assert not differing, f"{len(differing)} of 16 answers differ from the request served alone: {differing}"
    assert engine.scheduler.largest_batch > 1  # they really were decoded together


def test_greedy_rows_of_a_step_are_picked_at_once_as_each_alone():
    from cacheblend_rag.engine.serving.tokens import greedy_tokens

    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[2, [7, 31]] = 100.0  # a tie: the lower id, as the row's own argmax gives
    greedy = [True, False, True, True, False, True]
    picked = greedy_tokens(logits, greedy)
    assert picked == {i: int(torch.argmax(logits[i])) for i, g in enumerate(greedy) if g}
    assert picked[2] == 7
    assert greedy_tokens(logits, [False] * 6) == {}
    assert greedy_tokens(logits, [True] * 6) == {i: int(torch.argmax(row)) for i, row in enumerate(logits)}


def test_a_sampled_request_refuses_a_token_picked_for_it():
    from cacheblend_rag.engine.request.request import SamplingParams
    from cacheblend_rag.engine.serving.decoding import TokenLoop

    loop = TokenLoop(make_tiny_tokenizer(), {2}, SamplingParams(max_new_tokens=4, temperature=0.7, seed=1), "cpu")
    with pytest.raises(ValueError, match="picks its own tokens"):
        loop.take(5)
