"""Test helpers: the real fast test model (SmolLM2-135M) behind one shared engine, and retrieved-node builders.

Not a conftest.py: the root tests import their helpers with `from conftest import ...`, which would find this
folder's conftest when both folders run in one session (pytest imports every conftest outside a package as the
module `conftest`). A uniquely named module, imported explicitly, keeps both working. For the same reason this
folder has no `__init__.py` (LlamaIndex's own packages have one): it would be a second top-level `tests` package
beside the LangChain package's, and the root collection could import only one of them.

The engine is built once per process, as users should build it; tests that count cache hits use texts of their
own, so what other tests stored cannot change their counts.
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.frameworks import load_engine
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer
from llama_index.core.schema import NodeWithScore, TextNode

from llama_index.llms.cacheblend import CacheBlendLLM

TEST_MODEL = "smollm2-135m-instruct"
MAX_NEW_TOKENS = 16  # short answers keep the real-model tests quick; greedy decoding makes them deterministic


@functools.cache
def shared_llm() -> CacheBlendLLM:
    """A CacheBlendLLM on the process's one engine of the test model (the one LangChain's tests use too)."""
    return CacheBlendLLM(engine=load_engine(TEST_MODEL), max_new_tokens=MAX_NEW_TOKENS)


def tiny_llm() -> CacheBlendLLM:
    """A CacheBlendLLM on a fresh engine (its own empty store) over a tiny random model with a chat template:
    for tests of mechanics, where the answer's words do not matter. Texts are words "w0".."w95"."""
    model = make_tiny_model("llama", num_layers=4, mute_eos=True)
    engine = CacheBlendEngine(model, make_tiny_tokenizer(chat_template=True), config=EngineConfig(miss_policy="blend"))
    return CacheBlendLLM(engine=engine, max_new_tokens=2)


def as_nodes(*texts: str) -> list[NodeWithScore]:
    """Retrieved nodes as a retriever returns them, scores descending."""
    return [NodeWithScore(node=TextNode(text=t), score=1.0 - i / 10) for i, t in enumerate(texts)]
