"""A folder's index kept on disk and brought up to date: only new and changed files are split and embedded again.

A kept index is a saved `ChunkIndex` folder (`index.faiss`, `chunks.json`) plus `files.json`: the settings its
chunks and vectors depend on (the folder, how its files are chosen and decoded, the chunk size, the tokenizer, the
embedding model) and, per file in index order, the SHA-256 of its bytes and the number of chunks it gave.
`prepare_update` compares a folder with its kept index (every file is read once, to hash it) and reads the new and
changed files; `IndexUpdate.build` splits and embeds those alone, takes the unchanged files' chunks and vectors from
the kept index, drops the removed files, and saves the result when anything changed. The index is the one a fresh
build gives: the same chunks in the same order. A kept index that cannot be used (damaged, another format, other
settings) is rebuilt, and `IndexUpdate.problem` says why. Nothing is pickled: FAISS's own format and JSON.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cacheblend_rag.errors import ConfigError, PromptError
from cacheblend_rag.retrieval.chunking import Chunk, Tokenizer, split_documents
from cacheblend_rag.retrieval.documents import Document, read_documents
from cacheblend_rag.retrieval.embeddings import Embedder, embed_texts, load_embedder
from cacheblend_rag.retrieval.faiss_file import import_faiss
from cacheblend_rag.retrieval.index import ChunkIndex, IndexFormatError, file_sha256, index_folder_state
from cacheblend_rag.retrieval.sources import DocumentFiles, IndexSource

FILES_FILE = "files.json"
KEPT_FORMAT = 1
_SHOWN_NAMES = 3  # files named in a summary line, per kind


def index_settings(record: IndexSource, overlap_tokens: int = 0) -> dict[str, Any]:
    """What an index's chunks and vectors depend on besides the files' contents: `record` without its digest of
    the files, and the chunk overlap."""
    settings: dict[str, Any] = {k: v for k, v in record.to_json().items() if k != "files_sha256"}
    settings["overlap_tokens"] = overlap_tokens
    return {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}  # as JSON reads it back


def index_key(record: IndexSource, overlap_tokens: int = 0) -> str:
    """A short digest of `index_settings`: the name of a folder's kept index under a cache folder."""
    text = json.dumps(index_settings(record, overlap_tokens), sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class KeptFile:
    """One file of a kept index."""

    source: str  # its name relative to the folder
    sha256: str  # of its bytes when it was indexed
    chunks: int  # the chunks it gave, laid one file after the other in index order (0: empty or unreadable)


class _Unusable(Exception):
    """Why a kept index is not used."""


def _read_files(folder: Path, settings: dict[str, Any]) -> list[KeptFile]:
    path = folder / FILES_FILE
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
        if payload["format"] != KEPT_FORMAT:
            raise _Unusable(f"{FILES_FILE} has format {payload['format']!r}, this version reads {KEPT_FORMAT}")
        kept = [KeptFile(f["source"], f["sha256"], f["chunks"]) for f in payload["files"]]
        stored = payload["settings"]
    except FileNotFoundError:
        raise _Unusable(f"{FILES_FILE} is missing") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError) as exc:
        raise _Unusable(f"{FILES_FILE} cannot be read ({type(exc).__name__}: {exc})") from None
    if stored != settings:
        keys = sorted(set(stored) | set(settings)) if isinstance(stored, dict) else sorted(settings)
        changed = [f"{k}: {stored.get(k)!r} -> {settings.get(k)!r}" for k in keys if isinstance(stored, dict)
                   and stored.get(k) != settings.get(k)]  # fmt: skip
        raise _Unusable("it was built with other settings (" + ("; ".join(changed) or "unreadable") + ")")
    for f in kept:
        if not (isinstance(f.source, str) and isinstance(f.sha256, str) and type(f.chunks) is int and f.chunks >= 0):
            raise _Unusable(f"{FILES_FILE} has a malformed entry for {f.source!r}")
    return kept


def _read_kept(folder: Path, settings: dict[str, Any], embedder: Embedder | None) -> tuple[ChunkIndex, list[KeptFile]]:
    """The kept index at `folder` and its files, checked against each other; _Unusable when it cannot serve."""
    kept = _read_files(folder, settings)
    try:
        index = ChunkIndex.load(folder, embedder, model_name=settings["embedding_model"])
    except IndexFormatError as exc:
        raise _Unusable(str(exc)) from None
    start = 0
    for f in kept:
        sources = {c.source for c in index.chunks[start : start + f.chunks]}
        if sources - {f.source} or start + f.chunks > len(index):
            raise _Unusable(f"{FILES_FILE} does not match the chunks of the index (at {f.source!r})")
        start += f.chunks
    if start != len(index):
        raise _Unusable(f"{FILES_FILE} accounts for {start} chunks, the index holds {len(index)}")
    return index, kept


