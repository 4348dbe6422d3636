"""Fixtures of the LangChain integration's tests: a tiny seeded random model, and the fast real test model.

The tiny model is `cacheblend_rag.testing`'s: a 4-layer Llama with EOS muted, with a word-level tokenizer
(words "w0".."w95") and a minimal chat template, so chat rendering runs as on a real model.
"""

from __future__ import annotations

import inspect
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer

FAST_MODEL = "smollm2-135m-instruct"


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_pycollect_makeitem(collector, name, obj):
    """Run this folder's async tests (langchain-tests has many) on asyncio without changing the root's mode.

    pytest-asyncio only takes unmarked coroutines in "auto" mode, which the repository does not set; marking
    them here, before pytest-asyncio looks, keeps the setting local to this folder.
    """
    outcome = yield
    result = outcome.get_result()
    for node in result if isinstance(result, list) else [result]:
        if isinstance(node, pytest.Function) and inspect.iscoroutinefunction(node.obj):
            node.add_marker(pytest.mark.asyncio)


def tiny_engine(chat_template: bool = True) -> CacheBlendEngine:
    """A fresh engine (its own empty chunk store) on the tiny model."""
    model = make_tiny_model("llama", num_layers=4, mute_eos=True)  # answers run to max_tokens or a stop
    return CacheBlendEngine(model, make_tiny_tokenizer(chat_template), config=EngineConfig(miss_policy="blend"))


@pytest.fixture
def engine() -> CacheBlendEngine:
    return tiny_engine()


@pytest.fixture
def engine_without_chat_template() -> CacheBlendEngine:
    return tiny_engine(chat_template=False)


@pytest.fixture(scope="session")
def fast_engine() -> CacheBlendEngine:
    """The real fast test model, shared by the session (the same object `load_engine` hands out)."""
    from langchain_cacheblend import load_engine

    return load_engine(FAST_MODEL)
