"""Where `ask` and `index` get their chunks: a saved index folder, or the documents of `--docs`.

An index folder records what it was built from (`IndexSource`: the documents path, how files were chosen,
chunk size, tokenizer, embedder and a digest of the files' names, sizes and modification times). `ask --docs D
--index I` loads I only when that record matches; otherwise it says why on stderr and rebuilds I. A folder that
holds anything but an index is never written to: the user's documents are not an index folder.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import CacheBlendError

if TYPE_CHECKING:
    from ..engine import CacheBlendEngine
    from ..retrieval import ChunkIndex, Document, DocumentFiles, IndexSource, Tokenizer


@dataclass(frozen=True)
class Sources:
    """A saved index usable as is, or the documents to build one from."""

    index: ChunkIndex | None
    documents: list[Document]
    record: IndexSource | None  # what an index built now records (None without --docs)


def check_index_folder(folder: str, flag: str) -> str:
    """The state of an index folder ("new" or "index"); CacheBlendError for a file or a folder of other things."""
    from ..retrieval.index import index_folder_state

    state = index_folder_state(folder)
    if state == "file":
        raise CacheBlendError(f"{flag} {folder!r} is a file, not an index folder; pick a new or empty folder")
    if state == "other":
        raise CacheBlendError(
            f"{flag} {folder!r} holds other files and is not a saved index, so it is left alone; pick a new or "
            "empty folder for the index"
        )
    return state


def choose_documents(args: argparse.Namespace) -> tuple[DocumentFiles, IndexSource]:
    """The files --docs names (sizes checked, nothing read yet) and the record an index of them keeps."""
    from ..models.presets import default_model
    from ..retrieval import EMBEDDING_MODEL_NAME, IndexSource, check_document_sizes, find_document_files

    files = find_document_files(args.docs, suffixes=args.suffix, globs=args.glob or (), follow_links=args.follow_links)
    if files.skipped_links:
        print(
            f"skipped {files.skipped_links} links leading out of {args.docs} (--follow-links reads them)",
            file=sys.stderr,
        )
    check_document_sizes(files, int(args.max_doc_mb * 2**20))
    record = IndexSource(
        docs=os.path.realpath(args.docs),
        suffixes=files.suffixes,
        globs=files.globs,
        follow_links=files.follow_links,
        encoding=args.encoding,
        chunk_tokens=args.chunk_tokens,
        tokenizer=args.model or default_model(),  # $CACHEBLEND_RAG_MODEL too: the model that will split it
        embedding_model=EMBEDDING_MODEL_NAME,
        files_sha256=files.digest(),
    )
    return files, record


def read_sources(args: argparse.Namespace) -> Sources:
    """`ask`'s chunks: the saved index of --index when it fits --docs, else --docs' documents. Read (and
    checked) before any model loads."""
    from ..retrieval import ChunkIndex, IndexFormatError, read_documents

    state = check_index_folder(args.index, "--index") if args.index else "new"
    if not args.docs:
        if state != "index":
            where = f"; {args.index!r} holds none yet" if args.index else ""
            raise CacheBlendError(
                f"give --docs DIR (the text files to answer from), or --index of a saved index{where}"
            )
        index = ChunkIndex.load(args.index)
        print(f"loaded index of {len(index)} chunks from {args.index}", file=sys.stderr)
        return Sources(index, [], None)

    files, record = choose_documents(args)
    if state == "index":
        try:
            index = ChunkIndex.load(args.index)
        except IndexFormatError as exc:
            why = f"it cannot be read: {exc}"
        else:
            if index.source == record:
                print(f"loaded index of {len(index)} chunks from {args.index}", file=sys.stderr)
                return Sources(index, [], record)
            changed = index.source.differences(record) if index.source is not None else ["it records no source"]
            why = "; ".join(changed)
        print(
            f"the index at {args.index} does not match --docs ({why}); rebuilding it from {args.docs}", file=sys.stderr
        )
    return Sources(None, read_documents(files, encoding=args.encoding), record)


def build_index(
    args: argparse.Namespace, documents: list[Document], tokenizer: Tokenizer, record: IndexSource, out: str | None
) -> ChunkIndex:
    """Split the documents with the model's tokenizer and index the chunks (FAISS + all-MiniLM-L6-v2); saved in
    `out` with their record when given."""
    from ..retrieval import ChunkIndex, split_documents

    chunks = split_documents(documents, tokenizer, chunk_tokens=args.chunk_tokens, show_progress=True)
    index = ChunkIndex.build(chunks, show_progress=True, source=record)
    print(f"indexed {len(index)} chunks from {args.docs}", file=sys.stderr)
    if out:
        index.save(out)
        print(f"saved the index to {out}", file=sys.stderr)
    return index


def index_context(engine: CacheBlendEngine) -> str | None:
    """The `precompute` context of an index's chunks: "groups" under `chunk_context="grouped"` (the default), else
    None (each chunk alone)."""
    return "groups" if engine.config.group_tokens else None
