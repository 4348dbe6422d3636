"""An index straight from a folder of text files: read them, split them with the LLM's tokenizer, embed the chunks.

`build_index_from_folder` does it in one call, for a program; which files it reads is `sources.py`'s choice, how
they are split `chunking.py`'s, and the index `index.py`'s. With `index_dir` the index is kept there and later
calls split and embed only the files that changed since (`kept_index.py`, as `cacheblend-rag ask` does).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.retrieval.chunking import Tokenizer, split_documents
from cacheblend_rag.retrieval.documents import load_documents
from cacheblend_rag.retrieval.embeddings import EMBEDDING_MODEL_NAME, Embedder, embedder_name
from cacheblend_rag.retrieval.index import ChunkIndex
from cacheblend_rag.retrieval.kept_index import prepare_update
from cacheblend_rag.retrieval.sources import (
    DEFAULT_MAX_DOCUMENT_BYTES,
    IndexSource,
    check_document_sizes,
    find_document_files,
)

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
    index_dir: str | Path | None = None,
    tokenizer_name: str | None = None,
    model_name: str | None = None,
) -> ChunkIndex:
    """Load the text files under `path` (chosen as `load_documents` does), split them with the LLM's
    `tokenizer`, and index the chunks.

    `index_dir`: keep the index in this folder (new, empty, or one kept before) and reuse it: a later call with the
    same settings splits and embeds only new and changed files, and drops removed ones (the result is the index a
    fresh build gives). What it depends on is recorded with it: the folder, how files are chosen and read, the
    chunk settings, `tokenizer_name` (default: the Hugging Face tokenizer's `name_or_path`) and the embedding model
    (`model_name`, default: the name the embedder reports); other settings rebuild it.
    """
    if index_dir is not None:
        return _kept_index(
            path, tokenizer, Path(index_dir), chunk_tokens=chunk_tokens, overlap_tokens=overlap_tokens,
            suffixes=suffixes, globs=globs, encoding=encoding, follow_links=follow_links,
            max_document_bytes=max_document_bytes, embedder=embedder, batch_size=batch_size,
            show_progress=show_progress, tokenizer_name=tokenizer_name, model_name=model_name,
        )  # fmt: skip
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
    return ChunkIndex.build(chunks, embedder, batch_size=batch_size, show_progress=show_progress, model_name=model_name)


def _kept_index(
    path: str | Path, tokenizer: Tokenizer, index_dir: Path, *, chunk_tokens: int, overlap_tokens: int,
    suffixes: Iterable[str] | None, globs: Iterable[str], encoding: str, follow_links: bool, max_document_bytes: int,
    embedder: Embedder | None, batch_size: int, show_progress: bool, tokenizer_name: str | None,
    model_name: str | None,
) -> ChunkIndex:  # fmt: skip
    """`build_index_from_folder` with its index kept in `index_dir`."""
    if tokenizer_name is None:
        tokenizer_name = getattr(tokenizer, "name_or_path", None)  # a Hugging Face tokenizer's checkpoint
    if not tokenizer_name:
        raise ConfigError("a kept index records the tokenizer that split it: pass tokenizer_name='...' (e.g. the "
                          "model's name), or leave index_dir unset")  # fmt: skip
    if model_name is None:
        model_name = EMBEDDING_MODEL_NAME if embedder is None else embedder_name(embedder)
    if not model_name:
        raise ConfigError("a kept index records its embedding model, and this embedder reports no name: pass "
                          "model_name='...', or leave index_dir unset")  # fmt: skip
    files = find_document_files(path, suffixes=suffixes, globs=globs, follow_links=follow_links)
    check_document_sizes(files, max_document_bytes)
    record = IndexSource(docs=os.path.realpath(path), suffixes=files.suffixes, globs=files.globs,
                         follow_links=files.follow_links, encoding=encoding, chunk_tokens=chunk_tokens,
                         tokenizer=str(tokenizer_name), embedding_model=model_name,
                         files_sha256=files.digest())  # fmt: skip
    update = prepare_update(index_dir, files, record, overlap_tokens=overlap_tokens, embedder=embedder)
    if update.problem is not None:
        logger.warning("the index kept in %s is rebuilt: %s", index_dir, update.problem)
    index = update.build(tokenizer, batch_size=batch_size, show_progress=show_progress)
    logger.info("%s", update.summary())
    return index
