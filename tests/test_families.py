"""Decoder families, each a tiny random model built from its own `transformers` config class: the families the
engine serves blend exactly, the others are refused with `UnsupportedModelError` before anything else can fail."""

from __future__ import annotations

import pytest
from family_models import FAMILIES, REFUSED, family_config, family_model

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.errors import UnsupportedModelError
from cacheblend_rag.models import check_supported
from cacheblend_rag.models.support import SUPPORTED_FAMILIES
from cacheblend_rag.testing import make_tiny_tokenizer

UNSUPPORTED = sorted(set(FAMILIES) - SUPPORTED_FAMILIES) + sorted(REFUSED)


@pytest.mark.parametrize("family", UNSUPPORTED)
def test_unsupported_family_is_refused_by_its_config_with_the_reason(family):
    with pytest.raises(UnsupportedModelError, match=repr(family)):
        check_supported(family_config(family))


@pytest.mark.parametrize("family", UNSUPPORTED)
def test_unsupported_model_handed_to_the_engine_is_refused_before_it_is_touched(family):
    model = family_model(family)
    with pytest.raises(UnsupportedModelError, match=repr(family)):
        CacheBlendEngine(model, make_tiny_tokenizer(), config=EngineConfig(device="cpu"))


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text", "granitemoehybrid", "lfm2"])
def test_layers_that_are_not_attention_are_named_as_the_reason(family):
    with pytest.raises(UnsupportedModelError, match="running state depends on every earlier token"):
        check_supported(family_config(family))
