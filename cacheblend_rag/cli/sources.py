"""Where `ask`, `plan`, `calibrate` and `index` get their chunks: a saved index folder, or the documents of `--docs`.

The index of --docs is kept on disk (`retrieval.kept_index`): in --index when given, else beside the chunk KV of
--kv-dir (`folder-indexes/`), else under the package's cache folder ($CACHEBLEND_RAG_HOME, default
~/.cache/cacheblend-rag, in `indexes/`), one folder per documents folder and settings; --no-index-cache keeps none.
A later run reuses it, splitting and embedding only the files whose contents changed, and says so in one line. An
--index folder that holds anything but an index is never written to: the user's documents are not an index folder.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CacheBlendError

if TYPE_CHECKING:
    from ..engine import CacheBlendEngine
    from ..retrieval import ChunkIndex, DocumentFiles, IndexSource, IndexUpdate, Tokenizer


@dataclass(frozen=True)
class Sources:
    """A saved index usable as is (--index without --docs), or --docs compared with its kept index."""

    index: ChunkIndex | None
    update: IndexUpdate | None  # `build_index` finishes it once the tokenizer is loaded


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


def kept_index_folder(args: argparse.Namespace, record: IndexSource) -> Path | None:
    """Where the index of --docs is kept: --index, else a folder named by its settings beside --kv-dir's chunk KV or
    under the package's cache folder; None with --no-index-cache."""
    if args.index:
        return Path(args.index)
    if args.no_index_cache:
        return None
    from ..retrieval import index_key

    if args.kv_dir:
        return Path(args.kv_dir).expanduser() / "folder-indexes" / index_key(record)
    from ..models.gguf import cache_home
    from ..retrieval.kept_index import drop_orphans

    drop_orphans(cache_home() / "indexes")  # the kept indexes of folders that are gone
    return cache_home() / "indexes" / index_key(record)


def read_sources(args: argparse.Namespace) -> Sources:
    """`ask`'s chunks: the saved index of --index alone, or --docs compared with its kept index (the files to index
    again read now). Read (and checked) before any model loads."""
    from ..retrieval import ChunkIndex, prepare_update

    state = check_index_folder(args.index, "--index") if args.index else "new"
    if not args.docs:
        if state != "index":
            where = f"; {args.index!r} holds none yet" if args.index else ""
            raise CacheBlendError(
                f"give --docs DIR (the text files to answer from), or --index of a saved index{where}"
            )
        index = ChunkIndex.load(args.index)
        print(f"loaded index of {len(index)} chunks from {args.index}", file=sys.stderr)
        return Sources(index, None)

    files, record = choose_documents(args)
    update = prepare_update(kept_index_folder(args, record), files, record)
    if update.problem is not None:
        print(f"the index in {update.folder} cannot be reused ({update.problem}); rebuilding it from {args.docs}",
              file=sys.stderr)  # fmt: skip
    return Sources(None, update)


def build_index(args: argparse.Namespace, sources: Sources, tokenizer: Tokenizer) -> ChunkIndex:
    """The index of the sources: the saved one, or --docs' kept index brought up to date (new and changed files
    split with the model's tokenizer and embedded with all-MiniLM-L6-v2), with one line on what was reused."""
    if sources.index is not None:
        return sources.index
    assert sources.update is not None, "without a saved index there are documents"
    index = sources.update.build(tokenizer, show_progress=True)
    print(f"{sources.update.summary()}: {len(index)} chunks from {args.docs}", file=sys.stderr)
    return index


def index_context(engine: CacheBlendEngine) -> str | None:
    """The `precompute` context of an index's chunks: "groups" under `chunk_context="grouped"` (the default), else
    None (each chunk alone)."""
    return "groups" if engine.config.group_tokens else None
