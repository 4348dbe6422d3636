"""The package tests' own fixtures: a private Redis server and a store on it, and a tiny model saved as a local
checkpoint for the command line (the tiny models, the tokenizer and the one-thread fixture are in the repository's
root `conftest.py`, shared with the benchmark machinery's tests)."""

from __future__ import annotations

import uuid

import pytest
from redis_helpers import RedisServer

from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer


@pytest.fixture(scope="module")
def redis_server():
    """A private redis-server on loopback for the module (skips the tests where none can start)."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_store(redis_server):
    from cacheblend_rag.store.redis_store import RedisStore

    # The exact codec, not the lossy default (int8): the tests using this fixture check the Redis tier's bookkeeping
    # bit for bit. The default codec has its own tests in test_codec_store.py and test_codec.py.
    store = RedisStore(
        redis_server.url, budget_bytes=10 * 1024**2, namespace=f"test-{uuid.uuid4().hex[:8]}", codec="native"
    )
    yield store
    store.clear()
    store.close()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight Llama and its word-level tokenizer, saved as a local checkpoint (once a module: the
    command line only reads it)."""
    folder = tmp_path_factory.mktemp("tiny-model")
    make_tiny_model("llama").save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return folder
