"""Reading a folder (or one file) of plain-text documents for the retriever.

Scope: turn files on disk into `Document` values in a deterministic order. Which files are read is
`sources.py`'s job; splitting them into chunks is `chunking.py`'s; embedding and search live in `embeddings.py`
and `index.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cacheblend_rag.advice import option
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.retrieval.sources import (
    DEFAULT_MAX_DOCUMENT_BYTES,
    DocumentFiles,
    check_document_sizes,
    find_document_files,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Document:
    """One source text, as read from disk or handed in by the caller."""

    text: str  # the full text, newlines normalized to "\n"
    source: str  # where it came from: a path relative to the loaded folder, or the file name
    # free-form, JSON-serializable facts about the document (e.g. its absolute path); not hashed
    metadata: Mapping[str, object] = field(default_factory=dict, hash=False)


class BinaryFileError(ValueError):
    """A file that holds NUL bytes: a binary (an executable, an image, an archive...), not text in any 8-bit or UTF-8
    encoding, so no `encoding` makes it a document."""


def _read_text(path: Path, encoding: str) -> str:
    if "16" not in encoding and "32" not in encoding:  # UTF-16/32 text has NUL bytes; no other text does
        with path.open("rb") as f:
            if b"\0" in f.read(8192):
                raise BinaryFileError(f"{path} holds NUL bytes")
    # read_text uses universal newlines, so "\r\n" files chunk exactly like "\n" ones.
    text = path.read_text(encoding=encoding)
    # A UTF-8 byte-order mark is not content; keeping it would change the first chunk's cache key.
    return text.removeprefix("\ufeff")


def load_documents(
    path: str | Path,
    *,
    suffixes: Iterable[str] | None = None,
    globs: Iterable[str] = (),
    encoding: str = "utf-8",
    follow_links: bool = False,
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
) -> list[Document]:
    """Read every text file under `path` (recursively, in sorted order) or the single file `path`.

    Which files: those ending in one of `suffixes` (default .txt/.md/.rst when no glob is given) or matching one
    of `globs` (relative to `path`, '**' for any folders: `globs=["**/copyright"]`); links leading out of the
    folder only with `follow_links` (see `find_document_files`). A single file named explicitly is read whatever
    its name. Raises ConfigError when nothing matches, a file is above `max_document_bytes`, or every file was
    empty or undecodable (see `read_documents`).
    """
    files = find_document_files(path, suffixes=suffixes, globs=globs, follow_links=follow_links)
    if files.skipped_links:
        logger.warning(
            "skipped %d link(s) under %s leading out of the folder; pass follow_links=True to read them",
            files.skipped_links,
            files.root,
        )
    check_document_sizes(files, max_document_bytes)
    return read_documents(files, encoding=encoding)


def read_documents(files: DocumentFiles, *, encoding: str = "utf-8") -> list[Document]:
    """Read the chosen files. Empty or whitespace-only files are skipped, as are files that cannot be decoded
    with `encoding` (each undecodable one is logged, and their number is logged once at the end).

    Raises ConfigError when every file was empty or undecodable.
    """
    documents: list[Document] = []
    undecodable = empty = binary = 0
    for file, source in files.files:
        try:
            text = _read_text(file, encoding)
        except BinaryFileError:
            binary += 1
            logger.warning("skipping %s: a binary file (it holds NUL bytes), not text", file)
            continue
        except UnicodeDecodeError as exc:
            undecodable += 1
            logger.warning(
                "skipping %s: not valid %s text (%s); pass its encoding, e.g. %s",
                file,
                encoding,
                exc.reason,
                option("encoding", "latin-1"),
            )
            continue
        except LookupError as exc:
            raise ConfigError(f"unknown text encoding {encoding!r}; use e.g. 'utf-8' or 'latin-1'") from exc
        if not text.strip():
            empty += 1
            logger.debug("skipping %s: empty", file)
            continue
        documents.append(Document(text=text, source=source, metadata={"path": str(file.resolve())}))

    if undecodable:
        logger.warning("skipped %d file(s) under %s that are not valid %s text", undecodable, files.root, encoding)
    if not documents:
        advice = "add non-empty text files"
        if undecodable:
            advice += f" or pass their encoding, e.g. {option('encoding', 'latin-1')}"
        raise ConfigError(
            f"no readable text in {str(files.root)!r}: {len(files.files)} file(s) found, {empty} empty, "
            f"{binary} binary, {undecodable} not valid {encoding}; {advice}"
        )
    return documents
