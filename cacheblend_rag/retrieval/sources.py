"""Which files of a documents folder are read, and the record a saved index keeps of them.

Scope: walk a folder (or take one file) and choose its documents by suffix or glob, under a link policy:
a symbolic link, to a file or a folder, whose target lies outside the folder is skipped unless the caller
asks to follow links, so a link to `~/.ssh` or `/etc` never ends up in an index. Reading the chosen files
is `documents.py`'s job. `IndexSource` is what an index folder records about the documents it was built
from, so a later run with other documents or settings rebuilds it instead of answering from stale chunks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath

from cacheblend_rag.advice import option
from cacheblend_rag.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_SUFFIXES: tuple[str, ...] = (".txt", ".md", ".rst")
# One document at most this large by default. Splitting ran at 0.06-0.13 MB/s with the default preset's
# tokenizer on one shared CPU core (measured on MuSiQue passages, 512-token chunks; see docs/configuration.md),
# so 8 MB is one to two minutes of chunking, and embedding its ~4000 chunks a few minutes more on a CPU.
DEFAULT_MAX_DOCUMENT_BYTES = 8 * 2**20


@dataclass(frozen=True)
class DocumentFiles:
    """The files chosen under a documents path, in a deterministic order."""

    root: Path  # the folder (or single file) asked for
    files: tuple[tuple[Path, str], ...]  # (path on disk, source name relative to root), sorted by source name
    skipped_links: int  # links leading out of the folder that were not followed
    suffixes: tuple[str, ...] = ()  # the suffixes that chose them (lower case)
    globs: tuple[str, ...] = ()  # the glob patterns that chose them
    follow_links: bool = False  # whether links leading out of the folder were followed

    def digest(self) -> str:
        """SHA-256 over every chosen file's name, size and modification time: changes when any file does."""
        h = hashlib.sha256()
        for path, source in self.files:
            st = path.stat()
            h.update(f"{source}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
        return h.hexdigest()


@dataclass(frozen=True)
class IndexSource:
    """What a saved index was built from; a run whose documents or settings differ rebuilds it."""

    docs: str  # the documents path, absolute
    suffixes: tuple[str, ...]  # file suffixes read (lower case)
    globs: tuple[str, ...]  # glob patterns read, relative to the folder
    follow_links: bool  # whether links leading out of the folder were read
    encoding: str  # text encoding the files were decoded with
    chunk_tokens: int  # chunk size, in tokens of `tokenizer`
    tokenizer: str  # the model whose tokenizer measured the chunks
    embedding_model: str  # the embedding model of the vectors
    files_sha256: str  # DocumentFiles.digest() of the files read

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> IndexSource | None:
        """The record saved by `to_json`, or None when `data` is not one (an index saved without a record)."""
        if not isinstance(data, Mapping) or set(data) != {f.name for f in fields(cls)}:
            return None
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**values)

    def differences(self, other: IndexSource) -> list[str]:
        """The fields that differ, as `name: old -> new`."""
        mine, theirs = self.to_json(), other.to_json()
        return [f"{k}: {mine[k]!r} -> {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]


def normalize_suffixes(suffixes: Iterable[str]) -> tuple[str, ...]:
    # A bare string would otherwise be iterated character by character.
    if isinstance(suffixes, str):
        suffixes = (suffixes,)
    normalized = tuple(s.lower() for s in suffixes)
    for suffix in normalized:
        if not suffix.startswith(".") or len(suffix) < 2:
            raise ConfigError(
                f"each suffix must start with a dot, e.g. '.txt', got {suffix!r}; for files without a suffix "
                f"(such as 'copyright') pass a glob instead, e.g. {option('globs', '**/' + suffix)}"
            )
    return normalized


def normalize_globs(globs: Iterable[str]) -> tuple[str, ...]:
    if isinstance(globs, str):
        globs = (globs,)
    normalized = tuple(globs)
    for pattern in normalized:
        if not pattern or pattern.startswith("/") or ".." in PurePosixPath(pattern).parts:
            raise ConfigError(
                f"a glob is a pattern relative to the documents folder, e.g. '**/copyright', got {pattern!r}"
            )
    return normalized


def _glob_match(parts: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    """Shell-style match of a relative path, component by component; '**' matches any number of folders."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_glob_match(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatchcase(parts[0], pattern[0]) and _glob_match(parts[1:], pattern[1:])


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def find_document_files(
    path: str | Path,
    *,
    suffixes: Iterable[str] | None = None,
    globs: Iterable[str] = (),
    follow_links: bool = False,
) -> DocumentFiles:
    """The files under `path` whose suffix is one of `suffixes` or whose path relative to `path` matches one of
    `globs` (both case as given: suffixes ignore case, globs do not), or the single file `path`.

    `suffixes` defaults to `.txt`/`.md`/`.rst` when no glob is given, and to none when one is. Hidden files and
    folders (a name starting with ".") and anything that is not a regular file are skipped; so are links whose
    target lies outside the folder, unless `follow_links`, and, with one warning line each, links that resolve to no
    file (a loop such as `ln -s self self`, a link to nothing) and files this user may not read. Raises ConfigError
    when nothing matches.
    """
    globs = normalize_globs(globs)
    wanted = normalize_suffixes(DEFAULT_SUFFIXES if suffixes is None and not globs else suffixes or ())
    if not wanted and not globs:
        raise ConfigError("pass at least one file suffix (e.g. '.txt') or glob (e.g. '**/copyright')")
    patterns = [PurePosixPath(g).parts for g in globs]
    root = Path(path).expanduser()
    try:
        mode = root.stat().st_mode
    except FileNotFoundError:
        message = f"document path {str(root)!r} does not exist; pass a folder of text files or one file"
        raise ConfigError(message) from None
    if stat.S_ISREG(mode):
        return DocumentFiles(root, ((root, root.name),), 0, wanted, globs, follow_links)
    if not stat.S_ISDIR(mode):
        raise ConfigError(f"document path {str(root)!r} is not a regular file or a folder; pass a folder of text files")

    real_root = os.path.realpath(root)
    files: list[tuple[Path, str]] = []
    skipped = 0
    unresolved: list[str] = []  # entries no file stands behind: a link loop, a link to nothing
    unreadable: list[str] = []  # files this user may not read (permissions): skipped, named once
    seen = {real_root}  # real folders already walked: a link loop is walked once
    stack = [(root, PurePosixPath())]
    while stack:
        folder, relative = stack.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue  # unreadable folder: nothing to read in it
        for entry in entries:
            if entry.name.startswith("."):
                continue  # .git/, .venv/, editor backups: never meant as documents
            name = relative / entry.name
            try:  # a link in a loop (`ln -s self self`) or to nothing resolves to no file: skipped, counted
                real = os.path.realpath(entry.path, strict=True)
                is_dir, is_file = entry.is_dir(), entry.is_file()
            except OSError:
                unresolved.append(name.as_posix())
                continue
            if entry.is_symlink() and not _inside(real, real_root) and not follow_links:
                skipped += 1
                continue
            if is_dir:
                if entry.is_symlink() and _inside(real, real_root):
                    continue  # its files are read through the folder itself
                if real not in seen:
                    seen.add(real)
                    stack.append((Path(entry.path), name))
            elif is_file and (
                PurePosixPath(entry.name).suffix.lower() in wanted or any(_glob_match(name.parts, p) for p in patterns)
            ):
                if os.access(real, os.R_OK):
                    files.append((Path(entry.path), name.as_posix()))
                else:
                    unreadable.append(name.as_posix())
    if unreadable:
        shown = ", ".join(repr(n) for n in sorted(unreadable)[:3]) + (" ..." if len(unreadable) > 3 else "")
        logger.warning("skipped %d file%s under %s this user may not read: %s", len(unreadable),
                       "" if len(unreadable) == 1 else "s", root, shown)  # fmt: skip
    if unresolved:
        shown = ", ".join(repr(n) for n in sorted(unresolved)[:3]) + (" ..." if len(unresolved) > 3 else "")
        logger.warning("skipped %d entr%s under %s that resolve to no file (a link loop or a link to nothing): %s",
                       len(unresolved), "y" if len(unresolved) == 1 else "ies", root, shown)  # fmt: skip
    # Sorting by the relative path (not the file system's order) makes the chunk order, and with it the index,
    # the same on every machine.
    files.sort(key=lambda item: item[1])
    if not files:
        what = ", ".join([*wanted, *globs])
        raise ConfigError(
            f"no files matching {what} found under {str(root)!r}; add some, or pass e.g. "
            f"{option('suffixes', '.log')} or {option('globs', '**/*.log')} to match the files you have"
        )
    return DocumentFiles(root, tuple(files), skipped, wanted, globs, follow_links)


def check_document_sizes(files: DocumentFiles, max_bytes: int) -> None:
    """ConfigError naming the first file above `max_bytes`: checked before anything is read."""
    for path, _ in files.files:
        size = path.stat().st_size
        if size > max_bytes:
            raise ConfigError(
                f"{str(path)!r} is {size} bytes ({size / 2**20:.1f} MB), above the limit of {max_bytes} bytes "
                f"({max_bytes / 2**20:g} MB) for one document (splitting and embedding it would take long); "
                f"raise it with {option('max_document_bytes', 'N')} or split the file"
            )
