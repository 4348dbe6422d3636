"""Faults of the fifth probe: a full disk at start-up, a request cancelled during its prefill, a link loop in a
documents folder, an engine used after `close()`, Redis URLs that fail before any connection, and an untrusted
pickle in a model folder. Each test is the probe's reproducer on tiny models, with the behaviour it must keep."""

from __future__ import annotations

import asyncio
import errno
import inspect
import logging
import os
import socket
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pytest

from cacheblend_rag import CacheBlendEngine, EngineClosedError, EngineConfig, StoreConfig
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store import DiskStore, MemoryStore
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

EXACT_CODEC = "native"


def engine_on(num_layers: int = 6, **tiers) -> CacheBlendEngine:
    settings = StoreConfig(**{"memory_budget_bytes": 0, "kv_codec": EXACT_CODEC, **tiers})
    config = EngineConfig(miss_policy="blend", chunk_separator="", store=settings)
    return CacheBlendEngine(make_tiny_model("qwen2", num_layers=num_layers), make_tiny_tokenizer(), config=config)


def chunks_of(seed: int, n: int = 2, words: int = 40) -> list[str]:
    return [random_words(seed * 10 + i, words) for i in range(n)]


def ask(engine, chunks, **options):
    return engine.generate(chunks, prefix=random_words(1, 4), suffix=random_words(2, 5), max_new_tokens=4, **options)


# ---------------------------------------------------------------- R4: an engine used after close()


def test_every_public_method_of_a_closed_engine_raises_and_writes_nothing(tmp_path):
    engine = engine_on(disk_dir=str(tmp_path / "kv"), memory_budget_bytes=2**24)
    ask(engine, chunks_of(1))
    engine.store.flush()
    prompt = engine.build_prompt(chunks_of(1), "a question")
    pre = engine.prefill(prompt)
    engine.wait_for_fills()
    engine.store.flush()
    puts = engine.store.tier_stats()["disk"].puts
    memory = engine.store.tiers[0]
    assert len(memory) > 0
    engine.close()
    engine.close()  # a second close does nothing

    async def agenerate():
        return await engine.agenerate(chunks_of(2), "q")

    calls = {
        "generate": lambda: engine.generate(chunks_of(2), "q"),
        "stream": lambda: engine.stream(chunks_of(2), "q"),
        "agenerate": lambda: asyncio.run(agenerate()),
        "astream": lambda: engine.astream(chunks_of(2), "q"),
        "prefill": lambda: engine.prefill(prompt),
        "extend": lambda: engine.extend(pre, [3, 4]),
        "precompute": lambda: engine.precompute(chunks_of(3)),
        "precompute_groups": lambda: engine.precompute_groups([chunks_of(3)]),
        "set_chunk_context": lambda: engine.set_chunk_context(chunks_of(3), None),
        "build_prompt": lambda: engine.build_prompt(chunks_of(2), "q"),
        "check_length": lambda: engine.check_length(prompt),
        "chunk_key": lambda: engine.chunk_key(prompt.prefix_ids, prompt.chunk_ids[0]),
        "placements": lambda: engine.placements(prompt),
        "prompt_keys": lambda: engine.prompt_keys(prompt),
        "clear_store": lambda: engine.clear_store(),
    }
    public = {n for n, v in inspect.getmembers(CacheBlendEngine, inspect.isfunction) if not n.startswith("_")}
    assert set(calls) == public - {"close", "wait_for_fills"}, "a new public method: add it here and check it"
    for name, call in calls.items():
        with pytest.raises(EngineClosedError, match=f"^{name}: the engine is closed"):
            call()
    with pytest.raises(EngineClosedError, match="^store: the engine is closed"):
        engine.store = MemoryStore(2**20)
    assert engine.wait_for_fills(timeout=5)  # nothing is left to wait for
    assert engine.store.tier_stats()["disk"].puts == puts
    assert len(memory) == 0  # close() closed the store: the memory tier let its entries go
    reopened = DiskStore(tmp_path / "kv", codec=EXACT_CODEC)
    assert len(reopened) == puts  # nothing written after close
    reopened.close()


# ---------------------------------------------------------------- R3: a link loop in a documents folder


def looping_docs(root: Path) -> Path:
    root.mkdir()
    (root / "a.txt").write_text(random_words(1, 12))
    (root / "sub").mkdir()
    (root / "sub" / "b.txt").write_text(random_words(2, 9))
    os.symlink("self", root / "self")  # a link to itself: ELOOP on every stat
    os.symlink("loop.txt", root / "sub" / "loop.txt")
    os.symlink(".", root / "here")  # a link back to the folder: walked once
    return root


