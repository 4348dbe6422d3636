"""Fixtures shared by the package's tests (`tests/`) and the benchmark machinery's (`benchmarks/tests/`): tiny seeded
random-weight models of each supported family (built by `cacheblend_rag.testing`), a word-level tokenizer, one torch
thread, and a guard against loading a real model."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.config import dtype as _dtype
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer

# dtype="auto" (the default) is float32 in the tests on every machine, so that their tolerances hold wherever they
# run: set here, before any test module is collected (some build configs at import). The tests of "auto" itself
# (marked `auto_dtype`) see what it really picks (`real_auto_dtype`).
_real_auto_dtype = _dtype.auto_dtype
_dtype.auto_dtype = lambda device="cpu": "float32"


@pytest.fixture(autouse=True)
def real_auto_dtype(request, monkeypatch):
    if request.node.get_closest_marker("auto_dtype") is not None:
        monkeypatch.setattr(_dtype, "auto_dtype", _real_auto_dtype)


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
