"""Retrieval for RAG: read text files, split them into token-sized chunks, embed and search them.

The chunk texts this package returns are what the blend engine caches KV for, so splitting is
deterministic (same files and settings, byte-identical chunks).
"""

from cacheblend_rag.retrieval.chunking import MIN_CHUNK_TOKENS, Chunk, Tokenizer, split_documents
from cacheblend_rag.retrieval.documents import Document, load_documents, read_documents
from cacheblend_rag.retrieval.embeddings import (
    EMBEDDING_DIM,
    EMBEDDING_MODEL_NAME,
    Embedder,
    embedder_name,
    embedding_dimension,
    load_embedder,
)
from cacheblend_rag.retrieval.folder_index import build_index_from_folder
from cacheblend_rag.retrieval.index import (
    FORMAT_VERSION,
    ChunkIndex,
    IndexFormatError,
    RetrievedChunk,
)
from cacheblend_rag.retrieval.kept_index import IndexUpdate, index_key, prepare_update
from cacheblend_rag.retrieval.sources import (
    DEFAULT_MAX_DOCUMENT_BYTES,
    DEFAULT_SUFFIXES,
    DocumentFiles,
    IndexSource,
    check_document_sizes,
    find_document_files,
)

__all__ = [
    "DEFAULT_MAX_DOCUMENT_BYTES",
    "DEFAULT_SUFFIXES",
    "EMBEDDING_DIM",
    "EMBEDDING_MODEL_NAME",
    "FORMAT_VERSION",
    "MIN_CHUNK_TOKENS",
    "Chunk",
    "ChunkIndex",
    "Document",
    "DocumentFiles",
    "Embedder",
    "IndexFormatError",
    "IndexSource",
    "IndexUpdate",
    "RetrievedChunk",
    "Tokenizer",
    "build_index_from_folder",
    "check_document_sizes",
    "embedder_name",
    "embedding_dimension",
    "find_document_files",
    "index_key",
    "load_documents",
    "load_embedder",
    "prepare_update",
    "read_documents",
    "split_documents",
]
