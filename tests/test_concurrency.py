"""One engine serving many threads at once gives the same answers as serving them one by one."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from cacheblend_rag import CacheBlendEngine, EngineConfig, StoreConfig
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

THREADS, PER_THREAD = 8, 25


def test_eight_threads_give_the_same_outputs_as_serial_runs(tmp_path):
    engine = CacheBlendEngine(
        make_tiny_model("qwen2"),
        make_tiny_tokenizer(),
        config=EngineConfig(
            miss_policy="blend",
            chunk_separator="",
            store=StoreConfig(disk_dir=str(tmp_path / "kv"), memory_budget_bytes=200_000),
        ),
    )
    pool = [random_words(200 + i, 12) for i in range(10)]  # chunks shared across requests, as a retriever would return

    def request(i: int) -> tuple:
        chunks = [pool[i % 10], pool[(i * 3 + 1) % 10], pool[(i * 7 + 2) % 10]]
        mode = ("blend", "reuse", "full", "prefix")[i % 4]
        args = dict(
            prefix=random_words(1, 4),
            suffix=random_words(i % 3, 5),
            mode=mode,
            recompute_ratio=0.15 if mode == "blend" else None,
            max_new_tokens=6,
        )
        if i % 5 == 0:  # some streamed
            stream = engine.stream(chunks, **args)
            text = "".join(stream)
            return text, tuple(stream.result.token_ids)
        r = engine.generate(chunks, **args)
        return r.text, tuple(r.token_ids)

    n = THREADS * PER_THREAD
    serial = [request(i) for i in range(n)]
    with ThreadPoolExecutor(max_workers=THREADS) as ex:
        concurrent = list(ex.map(request, range(n)))
    assert concurrent == serial
    engine.store.flush()
