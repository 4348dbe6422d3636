"""Shared fixtures: tiny seeded random-weight models of each supported family (built by `cacheblend_rag.testing`),
a word-level tokenizer, a reference forward over cached KV and a private Redis server."""

from __future__ import annotations

import os
import uuid

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from redis_helpers import RedisServer
from transformers import PreTrainedTokenizerFast

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread, and do not stall when other processes hold the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any attempt to load a model fails the test: the CLI must refuse bad input before it loads one."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(CacheBlendEngine, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr("cacheblend_rag.models.load_model", refuse)


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def family(request) -> str:
    return request.param


@pytest.fixture
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return make_tiny_tokenizer()


@pytest.fixture
def tiny_engine(family, tiny_tokenizer) -> CacheBlendEngine:
    return CacheBlendEngine(
        make_tiny_model(family), tiny_tokenizer, config=EngineConfig(miss_policy="blend", chunk_separator="")
    )


def reference_logits_with_cache(engine: CacheBlendEngine, prompt, num_chunks: int) -> torch.Tensor:
    """Last-token logits from the model's own forward over the prompt's tail, after a DynamicCache filled with
    the stored KV of the prefix and the first `num_chunks` chunks, each rotated to its real offset.

    An implementation independent of the fusor: prefix caching is num_chunks=1, full KV reuse all chunks.
    """
    from transformers import DynamicCache

    from cacheblend_rag.models import rotate_keys

    keys = engine.prompt_keys(prompt)[: num_chunks + (1 if prompt.prefix_ids else 0)]
    parts = [engine.store.get(k) for k in keys]
    assert all(p is not None for p in parts), "run a cached mode first so the store holds the chunks"
    cached = sum(p.num_tokens for p in parts)
    cos, sin = engine.lm.rope(torch.arange(cached))
    cache = DynamicCache(config=engine.model.config)
    for layer_idx in range(engine.lm.shape.num_layers):
        k = torch.cat([p.keys[layer_idx] for p in parts], dim=1)
        v = torch.cat([p.values[layer_idx] for p in parts], dim=1)
        cache.update(rotate_keys(k, cos, sin)[None], v[None], layer_idx)
    tail = prompt.input_ids()[cached:]
    with torch.no_grad():
        out = engine.model(
            input_ids=tail[None],
            position_ids=torch.arange(cached, cached + tail.numel())[None],
            cache=cache,
            use_cache=True,
        )
    return out.logits[0, -1].float()


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
