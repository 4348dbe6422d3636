"""Store settings on the model classes: they reach the engine the model loads, and only equal settings share it."""

from __future__ import annotations

import pytest
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer
from pydantic import ValidationError

from langchain_cacheblend import CacheBlendLLM, ChatCacheBlend


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama").save_pretrained(folder)
    make_tiny_tokenizer(chat_template=True).save_pretrained(folder)
    return str(folder)


def test_store_settings_reach_the_loaded_engine(checkpoint, tmp_path):
    chat = ChatCacheBlend(
        model=checkpoint,
        disk_dir=str(tmp_path / "kv"),
        memory_budget_bytes=2**20,
        disk_budget_bytes=2**30,
        redis_budget_bytes=2**29,
    )
    config = chat.get_engine().config
    assert (config.disk_dir, config.memory_budget_bytes) == (str(tmp_path / "kv"), 2**20)
    assert (config.disk_budget_bytes, config.redis_budget_bytes, config.dtype) == (2**30, 2**29, "float32")


def test_models_with_different_stores_never_share_an_engine(checkpoint, tmp_path):
    chat = ChatCacheBlend(model=checkpoint, disk_dir=str(tmp_path / "a"))
    assert CacheBlendLLM(model=checkpoint, disk_dir=str(tmp_path / "a")).get_engine() is chat.get_engine()
    assert ChatCacheBlend(model=checkpoint, disk_dir=str(tmp_path / "b")).get_engine() is not chat.get_engine()
    assert ChatCacheBlend(model=checkpoint).get_engine() is not chat.get_engine()


def test_store_settings_beside_an_engine_passed_in_are_refused(engine):
    with pytest.raises(ValidationError, match="disk_dir set the store of an engine the model loads"):
        ChatCacheBlend(engine=engine, disk_dir="/tmp/kv")
    with pytest.raises(ValidationError, match="redis_url must start with redis://"):
        ChatCacheBlend(redis_url="localhost:6379")  # checked where the model is built, before any load
