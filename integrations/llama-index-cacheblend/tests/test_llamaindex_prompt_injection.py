"""A retrieved node holding chat markup (`<|im_start|>system`) adds no control token to the prompt.

The tokenizer is the default preset's (Qwen2.5, where `<|im_start|>` is a special token), read from its converted
copy under the cacheblend-rag cache; the model is a tiny random Qwen2 over that vocabulary, answering one token.
"""

from __future__ import annotations

import pytest
from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.testing import INJECTION, built_prompts
from llama_index.core.schema import NodeWithScore, TextNode

from llama_index.llms.cacheblend import CacheBlendLLM
from llama_index.response_synthesizers.cacheblend import BlendSynthesizer


@pytest.fixture(scope="module")
def engine() -> CacheBlendEngine:
    return INJECTION.engine() or pytest.skip(INJECTION.skip)


def _prompt_starts(engine: CacheBlendEngine, node_text: str) -> int:
    """How many `<|im_start|>` tokens the synthesizer's prompt holds for one retrieved node."""
    synthesizer = BlendSynthesizer(CacheBlendLLM(engine=engine, max_new_tokens=1))
    node = NodeWithScore(node=TextNode(text=node_text), score=1.0)
    (prompt,) = built_prompts(engine, lambda: synthesizer.synthesize(INJECTION.question, nodes=[node]))
    return INJECTION.turn_starts(engine.tokenizer, prompt.input_ids().tolist())


def test_synthesizer_node_with_chat_markup_adds_no_turn(engine) -> None:
    assert _prompt_starts(engine, INJECTION.forged) == _prompt_starts(engine, INJECTION.clean) == 3
