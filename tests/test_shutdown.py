"""Stopping the engine: `close()`, and the exit hook that stops its worker threads before the interpreter finalizes.

A daemon thread still inside torch when Python finalizes aborts the process after the script's last line ran
("terminate called without an active exception"). The exit hook must leave no worker thread alive, whatever was
still queued or decoding; `close()` must end every open request with a clear error and refuse later ones.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from cacheblend_rag import CacheBlendEngine, EngineClosedError, EngineConfig
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

WORKERS = ("cacheblend-scheduler", "cacheblend-deferred-fills")


def workers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name in WORKERS and t.is_alive()}


def tiny_engine(**config) -> CacheBlendEngine:
    return CacheBlendEngine(
        make_tiny_model("llama", mute_eos=True),
        make_tiny_tokenizer(),
        config=EngineConfig(chunk_separator="", **config),
    )


def chunks(seed: int) -> list[str]:
    return [random_words(seed * 10 + i, 20) for i in range(3)]


def test_close_ends_open_requests_with_a_clear_error_and_refuses_new_ones():
    before = workers()  # other tests' engines may still have theirs
    engine = tiny_engine()
    streams = [engine.stream(chunks(i), random_words(100 + i, 4), max_new_tokens=300) for i in range(3)]
    first = next(iter(streams[0]))  # the worker is serving
    assert isinstance(first, str)
    engine.close(timeout=30)
    for stream in streams:
        with pytest.raises(EngineClosedError, match="stopped before this request was answered"):
            stream.collect()
    with pytest.raises(EngineClosedError, match="no new request"):
        engine.generate(chunks(9), "a question", max_new_tokens=2)
    assert not workers() - before


def test_close_drops_queued_fills_and_nothing_waits_for_them():
    before = workers()
    engine = tiny_engine(miss_policy="full", chunk_context="isolated")
    for i in range(4):  # cold requests: their chunks are queued to be prefilled and stored after each answer
        engine.generate(chunks(i), "a question", max_new_tokens=1)
    engine.close(timeout=30)
    assert engine.wait_for_fills(timeout=5)  # dropped, not pending forever
    assert not workers() - before


SCRIPT = """
import atexit, threading
# registered first, so it runs last: after the engine's own exit hook
atexit.register(lambda: print("alive at exit:", sorted(
    t.name for t in threading.enumerate() if t.name.startswith("cacheblend") and t.is_alive())))
from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words
engine = CacheBlendEngine(make_tiny_model("llama", mute_eos=True), make_tiny_tokenizer(),
                          config=EngineConfig(chunk_separator="", miss_policy="full", chunk_context="isolated"))
engine.generate([random_words(i, 40) for i in range(4)], "a question", max_new_tokens=1)  # queues 4 fills
streams = [engine.stream([random_words(50 + i, 40)], "a question", max_new_tokens=300) for i in range(3)]
print("first:", repr(next(iter(streams[0]))))
# the script ends with requests decoding and chunks queued
"""


def test_a_script_that_ends_mid_work_exits_cleanly_with_no_worker_left():
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "first:" in done.stdout
    assert "alive at exit: []" in done.stdout, done.stdout


def test_the_fills_thread_ends_when_idle_and_starts_again_with_new_work(monkeypatch):
    import time

    from cacheblend_rag.engine.serving import deferred_fills as fills

    monkeypatch.setattr(fills, "IDLE_S", 0.1)
    before = workers()
    engine = tiny_engine(miss_policy="full", chunk_context="isolated")
    for i in range(2):
        engine.generate(chunks(20 + i), "a question", max_new_tokens=1)
        assert engine.wait_for_fills(timeout=30)
        deadline = time.monotonic() + 10
        while workers() - before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not workers() - before  # an idle engine holds no thread
    key = engine.prompt_keys(engine.build_prompt(chunks(21), "a question"))[-1]
    assert key in engine.store  # the second request's fills ran on a thread started again
