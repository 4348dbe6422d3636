"""Retrieval for RAG: read text files, split them into token-sized chunks, embed and search them.

The chunk texts this package returns are what the blend engine caches KV for, so splitting is
deterministic (same files and settings, byte-identical chunks).
"""

from cacheblend_rag.retrieval.chunking import MIN_CHUNK_TOKENS, Chunk, Tokenizer, split_documents
from cacheblend_rag.retrieval.documents import DEFAULT_SUFFIXES, Document, load_documents
from cacheblend_rag.retrieval.embeddings import (
    EMBEDDING_DIM,
    EMBEDDING_MODEL_NAME,
    Embedder,
    embedder_name,
    embedding_dimension,
    load_embedder,
)
from cacheblend_rag.retrieval.index import (
    FORMAT_VERSION,
    ChunkIndex,
    IndexFormatError,
    RetrievedChunk,
    build_index_from_folder,
)

__all__ = [
    "DEFAULT_SUFFIXES",
    "EMBEDDING_DIM",
    "EMBEDDING_MODEL_NAME",
    "FORMAT_VERSION",
    "MIN_CHUNK_TOKENS",
    "Chunk",
    "ChunkIndex",
    "Document",
    "Embedder",
    "IndexFormatError",
    "RetrievedChunk",
    "Tokenizer",
    "build_index_from_folder",
    "embedder_name",
    "embedding_dimension",
    "load_documents",
    "load_embedder",
    "split_documents",
]
