"""Which thread serves a request: its own reader while it is alone, the worker thread once another one arrives.

A request alone runs on the thread that reads it (on a CPU, PyTorch's thread pool of that thread stays the only
busy one, which keeps its operations fast), and a thread that stops computing lets its pool go
(`release_thread_pool`). These tests check that this changes nothing a caller can see: the same answers, a second
request from another thread is served at once (by the worker), an abandoned or interrupted lone request holds up
nothing, `close()` ends a lone request that is half read, and torch works as before after a pool is let go.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, EngineClosedError, EngineConfig, ServingConfig
from cacheblend_rag.engine.serving.thread_pools import release_thread_pool
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

CHUNKS = [random_words(900 + i, 24) for i in range(3)]


def engine_for(max_batch: int = 4) -> CacheBlendEngine:
    engine = CacheBlendEngine(
        make_tiny_model("qwen2", mute_eos=True),
        make_tiny_tokenizer(),
        config=EngineConfig(chunk_separator="", serving=ServingConfig(max_batch_size=max_batch)),
    )
    engine.precompute(CHUNKS, prefix=random_words(1, 3))
    return engine


def args(i: int, new_tokens: int = 6) -> dict:
    return dict(prefix=random_words(1, 3), suffix=random_words(50 + i, 4), max_new_tokens=new_tokens)


def spy_steps(engine: CacheBlendEngine) -> list[str]:
    """The name of the thread that runs each decode step, from now on."""
    names: list[str] = []
    step = engine.scheduler.decoder.step_slots

    def spy(*a, **k):
        names.append(threading.current_thread().name)
        return step(*a, **k)

    engine.scheduler.decoder.step_slots = spy
    return names


def scheduler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "cacheblend-scheduler" and t.is_alive()]


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_release_thread_pool_ends_the_calling_threads_openmp_threads_and_torch_goes_on():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        product = torch.ones(512, 512) @ torch.ones(512, 512)  # a parallel operation: this thread's pool exists
        with_pool = os_threads()
        if not release_thread_pool():
            pytest.skip("torch does not run on GNU OpenMP here")
        assert os_threads() < with_pool
        assert torch.equal(torch.ones(512, 512) @ torch.ones(512, 512), product)  # a new pool, the same result
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("one_thread")
def test_a_lone_request_is_served_on_its_callers_thread_with_the_same_answer():
    want = [engine_for(1).generate(CHUNKS, **args(i)).token_ids for i in range(2)]
    engine = engine_for()
    steps = spy_steps(engine)
    before = set(scheduler_threads())
    got = engine.generate(CHUNKS, **args(0)).token_ids
    stream = engine.stream(CHUNKS, **args(1))
    "".join(stream)
    assert [got, stream.result.token_ids] == want
    assert steps and set(steps) == {threading.current_thread().name}
    assert not set(scheduler_threads()) - before  # no worker was needed


@pytest.mark.usefixtures("one_thread")
def test_a_second_request_hands_both_to_the_worker_and_answers_stay_as_alone():
    serial = engine_for(1)
    want_first = serial.generate(CHUNKS, **args(0, 30)).token_ids
    want_second = serial.generate(CHUNKS[:2], **args(1)).token_ids
    engine = engine_for()
    steps = spy_steps(engine)
    first = engine.stream(CHUNKS, **args(0, 30))
    next(first)  # served here, alone, up to its first delta
    served_here = len(steps)
    box: dict = {}
    other = threading.Thread(target=lambda: box.update(r=engine.generate(CHUNKS[:2], **args(1))))
    other.start()
    other.join(60)  # answered while the first stream is not read: the worker serves it
    assert not other.is_alive() and box["r"].token_ids == want_second
    "".join(first)
    assert first.result.token_ids == want_first
    assert set(steps[:served_here]) <= {threading.current_thread().name}
    assert "cacheblend-scheduler" in steps[served_here:]
    assert engine.scheduler.largest_batch == 2


def settled(engine, timeout_s: float = 5.0) -> bool:
    """Whether the scheduler has dropped every job within `timeout_s`: an ended job is dropped at the server's next
    turn, which may come just after its reader got the answer."""
    for _ in range(int(timeout_s / 0.01)):
        if engine.scheduler.busy == 0:
            return True
        threading.Event().wait(0.01)
    return engine.scheduler.busy == 0


@pytest.mark.usefixtures("one_thread")
def test_requests_that_come_and_go_from_several_threads_are_all_served_as_alone():
    """Many lone-to-worker hand-overs and lone requests that start while the previous one's reader ends its turn."""
    serial = engine_for(1)
    want = {(t, i): serial.generate(CHUNKS[: 1 + (t + i) % 3], **args(10 * t + i, 3)).token_ids
            for t in range(4) for i in range(5)}  # fmt: skip
    engine = engine_for()
    got: dict = {}

    def client(t: int) -> None:
        for i in range(5):
            threading.Event().wait(0.001 * ((t * 7 + i * 3) % 5))  # stagger the arrivals
            got[(t, i)] = engine.generate(CHUNKS[: 1 + (t + i) % 3], **args(10 * t + i, 3)).token_ids

    clients = [threading.Thread(target=client, args=(t,)) for t in range(4)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(120)
    assert not any(c.is_alive() for c in clients), "a request was left with no one serving it"
    assert got == want
    assert settled(engine)


@pytest.mark.usefixtures("one_thread")
def test_an_unread_lone_stream_holds_up_no_later_request():
    engine = engine_for()
    want = engine_for(1).generate(CHUNKS, **args(3)).token_ids
    unread = engine.stream(CHUNKS, **args(2, 40))  # never read, never closed
    box: dict = {}
    other = threading.Thread(target=lambda: box.update(r=engine.generate(CHUNKS, **args(3))))
    other.start()
    other.join(60)
    assert not other.is_alive() and box["r"].token_ids == want
    unread.close()


@pytest.mark.usefixtures("one_thread")
def test_an_interrupted_lone_request_ends_and_the_engine_goes_on():
    engine = engine_for()
    want = engine.generate(CHUNKS, **args(4)).token_ids
    step = engine.scheduler.decoder.step_slots
    calls = {"n": 0}

    def interrupted(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return step(*a, **k)

    engine.scheduler.decoder.step_slots = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.generate(CHUNKS, **args(5, 20))
    assert engine.generate(CHUNKS, **args(4)).token_ids == want
    assert settled(engine)


@pytest.mark.usefixtures("one_thread")
def test_close_ends_a_half_read_lone_stream_with_a_clear_error():
    engine = engine_for()
    stream = engine.stream(CHUNKS, **args(6, 200))
    assert isinstance(next(stream), str)
    engine.close(timeout=30)
    with pytest.raises(EngineClosedError, match="stopped before this request was answered"):
        stream.collect()
    with pytest.raises(EngineClosedError, match="no new request"):
        engine.generate(CHUNKS, **args(7))
