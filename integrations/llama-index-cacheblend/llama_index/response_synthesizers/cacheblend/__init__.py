"""CacheBlend as a LlamaIndex response synthesizer: each retrieved node is one cached chunk of the prompt.

`BlendSynthesizer` (the synthesizer), `get_blend_query_engine` (index -> query engine in any mode, CacheBlend's
or the framework's), and a FAISS index on the packaged all-MiniLM-L6-v2 (`build_faiss_index`,
`load_faiss_index`, `minilm_embedding`). The LLM is `llama_index.llms.cacheblend.CacheBlendLLM`.
"""

from llama_index.response_synthesizers.cacheblend.base import (
    AsyncBlendTokenStream,
    BlendAnswer,
    BlendSynthesizer,
    BlendTokenStream,
    node_text,
)
from llama_index.response_synthesizers.cacheblend.index import build_faiss_index, load_faiss_index, minilm_embedding
from llama_index.response_synthesizers.cacheblend.query_engine import (
    ENGINE_MODES,
    FRAMEWORK_MODES,
    get_blend_query_engine,
    get_blend_synthesizer,
)

__all__ = [
    "ENGINE_MODES",
    "FRAMEWORK_MODES",
    "AsyncBlendTokenStream",
    "BlendAnswer",
    "BlendSynthesizer",
    "BlendTokenStream",
    "build_faiss_index",
    "get_blend_query_engine",
    "get_blend_synthesizer",
    "load_faiss_index",
    "minilm_embedding",
    "node_text",
]
