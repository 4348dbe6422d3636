"""Redis faults that arrive while the engine is serving: a server full under `noeviction`, flushed, or restarted
empty. Requests answer as over a healthy store, refused writes are counted (never raised), entries that vanished
are misses that are recomputed, and a restarted server is reached again without hanging.
"""

from __future__ import annotations

import threading
import time
import uuid

from redis_helpers import RedisServer
from test_faults_runtime import EXACT_CODEC, MB, ask, chunks_of, engine_on

from cacheblend_rag.store import MemoryStore, TieredStore

# ---------------------------------------------------------------- Redis full, flushed, restarted


def redis_engine(url: str, **redis):
    from cacheblend_rag.store.redis_store import RedisStore

    tier = RedisStore(url, 10 * MB, f"t-{uuid.uuid4().hex[:8]}", codec=EXACT_CODEC, **redis)
    return engine_on(TieredStore([MemoryStore(0), tier], write_back=False)), tier


def test_a_redis_full_under_noeviction_counts_its_refused_writes_and_still_serves_reads(tmp_path, one_thread):
    server = RedisServer().start()
    try:
        engine, tier = redis_engine(server.url)
        healthy = engine_on()
        warm = chunks_of(1)
        assert ask(engine, warm).text == ask(healthy, warm).text
        used = int(tier._client.info("memory")["used_memory"])
        tier._client.config_set("maxmemory-policy", "noeviction")
        tier._client.config_set("maxmemory", str(used + 16 * 1024))
        for seed in (2, 3, 1, 4, 1):
            got = ask(engine, chunks_of(seed))
            assert got.text == ask(healthy, chunks_of(seed)).text
            if seed == 1:  # stored before Redis filled up: still read from it
                assert got.metrics.hits_by_tier == {"redis": 2}
        assert tier.stats.errors >= 1
        tier._client.config_set("maxmemory", "0")
        ask(engine, chunks_of(5))
        assert ask(engine, chunks_of(5)).metrics.hits_by_tier == {"redis": 2}
    finally:
        server.stop()


def test_a_redis_flushed_mid_run_turns_its_entries_into_misses_that_are_recomputed(redis_server, one_thread):
    engine, tier = redis_engine(redis_server.url)
    healthy = engine_on()
    chunks = chunks_of(1)
    expected = ask(healthy, chunks).text
    assert ask(engine, chunks).text == expected
    assert ask(engine, chunks).metrics.hits_by_tier == {"redis": 2}
    tier._client.flushall()
    got = ask(engine, chunks)
    assert got.text == expected and got.metrics.hits_by_tier == {} and tier.stats.errors == 0
    again = ask(engine, chunks)
    assert again.text == expected and again.metrics.hits_by_tier == {"redis": 2}
    assert len(tier) == 3 and tier.nbytes > 0  # the bookkeeping was rebuilt by the puts


def test_a_redis_restarted_empty_mid_run_is_reconnected_without_hanging(one_thread):
    server = RedisServer().start()
    try:
        engine, tier = redis_engine(server.url, backoff_s=0.2)
        healthy = engine_on()
        chunks = chunks_of(1)
        expected = ask(healthy, chunks).text
        ask(engine, chunks)
        assert ask(engine, chunks).metrics.hits_by_tier == {"redis": 2}
        port = server.port
        server.stop()
        server = RedisServer(port).start()
        # The pooled connection is dead: redis-py reconnects, or the call fails (counted) and the back-off passes.
        # Run on a thread so that a hang fails the test instead of stopping the suite (a liveness guard, generous).
        answers = []
        caller = threading.Thread(target=lambda: answers.append(ask(engine, chunks)), daemon=True)
        caller.start()
        caller.join(60)
        assert not caller.is_alive(), "a request after the restart never returned"
        got = answers[0]
        assert got.text == expected and got.metrics.hits_by_tier == {}
        time.sleep(0.3)
        ask(engine, chunks)  # the server came back empty: misses, recomputed and stored
        again = ask(engine, chunks)
        assert again.text == expected and again.metrics.hits_by_tier == {"redis": 2}
        assert tier.stats.misses >= 2 and len(tier) == 3
    finally:
        server.stop()