@dataclass(frozen=True)
class IndexUpdate:
    """A folder compared with its kept index, before anything is split or embedded; `build` finishes it."""

    folder: Path | None  # where the index is kept (None: built in memory only)
    record: IndexSource  # what the index records of its documents
    settings: dict[str, Any]  # `index_settings(record, overlap)`
    files: tuple[KeptFile, ...]  # the folder's files now, in index order (chunk counts of reused files only)
    reused: tuple[str, ...]  # files whose chunks and vectors are taken from the kept index
    reindexed: tuple[str, ...]  # new or changed files, split and embedded by `build`
    removed: tuple[str, ...]  # files of the kept index that are gone
    documents: tuple[Document, ...]  # the text of the reindexed files that have any
    kept: ChunkIndex | None  # the kept index, when it was usable
    embedder: Embedder | None  # the embedder the index uses (None: the packaged one)
    problem: str | None  # why a kept index found at `folder` is rebuilt (None: none there, or it was used)

    @property
    def changed(self) -> bool:
        """Whether the kept index is out of date (or missing) and `build` writes it."""
        return self.kept is None or bool(self.reindexed or self.removed)

    def summary(self) -> str:
        """One line: what was reused, re-indexed and removed."""

        def named(names: tuple[str, ...]) -> str:
            if not names:
                return ""
            more = f" and {len(names) - _SHOWN_NAMES} more" if len(names) > _SHOWN_NAMES else ""
            return " (" + ", ".join(names[:_SHOWN_NAMES]) + more + ")"

        files = "file" if len(self.reused) == 1 else "files"
        line = (f"index: {len(self.reused)} {files} reused, {len(self.reindexed)} re-indexed{named(self.reindexed)}, "
                f"{len(self.removed)} removed{named(self.removed)}")  # fmt: skip
        if self.kept is None and self.folder is not None:
            line += f"; kept in {self.folder}" if self.problem is None else f"; rebuilt in {self.folder}"
        return line

    def build(self, tokenizer: Tokenizer | None, *, batch_size: int = 32, show_progress: bool = True) -> ChunkIndex:
        """The index of the folder: the reindexed files split with `tokenizer` (needed only when there are any) and
        embedded, the reused files' chunks and vectors as kept; saved to `folder` when it changed."""
        new: list[Chunk] = []
        if self.documents:
            if tokenizer is None:
                raise ConfigError("changed files must be split again: pass the LLM's tokenizer")
            size, overlap = self.record.chunk_tokens, self.settings["overlap_tokens"]
            new = split_documents(self.documents, tokenizer, chunk_tokens=size, overlap_tokens=overlap,
                                  show_progress=show_progress)  # fmt: skip
        embedder = self.embedder if self.embedder is not None else load_embedder()
        new_vectors = embed_texts(embedder, [c.text for c in new], batch_size=batch_size,
                                  show_progress=show_progress) if new else None  # fmt: skip
        by_source: dict[str, list[int]] = {}
        for i, c in enumerate(new):
            by_source.setdefault(c.source, []).append(i)
        old = {f.source: f for f in self.files if f.source in self.reused}
        old_start = _starts(self.kept)
        old_vectors = self.kept.vectors() if self.kept is not None and self.reused else None

        chunks: list[Chunk] = []
        rows: list[np.ndarray] = []  # (n, dim) blocks in index order
        files: list[KeptFile] = []
        for f in self.files:
            if f.source in old:
                assert self.kept is not None and old_vectors is not None, "reused files come from a kept index"
                a = old_start[f.source]
                chunks.extend(self.kept.chunks[a : a + f.chunks])
                rows.append(old_vectors[a : a + f.chunks])
                files.append(f)
            else:
                ids = by_source.get(f.source, [])
                chunks.extend(new[i] for i in ids)
                if ids:
                    assert new_vectors is not None, "new chunks were embedded"
                    rows.append(new_vectors[ids])
                files.append(dataclasses.replace(f, chunks=len(ids)))
        if not chunks:
            raise PromptError(f"no text to index in {self.record.docs!r}: every file is empty or gives no chunk")
        faiss = import_faiss()
        vectors = np.ascontiguousarray(np.concatenate(rows, axis=0), dtype=np.float32)  # (N, dim)
        flat = faiss.IndexFlatIP(vectors.shape[1])
        flat.add(vectors)
        index = ChunkIndex(chunks, flat, embedder, self.settings["embedding_model"], self.record)
        if self.folder is not None and self.changed:
            _save(index, self.folder, self.settings, files)
        return index


