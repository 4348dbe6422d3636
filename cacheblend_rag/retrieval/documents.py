"""Reading a folder (or one file) of plain-text documents for the retriever.

Scope: turn files on disk into `Document` values in a deterministic order. Splitting them into chunks is
`chunking.py`'s job; embedding and search live in `embeddings.py` and `index.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cacheblend_rag.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_SUFFIXES: tuple[str, ...] = (".txt", ".md", ".rst")


@dataclass(frozen=True)
class Document:
    """One source text, as read from disk or handed in by the caller."""

    text: str  # the full text, newlines normalized to "\n"
    source: str  # where it came from: a path relative to the loaded folder, or the file name
    # free-form, JSON-serializable facts about the document (e.g. its absolute path); not hashed
    metadata: Mapping[str, object] = field(default_factory=dict, hash=False)


def _normalize_suffixes(suffixes: Iterable[str]) -> tuple[str, ...]:
    # A bare string would otherwise be iterated character by character.
    if isinstance(suffixes, str):
        suffixes = (suffixes,)
    normalized = tuple(s.lower() for s in suffixes)
    if not normalized:
        raise ConfigError("suffixes must name at least one file suffix, got an empty list; e.g. ('.txt',)")
    for suffix in normalized:
        if not suffix.startswith(".") or len(suffix) < 2:
            raise ConfigError(f"each suffix must start with a dot, e.g. '.txt', got {suffix!r}")
    return normalized


def _is_hidden(relative: Path) -> bool:
    # Skips .git/, .venv/, editor backups and the like, which are never meant as documents.
    return any(part.startswith(".") for part in relative.parts)


def _read_text(path: Path, encoding: str) -> str:
    # read_text uses universal newlines, so "\r\n" files chunk exactly like "\n" ones.
    text = path.read_text(encoding=encoding)
    # A UTF-8 byte-order mark is not content; keeping it would change the first chunk's cache key.
    return text.removeprefix("\ufeff")


def load_documents(
    path: str | Path,
    *,
    suffixes: Iterable[str] = DEFAULT_SUFFIXES,
    encoding: str = "utf-8",
) -> list[Document]:
    """Read every text file under `path` (recursively, in sorted order) or the single file `path`.

    Hidden files and folders (a name starting with ".") are skipped, as are empty or whitespace-only files
    and files that cannot be decoded with `encoding` (each undecodable one is logged, and their number is
    logged once at the end). A single file named explicitly is read whatever its suffix.

    Raises ConfigError when the path does not exist, holds no file with one of `suffixes`, or every such
    file was empty or undecodable.
    """
    wanted = _normalize_suffixes(suffixes)
    root = Path(path).expanduser()
    if not root.exists():
        raise ConfigError(
            f"document path {str(root)!r} does not exist; pass a folder of {'/'.join(wanted)} files "
            "or a single text file"
        )

    if root.is_file():
        candidates = [(root, root.name)]
    else:
        candidates = []
        for file in root.rglob("*"):
            relative = file.relative_to(root)
            if file.is_file() and file.suffix.lower() in wanted and not _is_hidden(relative):
                candidates.append((file, relative.as_posix()))
        # Sorting by the relative path (not by rglob's file-system order) makes the chunk order, and with
        # it the index, the same on every machine.
        candidates.sort(key=lambda item: item[1])
        if not candidates:
            raise ConfigError(
                f"no files ending in {', '.join(wanted)} found under {str(root)!r}; add some, or pass "
                "suffixes=... (--suffix on the command line) to match the files you have"
            )

    documents: list[Document] = []
    undecodable = 0
    empty = 0
    for file, source in candidates:
        try:
            text = _read_text(file, encoding)
        except UnicodeDecodeError as exc:
            undecodable += 1
            logger.warning(
                "skipping %s: not valid %s text (%s); pass its encoding, e.g. encoding='latin-1' "
                "(--encoding latin-1 on the command line)",
                file,
                encoding,
                exc.reason,
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
        logger.warning("skipped %d file(s) under %s that are not valid %s text", undecodable, root, encoding)
    if not documents:
        raise ConfigError(
            f"no readable text in {str(root)!r} (suffixes {', '.join(wanted)}): {len(candidates)} file(s) "
            f"found, {empty} empty, {undecodable} not valid {encoding}; add non-empty text files or pass "
            "their encoding=..., e.g. 'latin-1' (--encoding on the command line)"
        )
    return documents
