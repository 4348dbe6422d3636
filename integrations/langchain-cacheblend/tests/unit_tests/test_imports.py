"""The package's public names, as langchain's partner packages check theirs."""

from langchain_cacheblend import __all__

EXPECTED_ALL = [
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


def test_all_imports() -> None:
    assert sorted(EXPECTED_ALL) == sorted(__all__)


def test_shared_names_are_the_integration_cores() -> None:
    """The placeholder and the engine loader are cacheblend_rag.frameworks's: one engine per model per process,
    whichever framework package asks for it."""
    import cacheblend_rag.frameworks as core

    import langchain_cacheblend

    assert langchain_cacheblend.CONTEXT_PLACEHOLDER == core.CONTEXT_PLACEHOLDER
    assert langchain_cacheblend.load_engine is core.load_engine