def _starts(index: ChunkIndex | None) -> dict[str, int]:
    """Where each source's chunks start in a kept index (they are contiguous, `_read_kept` checked it)."""
    starts: dict[str, int] = {}
    for i, c in enumerate(index.chunks if index is not None else ()):
        starts.setdefault(c.source, i)
    return starts


def _save(index: ChunkIndex, folder: Path, settings: dict[str, Any], files: list[KeptFile]) -> None:
    """The index, then `files.json`; the old `files.json` goes first, so an interrupted save reads as unusable
    (and is rebuilt), never as a record of other chunks."""
    (folder / FILES_FILE).unlink(missing_ok=True)
    index.save(folder)
    payload = {"format": KEPT_FORMAT, "settings": settings, "files": [dataclasses.asdict(f) for f in files]}
    tmp = folder / (FILES_FILE + ".tmp")
    tmp.write_bytes(json.dumps(payload, ensure_ascii=False, indent=1).encode("utf-8", "backslashreplace"))
    os.replace(tmp, folder / FILES_FILE)


def drop_orphans(root: str | Path) -> list[Path]:
    """Delete the kept indexes in the folders of `root` whose documents path no longer exists (a cache folder of
    kept indexes, one per folder and settings, would otherwise grow with every folder ever asked about). -> them."""
    dropped = []
    for folder in Path(root).iterdir() if Path(root).is_dir() else ():
        try:
            docs = json.loads((folder / FILES_FILE).read_text(encoding="utf-8"))["settings"]["docs"]
        except (OSError, UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError):
            continue  # not a kept index, or not a readable one: left alone
        if isinstance(docs, str) and not os.path.exists(docs) and index_folder_state(folder) == "index":
            shutil.rmtree(folder, ignore_errors=True)
            dropped.append(folder)
    return dropped


def prepare_update(
    folder: str | Path | None,
    files: DocumentFiles,
    record: IndexSource,
    *,
    overlap_tokens: int = 0,
    embedder: Embedder | None = None,
) -> IndexUpdate:
    """Compare the chosen `files` (described by `record`) with the index kept at `folder` (None: keep none) and read
    the files to index again. Raises ConfigError when no file has text and none is reused."""
    try:
        codecs.lookup(record.encoding)
    except LookupError as exc:
        raise ConfigError(f"unknown text encoding {record.encoding!r}; use e.g. 'utf-8' or 'latin-1'") from exc
    settings = index_settings(record, overlap_tokens)
    kept_index, kept, problem = None, {}, None
    if folder is not None:
        folder = Path(folder)
        state = index_folder_state(folder)
        if state in ("file", "other"):
            what = "a file" if state == "file" else "a folder of other files"
            raise ConfigError(f"{str(folder)!r} is {what}, not an index folder; keep the index in a new or empty one")
        if state == "index":
            try:
                kept_index, kept_files = _read_kept(folder, settings, embedder)
                kept = {f.source: f for f in kept_files}
                embedder = kept_index.embedder
            except _Unusable as exc:
                problem = str(exc)
    now = [KeptFile(source, file_sha256(path), 0) for path, source in files.files]
    reused = tuple(f.source for f in now if f.source in kept and kept[f.source].sha256 == f.sha256)
    current = [kept[f.source] if f.source in reused else f for f in now]
    reindexed = tuple(f.source for f in now if f.source not in reused)
    removed = tuple(s for s in kept if s not in {f.source for f in now})
    documents: list[Document] = []
    if reindexed:
        wanted = set(reindexed)
        subset = dataclasses.replace(files, files=tuple(item for item in files.files if item[1] in wanted))
        try:
            documents = read_documents(subset, encoding=record.encoding)
        except ConfigError:
            if not any(kept[s].chunks for s in reused):
                raise  # nothing to answer from: say so before any model loads
    return IndexUpdate(folder, record, settings, tuple(current), reused, reindexed, removed, tuple(documents),
                       kept_index, embedder, problem)  # fmt: skip