def test_a_link_loop_in_the_docs_folder_is_skipped_with_one_warning_line(tmp_path, caplog):
    from cacheblend_rag.retrieval import load_documents

    docs = looping_docs(tmp_path / "docs")
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.retrieval"):
        got = load_documents(docs)
    assert [d.source for d in got] == ["a.txt", "sub/b.txt"]
    warnings = [r.getMessage() for r in caplog.records if "resolve to no file" in r.getMessage()]
    assert len(warnings) == 1 and "'self'" in warnings[0] and "'sub/loop.txt'" in warnings[0], warnings


def test_the_command_line_reads_a_docs_folder_with_a_link_loop(tmp_path, capsys, caplog, tiny_model_dir):
    from cacheblend_rag.cli import main

    docs = looping_docs(tmp_path / "docs")
    out = tmp_path / "index"
    args = ["index", "--docs", str(docs), "--out", str(out), "--model", str(tiny_model_dir), "--chunk-tokens", "16"]
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.retrieval"):
        assert main(args) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Errno 40" not in err
    # one warning line (stderr outside pytest, which captures log records instead)
    assert sum("resolve to no file" in r.getMessage() for r in caplog.records) == 1


# ---------------------------------------------------------------- R5: Redis URLs that cannot work


def dead_port() -> int:
    """A loopback port nothing listens on (bound once to learn a free one, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_redis_port_out_of_range_is_a_config_error_before_a_model_loads(capsys, no_model_loads):
    from cacheblend_rag.cli import main

    with pytest.raises(ConfigError, match=r"redis_url 'redis://:\*\*\*@127.0.0.1:99999/0' has no usable port") as err:
        StoreConfig(redis_url="redis://:secret@127.0.0.1:99999/0")
    assert "secret" not in str(err.value) and "check the port" in str(err.value)
    assert main(["ask", "--docs", ".", "--redis-url", "redis://:secret@127.0.0.1:99999/0", "q?"]) == 2
    out = capsys.readouterr().err
    assert out.startswith("error: ") and "no usable port" in out and "secret" not in out and "Traceback" not in out


def test_an_unreachable_redis_cluster_is_a_config_error_naming_the_url_without_its_password():
    url = f"redis://:secret@127.0.0.1:{dead_port()}/0?cluster=1"
    config = EngineConfig(store=StoreConfig(memory_budget_bytes=0, redis_url=url))
    with pytest.raises(ConfigError, match="cannot reach the Redis Cluster at redis://:\\*\\*\\*@127.0.0.1") as err:
        CacheBlendEngine(make_tiny_model("qwen2", num_layers=2), make_tiny_tokenizer(), config=config)
    assert "secret" not in str(err.value) and "check that a node" in str(err.value)
    assert err.value.__cause__ is None  # redis-py's own exception is not chained under it


# ---------------------------------------------------------------- R6: an untrusted pickle in a model folder


class _Payload:
    """Pickles as a call of os.system: what torch's weights_only loading must refuse without running it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_an_untrusted_pytorch_model_bin_is_the_packages_error_and_runs_no_code(tmp_path, capsys):
    import torch

    from cacheblend_rag.cli import main
    from cacheblend_rag.errors import ModelNotFoundError
    from cacheblend_rag.models import load_model

    folder, marker = tmp_path / "model", tmp_path / "code-ran"
    model = make_tiny_model("llama", num_layers=2)
    model.save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    torch.save({**model.state_dict(), "payload": _Payload(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(ModelNotFoundError, match=r"a pickle \(pytorch_model.bin\).*weights_only.*safetensors"):
        load_model(str(folder))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(random_words(1, 12))
    capsys.readouterr()
    assert main(["ask", "--docs", str(tmp_path / "docs"), "--model", str(folder), "q?"]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "safetensors" in err and "UnpicklingError" not in err and "Traceback" not in err
    assert not marker.exists()


# ---------------------------------------------------------------- R1: a store whose filesystem is full at start-up

MB = 1024**2
BIG = 1024  # tokens: above diskcache's 32 KiB threshold, so the entry is a value file


@pytest.fixture
def small_filesystem(tmp_path):
    """A 2 MB tmpfs, mounted for the test (as root, where mounting is allowed: CI runs so)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a 2 MB tmpfs needs root (CI runs as root); the simulated full disk is tested apart")
    mount = tmp_path / "small"
    mount.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not allowed here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill_up(folder: Path) -> Path:
    """A file taking every byte left on `folder`'s filesystem."""
    ballast = folder / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, bytes(64 * 1024))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    try:
        while True:
            os.write(fd, bytes(512))
    except OSError:
        pass
    finally:
        os.close(fd)
    return ballast


def full_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is full" in r.getMessage() and "pausing" in r.getMessage()]


def test_an_engine_on_a_store_whose_filesystem_is_full_starts_and_serves_what_is_stored(small_filesystem, caplog):
    folder = str(small_filesystem / "kv")
    first = engine_on(num_layers=2, disk_dir=folder)
    expected = ask(first, chunks_of(1))
    first.close()
    fill_up(small_filesystem)
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.store"):
        engine = engine_on(num_layers=2, disk_dir=folder)
        got = ask(engine, chunks_of(1))
        cold = [ask(engine, chunks_of(seed)) for seed in (2, 3)]
    assert got.text == expected.text and got.metrics.hits_by_tier == {"disk": 2}
    assert all(r.metrics.chunks_missed == 2 for r in cold)
    disk = engine.store.tier_stats()["disk"]
    assert disk.errors == 1 and disk.puts == 0 and disk.skipped >= 4, disk  # the failed open, then no write tried
    assert len(full_lines(caplog)) == 1, full_lines(caplog)
    engine.close()


@pytest.fixture
def open_says_full(monkeypatch):
    """diskcache's open (which writes its settings) fails in the folders added to the set, as on a full disk."""
    import diskcache

    folders: set[str] = set()
    init = diskcache.Cache.__init__

    def failing_init(cache, directory=None, *args, **kwargs):
        if os.fspath(directory) in folders:
            raise sqlite3.OperationalError("database or disk is full")
        init(cache, directory, *args, **kwargs)

    monkeypatch.setattr(diskcache.Cache, "__init__", failing_init)
    return folders


def test_a_store_opened_on_a_full_disk_serves_its_entries_and_writes_once_there_is_room(
    tmp_path, open_says_full, caplog
):
    from store_helpers import make_kv, same

    folder = tmp_path / "kv"
    entries = [make_kv("small"), make_kv("big", tokens=BIG)]
    store = DiskStore(folder, budget_bytes=10 * MB, codec=EXACT_CODEC)
    for kv in entries:
        store.put(kv)
    store.close()
    open_says_full.add(str(folder))
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.store"):
        store = DiskStore(folder, budget_bytes=10 * MB, codec=EXACT_CODEC, write_pause_s=0.2)
        assert len(store) == 2 and store.nbytes > 0
        for kv in entries:
            assert same(store.get(kv.key), kv)
            hit = store.open(kv.key)
            assert hit is not None and same(hit.kv.materialize(), kv)
        new = make_kv("new", seed=1)
        store.put(new)  # paused: skipped
        assert store.stats.errors == 1 and store.stats.skipped == 1 and store.stats.puts == 0
        time.sleep(0.25)
        store.put(new)  # the pause is over: one try, which fails
        assert store.stats.errors == 2 and store.get("new") is None
        open_says_full.clear()  # room again
        time.sleep(0.25)
        store.put(new)
    assert same(store.get("new"), new) and store.stats.puts == 1
    assert len(full_lines(caplog)) == 1, full_lines(caplog)
    assert sum("takes writes again" in r.getMessage() for r in caplog.records) == 1
    store.close()


def test_a_new_folder_on_a_full_disk_is_one_error_that_says_to_free_space(tmp_path, open_says_full):
    open_says_full.add(str(tmp_path / "kv"))
    with pytest.raises(ConfigError, match="its filesystem is full; free space on it") as err:
        DiskStore(tmp_path / "kv")
    assert "writable" not in str(err.value)


# ---------------------------------------------------------------- R2: a request cancelled during its prefill

S_PER_TOKEN = 1.5e-4  # what each decoder layer takes per token of its input: the long prompt's layer ~0.07 s
LONG_TOKENS = 450


class SlowLayers:
    """Makes each decoder layer of `model` take `S_PER_TOKEN` seconds per token of its input (a stand-in for a model
    large enough that a prefill takes seconds, on a tiny one), and sets `reached` once a forward of at least
    `LONG_TOKENS` tokens has finished its second layer (the prefill is then well under way)."""

    def __init__(self, model) -> None:
        self.reached = threading.Event()
        for idx, layer in enumerate(model.model.layers):
            layer.register_forward_hook(self._hook(idx), with_kwargs=True)

    def _hook(self, layer_idx: int):
        def done(module, args, kwargs, output):
            hidden = args[0] if args else kwargs["hidden_states"]  # [B, T, hidden]
            time.sleep(S_PER_TOKEN * hidden.shape[1])
            if layer_idx == 1 and hidden.shape[1] >= LONG_TOKENS:
                self.reached.set()

        return done


# Prompts without chunks (a full prefill each, and nothing stored after it that could hold the engine later)
LONG = random_words(50, LONG_TOKENS + 10)
SHORT = random_words(60, 4)
TAIL = random_words(61, 3)


@pytest.fixture
def slow_engine(one_thread):  # one thread: a tiny model's compute does not stall when other processes hold the cores
    engine = CacheBlendEngine(make_tiny_model("qwen2", num_layers=12), make_tiny_tokenizer(),
                              config=EngineConfig(chunk_separator=""))  # fmt: skip
    slow = SlowLayers(engine.model)
    yield engine, slow
    engine.close()


def run_long(engine) -> float:
    """Seconds the long request takes alone (its prefill and one token): what a cancelled one is compared with."""
    t0 = time.perf_counter()
    engine.generate([], prefix=LONG, suffix=TAIL, max_new_tokens=1)
    return time.perf_counter() - t0


def short_wait(engine) -> float:
    t0 = time.perf_counter()
    engine.generate([], prefix=SHORT, suffix=TAIL, max_new_tokens=1)
    return time.perf_counter() - t0


async def short_wait_async(engine) -> float:
    t0 = time.perf_counter()
    await engine.agenerate([], prefix=SHORT, suffix=TAIL, max_new_tokens=1)
    return time.perf_counter() - t0


def shorter(waited: float, alone: float) -> None:
    assert waited < 0.4 * alone, f"the short request waited {waited:.2f} s; the long prefill alone takes {alone:.2f} s"


@pytest.mark.parametrize("how", ["task.cancel", "wait_for"])
def test_a_request_cancelled_in_its_prefill_stops_it_and_the_next_request_does_not_wait_for_it(slow_engine, how):
    engine, slow = slow_engine
    alone = run_long(engine)

    async def scenario() -> float:
        call = engine.agenerate([], prefix=LONG, suffix=TAIL, max_new_tokens=1)
        if how == "wait_for":
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(call, timeout=0.25 * alone)
        else:
            task = asyncio.create_task(call)
            await asyncio.to_thread(slow.reached.wait, 60)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        return await short_wait_async(engine)

    shorter(asyncio.run(scenario()), alone)
    assert engine.scheduler.decode_pool == (0, 0)  # no slot held for the cancelled request


def test_a_stream_closed_by_another_thread_during_its_prefill_stops_it(slow_engine):
    engine, slow = slow_engine
    alone = run_long(engine)
    stream = engine.stream([], prefix=LONG, suffix=TAIL, max_new_tokens=1)
    read: list[str] = []
    reader = threading.Thread(target=lambda: read.extend(stream))  # served on the reader's own thread
    reader.start()
    assert slow.reached.wait(60)
    stream.close()  # a client that went away
    waited = short_wait(engine)
    reader.join(60)
    assert not reader.is_alive() and read == [] and stream.result is None
    shorter(waited, alone)


def test_a_langchain_timeout_stops_the_prefill_it_interrupts(slow_engine):
    pytest.importorskip("langchain_cacheblend")
    from langchain_cacheblend import CacheBlendLLM

    engine, _ = slow_engine
    alone = run_long(engine)
    llm = CacheBlendLLM(engine=engine, max_tokens=1, timeout=0.25 * alone)
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="timeout"):
        llm.invoke(LONG)  # no chunks: a full prefill of the whole text, served on this thread
    took = time.perf_counter() - t0
    assert took < 0.65 * alone, f"the call timed out after {took:.2f} s; the long prefill alone takes {alone:.2f} s"
    shorter(short_wait(engine), alone)


def test_a_file_this_user_may_not_read_is_skipped_with_one_warning_line(tmp_path, caplog, monkeypatch):
    import os

    from cacheblend_rag.retrieval import load_documents, sources

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("A readable document about rivers.")
    locked = docs / "locked.txt"
    locked.write_text("A document nobody may read.")
    locked.chmod(0)
    if os.geteuid() == 0:  # root reads whatever the mode says: let the permission check say what it says for others
        real_access = os.access
        monkeypatch.setattr(
            sources.os, "access", lambda p, mode: False if str(p) == str(locked) else real_access(p, mode)
        )
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.retrieval"):
        got = load_documents(docs)
    assert [d.source for d in got] == ["a.txt"]
    warnings = [r.getMessage() for r in caplog.records if "may not read" in r.getMessage()]
    assert len(warnings) == 1 and "'locked.txt'" in warnings[0], warnings
