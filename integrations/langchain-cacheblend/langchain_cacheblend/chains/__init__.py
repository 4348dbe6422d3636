"""Documents chains: CacheBlend's (each document its own cached chunk) and the comparison strategies."""

from .blend_documents import (
    BlendStuffDocumentsChain,
    create_blend_documents_chain,
    precompute_documents,
    render_documents_prompt,
)
from .rag import DEFAULT_QA_PROMPT, STRATEGIES, LenientScoreParser, build_rag_chain

__all__ = [
    "DEFAULT_QA_PROMPT",
    "STRATEGIES",
    "BlendStuffDocumentsChain",
    "LenientScoreParser",
    "build_rag_chain",
    "create_blend_documents_chain",
    "precompute_documents",
    "render_documents_prompt",
]
