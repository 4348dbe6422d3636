"""langchain-cacheblend: CacheBlend (cached chunk KV, selective recompute) as LangChain models and chains.

Swap `create_stuff_documents_chain` for `create_blend_documents_chain` and each retrieved document reaches
the model as its own chunk, whose KV cache is computed once and reused by every later request.
Subpackages: `llms/`, `chat_models/`, `chains/`, `vectorstores/`, `callbacks/`.
"""

from ._common import CONTEXT_PLACEHOLDER, load_engine
from .callbacks import CacheBlendMetricsHandler, CallRecord
from .chains import (
    DEFAULT_QA_PROMPT,
    STRATEGIES,
    BlendStuffDocumentsChain,
    build_rag_chain,
    create_blend_documents_chain,
    precompute_documents,
)
from .chat_models import ChatCacheBlend
from .llms import CacheBlendLLM
from .vectorstores import build_faiss_index, load_faiss_index, packaged_embeddings, save_faiss_index

__version__ = "0.1.0"

__all__ = [
    "CONTEXT_PLACEHOLDER",
    "DEFAULT_QA_PROMPT",
    "STRATEGIES",
    "BlendStuffDocumentsChain",
    "CacheBlendLLM",
    "CacheBlendMetricsHandler",
    "CallRecord",
    "ChatCacheBlend",
    "__version__",
    "build_faiss_index",
    "build_rag_chain",
    "create_blend_documents_chain",
    "load_engine",
    "load_faiss_index",
    "packaged_embeddings",
    "precompute_documents",
    "save_faiss_index",
]
