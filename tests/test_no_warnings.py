"""Our own calls into transformers and torch raise no warnings: a deprecation fails here, not in users' output."""

from __future__ import annotations

import logging
import warnings

import pytest

from cacheblend_rag import CacheBlendEngine, EngineConfig, blend_rule
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_every_mode_runs_without_a_warning(family, caplog):
    engine = CacheBlendEngine(make_tiny_model(family), make_tiny_tokenizer(), config=EngineConfig())
    chunks = [random_words(s, 20) for s in (1, 2, 3)]
    caplog.set_level(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for mode in ("full", "prefix", "reuse", "blend"):
            engine.generate(chunks, random_words(9, 5), mode=mode, max_new_tokens=4)
        engine.generate(chunks, random_words(9, 5), blend=blend_rule("gradual"), max_new_tokens=4)
        streamed = "".join(engine.stream(chunks, random_words(8, 5), max_new_tokens=4, temperature=1, seed=3))
    assert isinstance(streamed, str)
    assert [r.getMessage() for r in caplog.records if r.name.startswith(("transformers", "torch"))] == []
