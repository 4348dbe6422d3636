"""An index straight from a folder of text files: read them, split them with the LLM's tokenizer, embed the chunks.

`build_index_from_folder` does it in one call, for a program; which files it reads is `sources.py`'s choice, how
they are split `chunking.py`'s, and the index `index.py`'s. (`cacheblend-rag index` does the same steps itself,
and records the folder's `IndexSource` with the index.)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from cacheblend_rag.retrieval.chunking import Tokenizer, split_documents
from cacheblend_rag.retrieval.documents import load_documents
from cacheblend_rag.retrieval.embeddings import Embedder
from cacheblend_rag.retrieval.index import ChunkIndex
from cacheblend_rag.retrieval.sources import DEFAULT_MAX_DOCUMENT_BYTES

logger = logging.getLogger(__name__)


def build_index_from_folder(
    path: str | Path,
    tokenizer: Tokenizer,
    *,
    chunk_tokens: int = 512,
    overlap_tokens: int = 0,
    suffixes: Iterable[str] | None = None,
    globs: Iterable[str] = (),
    encoding: str = "utf-8",
    follow_links: bool = False,
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
    embedder: Embedder | None = None,
    batch_size: int = 32,
    show_progress: bool = True,
) -> ChunkIndex:
    """Load the text files under `path` (chosen as `load_documents` does), split them with the LLM's
    `tokenizer`, and index the chunks."""
    documents = load_documents(
        path,
        suffixes=suffixes,
        globs=globs,
        encoding=encoding,
        follow_links=follow_links,
        max_document_bytes=max_document_bytes,
    )
    chunks = split_documents(
        documents, tokenizer, chunk_tokens=chunk_tokens, overlap_tokens=overlap_tokens, show_progress=show_progress
    )
    logger.info("indexing %d chunks from %d documents under %s", len(chunks), len(documents), path)
    return ChunkIndex.build(chunks, embedder, batch_size=batch_size, show_progress=show_progress)
