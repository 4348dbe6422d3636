"""Test helpers: the real fast test model (SmolLM2-135M) behind one shared engine, and retrieved-node builders.

Not a conftest.py: the root tests import their helpers with `from conftest import ...`, which would find this
folder's conftest when both folders run in one session (pytest imports every conftest outside a package as the
module `conftest`). A uniquely named module, imported explicitly, keeps both working.

The engine is built once per process, as users should build it; tests that count cache hits use texts of their
own, so what other tests stored cannot change their counts.
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from cacheblend_rag import CacheBlendEngine, EngineConfig
from llama_index.core.schema import NodeWithScore, TextNode

from llama_index.llms.cacheblend import CacheBlendLLM

TEST_MODEL = "smollm2-135m-instruct"
MAX_NEW_TOKENS = 16  # short answers keep the real-model tests quick; greedy decoding makes them deterministic


@functools.cache
def shared_llm() -> CacheBlendLLM:
    """A CacheBlendLLM on the one engine of this test process."""
    engine = CacheBlendEngine.from_pretrained(TEST_MODEL, config=EngineConfig(dtype="float32"), show_progress=False)
    return CacheBlendLLM(engine=engine, max_new_tokens=MAX_NEW_TOKENS)


def as_nodes(*texts: str) -> list[NodeWithScore]:
    """Retrieved nodes as a retriever returns them, scores descending."""
    return [NodeWithScore(node=TextNode(text=t), score=1.0 - i / 10) for i, t in enumerate(texts)]
