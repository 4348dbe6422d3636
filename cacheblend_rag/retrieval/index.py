"""A FAISS index over chunks: build, search by cosine similarity, save and load.

Scope: chunks in, ranked chunks out. Vectors are L2-normalized and stored in a `faiss.IndexFlatIP`, so the
inner product FAISS returns is the cosine similarity. On disk an index is a folder of two files:
`index.faiss` (FAISS's own serialization) and `chunks.json` (the chunks, the format version, the embedding
model's name and dimension, a checksum of `index.faiss`, and optionally the `IndexSource` it was built
from). No pickle anywhere, so loading an index from an untrusted folder cannot run code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from cacheblend_rag.errors import CacheBlendError, ConfigError, PromptError
from cacheblend_rag.retrieval.chunking import Chunk
from cacheblend_rag.retrieval.embeddings import (
    EMBEDDING_MODEL_NAME,
    Embedder,
    embed_texts,
    embedder_name,
    embedding_dimension,
    load_embedder,
)
from cacheblend_rag.retrieval.faiss_file import flat_index_problem, import_faiss
from cacheblend_rag.retrieval.sources import IndexSource

if TYPE_CHECKING:
    import faiss

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
INDEX_FILE = "index.faiss"
CHUNKS_FILE = "chunks.json"
# Recorded for an embedder whose model name is unknown; loading such an index skips the name check.
CUSTOM_EMBEDDER_NAME = "custom"


class IndexFormatError(CacheBlendError):
    """A saved index is missing, corrupt, from another format version, or from another embedding model."""


@dataclass(frozen=True)
class RetrievedChunk:
    """One search hit."""

    chunk: Chunk
    score: float  # cosine similarity to the query, in [-1, 1]; higher is closer


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB blocks (the saved index's check, and the kept index's per file)."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _rebuild_hint(folder: Path) -> str:
    return (
        f"rebuild it from the documents (`cacheblend-rag index --docs DIR --out {str(folder)!r}`, or "
        f"ChunkIndex.build(chunks).save({str(folder)!r}) in Python)"
    )


def index_folder_state(folder: str | Path) -> Literal["new", "index", "file", "other"]:
    """What is at `folder`: nothing or an empty folder ("new"), a saved index, a file, or a folder of other
    things ("other": someone's files, never to be written over)."""
    folder = Path(folder)
    if not os.path.lexists(folder):
        return "new"
    if not folder.is_dir():
        return "file"
    names = set(os.listdir(folder))
    if not names:
        return "new"
    return "index" if CHUNKS_FILE in names or INDEX_FILE in names else "other"


def _model_name(embedder: Embedder | None, model_name: str | None) -> str | None:
    """The embedding model's name: given explicitly, the packaged one by default, else as it reports it."""
    if model_name is not None:
        return model_name
    return EMBEDDING_MODEL_NAME if embedder is None else embedder_name(embedder)


def _chunk_from_json(item: Any) -> Chunk:
    """A Chunk from its saved form; TypeError/KeyError/ValueError on anything malformed."""
    text, source, index, token_count = item["text"], item["source"], item["index"], item["token_count"]
    metadata = item.get("metadata", {})
    if not isinstance(text, str) or not isinstance(source, str) or not isinstance(metadata, dict):
        raise TypeError("chunk text and source must be strings and metadata an object")
    if not isinstance(index, int) or not isinstance(token_count, int):
        raise TypeError("chunk index and token_count must be integers")
    if not text.strip():
        raise ValueError("a chunk's text is empty")
    return Chunk(text, source, index, token_count, metadata)


class ChunkIndex:
    """Chunks plus their embeddings in a FAISS inner-product index; build with `build` or `load`."""

    def __init__(
        self,
        chunks: Sequence[Chunk],
        index: faiss.Index,
        embedder: Embedder,
        model_name: str,
        source: IndexSource | None = None,
    ) -> None:
        if index.ntotal != len(chunks):
            raise ConfigError(
                f"the FAISS index holds {index.ntotal} vectors but {len(chunks)} chunks were given; "
                "build it with ChunkIndex.build(chunks)"
            )
        self._chunks = tuple(chunks)
        self._index = index
        self.embedder = embedder
        self.model_name = model_name  # the embedding model's name, recorded when saved
        self.source = source  # the documents and settings it was built from, when known; recorded when saved

    @classmethod
    def build(
        cls,
        chunks: Iterable[Chunk],
        embedder: Embedder | None = None,
        *,
        batch_size: int = 32,
        show_progress: bool = True,
        model_name: str | None = None,
        source: IndexSource | None = None,
    ) -> ChunkIndex:
        """Embed `chunks` and index them; `source` records what they were split from.

        `embedder` defaults to the packaged all-MiniLM-L6-v2 on CPU. `model_name` is the name saved with
        the index so a later load can check it; by default it is the name the embedder reports (a
        SentenceTransformer's model card base model), or "custom" when it reports none.
        """
        chunks = tuple(chunks)
        if not chunks:
            raise PromptError("cannot build an index from zero chunks; load some documents and split them first")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}; use e.g. 32")
        model_name = _model_name(embedder, model_name) or CUSTOM_EMBEDDER_NAME
        if embedder is None:
            embedder = load_embedder()

        faiss = import_faiss()
        vectors = embed_texts(embedder, [c.text for c in chunks], batch_size=batch_size, show_progress=show_progress)
        index = faiss.IndexFlatIP(vectors.shape[1])
        index.add(vectors)
        return cls(chunks, index, embedder, model_name, source)

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        return self._chunks

    @property
    def dimension(self) -> int:
        return int(self._index.d)

    def vectors(self) -> np.ndarray:
        """The chunks' unit-length embeddings as stored, one row per chunk in index order: (N, dim) float32."""
        return self._index.reconstruct_n(0, self._index.ntotal)

    def neighbour_contexts(self, n: int) -> list[list[str]]:
        """For each chunk (in index order), its `n` most similar other chunks' texts in the order its KV is
        prefilled after them, the most similar last (`CacheBlendEngine.set_chunk_context(texts, contexts)`).
        Uses the stored vectors: nothing is embedded again."""
        from cacheblend_rag.retrieval.neighbours import nearest_neighbours, neighbour_context

        vectors = self.vectors()
        texts = [c.text for c in self._chunks]
        found = nearest_neighbours(vectors, vectors, n, query_texts=texts, pool_texts=texts)
        return [neighbour_context([texts[j] for j in ids]) for ids in found]

    def search(self, query: str, k: int = 6) -> list[RetrievedChunk]:
        """The `k` chunks most similar to `query`, best first (all of them when k exceeds the size)."""
        return self.search_many([query], k)[0]

    def search_many(self, queries: Sequence[str], k: int = 6, *, batch_size: int = 64) -> list[list[RetrievedChunk]]:
        """`search` for many queries at once, embedded in batches of `batch_size`: one list of hits per query."""
        for query in queries:
            if not isinstance(query, str) or not query.strip():
                raise PromptError(f"the search query must be non-empty text, got {query!r}; ask a question")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"k must be a positive integer, got {k!r}; use e.g. 6")
        if not queries:
            return []
        k = min(k, len(self._chunks))
        vectors = embed_texts(self.embedder, list(queries), batch_size=batch_size, show_progress=False)  # (Q, dim)
        scores, ids = self._index.search(vectors, k)  # (Q, k) each
        return [
            [RetrievedChunk(self._chunks[i], float(s)) for s, i in zip(row_s, row_i, strict=True) if i >= 0]
            for row_s, row_i in zip(scores, ids, strict=True)  # FAISS pads with -1 when it has fewer hits than asked
        ]

    def save(self, folder: str | Path) -> Path:
        """Write the index to `folder` (created if needed) and return its path."""
        faiss = import_faiss()
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        index_path, chunks_path = folder / INDEX_FILE, folder / CHUNKS_FILE

        # Write to temporary names and rename, so an interrupted save never leaves a half-written pair
        # that would look valid. FAISS gets bytes, not a path: it cannot open a path that is not valid UTF-8.
        tmp_index = index_path.with_name(INDEX_FILE + ".tmp")
        tmp_index.write_bytes(faiss.serialize_index(self._index).tobytes())
        payload = {
            "format_version": FORMAT_VERSION,
            "embedding_model": self.model_name,
            "embedding_dim": self.dimension,
            "index_sha256": file_sha256(tmp_index),
            "source": self.source.to_json() if self.source is not None else None,
            "chunks": [
                {
                    "text": c.text,
                    "source": c.source,
                    "index": c.index,
                    "token_count": c.token_count,
                    "metadata": dict(c.metadata),
                }
                for c in self._chunks
            ],
        }
        try:
            encoded = json.dumps(payload, ensure_ascii=False, indent=1)
        except (TypeError, ValueError) as exc:
            tmp_index.unlink(missing_ok=True)
            raise ConfigError(
                f"chunk metadata must be JSON-serializable (str, numbers, bool, None, lists, dicts): {exc}; "
                "convert the offending values to strings"
            ) from exc
        tmp_chunks = chunks_path.with_name(CHUNKS_FILE + ".tmp")
        # A file name that is not valid UTF-8 reaches Python as lone surrogates; written as JSON escapes
        # (\udcff in the file) they read back as the same name.
        tmp_chunks.write_bytes(encoded.encode("utf-8", "backslashreplace"))
        os.replace(tmp_index, index_path)
        os.replace(tmp_chunks, chunks_path)
        return folder

    @classmethod
    def load(cls, folder: str | Path, embedder: Embedder | None = None, *, model_name: str | None = None) -> ChunkIndex:
        """Read an index written by `save`.

        With no `embedder` the packaged all-MiniLM-L6-v2 is used and the index must have been built with it.
        The embedder's name (`model_name`, or the name it reports) must match the saved one; when neither
        side knows its name ("custom") only the vector dimension is checked.
        Raises IndexFormatError, saying to rebuild, on any missing, corrupt or mismatched file.
        """
        faiss = import_faiss()
        folder = Path(folder)
        index_path, chunks_path = folder / INDEX_FILE, folder / CHUNKS_FILE
        hint = _rebuild_hint(folder)
        for path in (chunks_path, index_path):
            if not path.is_file():
                raise IndexFormatError(f"no saved index at {str(folder)!r}: {path.name} is missing; {hint}")

        try:
            payload = json.loads(chunks_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise IndexFormatError(f"{str(chunks_path)!r} is not valid JSON ({exc}); {hint}") from exc
        except RecursionError:
            message = f"{str(chunks_path)!r} nests too deeply to be an index description; {hint}"
            raise IndexFormatError(message) from None
        if not isinstance(payload, dict):
            raise IndexFormatError(f"{str(chunks_path)!r} does not hold an index description; {hint}")
        version = payload.get("format_version")
        if version != FORMAT_VERSION:
            raise IndexFormatError(
                f"{str(chunks_path)!r} has format version {version!r}, this version of cacheblend-rag reads "
                f"{FORMAT_VERSION}; {hint}"
            )

        try:
            stored_name = payload["embedding_model"]
            stored_dim = payload["embedding_dim"]
            stored_sha = payload["index_sha256"]
            chunks = [_chunk_from_json(item) for item in payload["chunks"]]
            if not isinstance(stored_dim, int) or not isinstance(stored_name, str):
                raise TypeError("embedding_dim must be an int and embedding_model a string")
        except (KeyError, TypeError, ValueError) as exc:
            raise IndexFormatError(f"{str(chunks_path)!r} has a missing or malformed field ({exc}); {hint}") from exc

        expected = _model_name(embedder, model_name)
        if expected is not None and stored_name != expected:
            raise IndexFormatError(
                f"the index at {str(folder)!r} was built with embedding model {stored_name!r} but is being "
                f"loaded with {expected!r}; {hint} with this model, or load it with the one it was built with"
            )

        if file_sha256(index_path) != stored_sha:
            raise IndexFormatError(
                f"{str(index_path)!r} does not match {CHUNKS_FILE} (checksum differs: changed or corrupt); {hint}"
            )
        problem = flat_index_problem(index_path, dim=stored_dim, count=len(chunks))
        if problem is not None:  # checked before FAISS allocates what the file claims
            raise IndexFormatError(f"{str(index_path)!r} cannot be loaded: {problem}; {hint}")
        try:
            index = faiss.deserialize_index(np.frombuffer(index_path.read_bytes(), dtype=np.uint8))
        except RuntimeError as exc:
            raise IndexFormatError(f"FAISS cannot read {str(index_path)!r} ({exc}); {hint}") from exc
        if index.d != stored_dim or index.ntotal != len(chunks):
            raise IndexFormatError(
                f"{str(index_path)!r} holds {index.ntotal} vectors of dimension {index.d}, but "
                f"{CHUNKS_FILE} describes {len(chunks)} chunks of dimension {stored_dim}; {hint}"
            )

        if embedder is None:
            embedder = load_embedder()
        actual_dim = embedding_dimension(embedder)
        if actual_dim != stored_dim:
            raise IndexFormatError(
                f"the index at {str(folder)!r} holds {stored_dim}-dimensional vectors but the embedder makes "
                f"{actual_dim}-dimensional ones; {hint} with this embedder, or load it with the one it was "
                "built with"
            )
        return cls(chunks, index, embedder, stored_name, IndexSource.from_json(payload.get("source")))
