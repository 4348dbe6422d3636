"""Store settings on the model classes: they reach the engine the model loads, and only equal settings share it."""

from __future__ import annotations

import pytest
from cacheblend_rag import EngineConfig
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
    assert (config.store.disk_dir, config.store.memory_budget_bytes) == (str(tmp_path / "kv"), 2**20)
    assert (config.store.disk_budget_bytes, config.store.redis_budget_bytes) == (2**30, 2**29)
    assert (config.device, config.dtype) == (EngineConfig().device, EngineConfig().dtype)  # the engine's defaults


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


def test_a_redis_password_never_shows_in_repr_dumps_or_errors():
    import json

    import pydantic
    from langchain_core.load import dumpd, dumps

    from langchain_cacheblend import ChatCacheBlend

    url = "redis://:S3CRETPW@127.0.0.1:6399/0"
    chat = ChatCacheBlend(model="smollm2-135m-instruct", redis_url=url)  # the engine loads on first use
    shown = [repr(chat), str(chat), dumps(chat), json.dumps(dumpd(chat), default=str), str(chat.model_dump()),
             chat.model_dump_json()]  # fmt: skip
    assert not [text for text in shown if "S3CRETPW" in text]
    assert chat.engine_settings()["redis_url"] == url  # the engine still gets the real URL
    for bad in ("http://:S3CRETPW@host/0", 12345):
        with pytest.raises(pydantic.ValidationError) as caught:
            ChatCacheBlend(model="smollm2-135m-instruct", redis_url=bad)
        assert "S3CRETPW" not in str(caught.value) and "12345" not in str(caught.value)
