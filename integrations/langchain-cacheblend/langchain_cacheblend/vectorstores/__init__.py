"""FAISS retrieval over the packaged all-MiniLM-L6-v2, saved and loaded without pickle."""

from .faiss import (
    PACKAGED_EMBEDDING_MODEL,
    build_faiss_index,
    default_text_splitter,
    load_faiss_index,
    packaged_embeddings,
    save_faiss_index,
)

__all__ = [
    "PACKAGED_EMBEDDING_MODEL",
    "build_faiss_index",
    "default_text_splitter",
    "load_faiss_index",
    "packaged_embeddings",
    "save_faiss_index",
]
