"""cacheblend-rag: CacheBlend (EuroSys'25) for RAG, in-process on Hugging Face transformers.

Each retrieved chunk's KV cache is computed once and stored; a request loads the cached KV of all its chunks
at their real positions and recomputes only a share of the chunk tokens (by default the 15% the question
attends to most). Start with `CacheBlendEngine`.

Folders: `config/` (the settings), `models/` (presets, loading, layer-wise adapter), `store/` (chunk KV and its
stores), `fusion/` (token selection and the blended prefill), `engine/` (one request end to end), `controller/` (the
loading controller), `retrieval/` (chunking, FAISS, neighbours), `evaluation/` (data sets, scoring, fidelity to full
recompute), `cli` (the command line), `frameworks` (what the LangChain and LlamaIndex packages share). The methods the
benchmarks compare live outside the package, in the repository's `benchmarks/benchlib/`.
"""

from typing import TYPE_CHECKING

from .config import (
    RULE_NAMES,
    RULES,
    BlendConfig,
    EngineConfig,
    Guard,
    PrefillMode,
    ServingConfig,
    StoreConfig,
    blend_rule,
    resolve_device,
)
from .errors import (
    CacheBlendError,
    ConfigError,
    EngineClosedError,
    ModelNotFoundError,
    PromptError,
    UnsupportedModelError,
)
from .lazy_exports import lazy_getattr

if TYPE_CHECKING:
    from .engine import (
        QA_SHORT_TEMPLATE,
        AsyncTextStream,
        CacheBlendEngine,
        GenerationResult,
        PromptTemplate,
        Request,
        RequestMetrics,
        TextStream,
        TokenizedPrompt,
    )
    from .store import ChunkKV, MemoryStore

# The engine and the store import torch and transformers: they load on first use (`exports`).
__getattr__ = lazy_getattr(
    __name__,
    globals(),
    {
        ".engine": (
            "QA_SHORT_TEMPLATE",
            "AsyncTextStream",
            "CacheBlendEngine",
            "GenerationResult",
            "PromptTemplate",
            "Request",
            "RequestMetrics",
            "TextStream",
            "TokenizedPrompt",
        ),  # fmt: skip
        ".store": ("ChunkKV", "MemoryStore"),
    },
)

__version__ = "0.1.0"

__all__ = [
    "QA_SHORT_TEMPLATE",
    "RULES",
    "RULE_NAMES",
    "AsyncTextStream",
    "BlendConfig",
    "CacheBlendEngine",
    "CacheBlendError",
    "ChunkKV",
    "ConfigError",
    "EngineClosedError",
    "EngineConfig",
    "GenerationResult",
    "Guard",
    "MemoryStore",
    "ModelNotFoundError",
    "PrefillMode",
    "PromptError",
    "PromptTemplate",
    "Request",
    "RequestMetrics",
    "ServingConfig",
    "StoreConfig",
    "TextStream",
    "TokenizedPrompt",
    "UnsupportedModelError",
    "__version__",
    "blend_rule",
    "resolve_device",
]
