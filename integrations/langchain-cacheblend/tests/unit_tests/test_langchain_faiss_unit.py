"""FAISS indexes: built from documents with a splitter, saved and loaded without pickle (fake embeddings)."""

from __future__ import annotations

import json
import pickle

import pytest
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_text_splitters import CharacterTextSplitter

from langchain_cacheblend import build_faiss_index, load_faiss_index, save_faiss_index

DOCS = [
    Document(page_content="alpha beta gamma. delta epsilon zeta. eta theta iota.", metadata={"title": "greek"}),
    Document(page_content="one two three. four five six.", metadata={"title": "numbers", "rank": 2}),
]


@pytest.fixture
def embeddings() -> DeterministicFakeEmbedding:
    return DeterministicFakeEmbedding(size=16)


def _splitter() -> CharacterTextSplitter:
    return CharacterTextSplitter(separator=". ", chunk_size=20, chunk_overlap=0)


def test_documents_are_split_and_pieces_keep_their_metadata(embeddings):
    store = build_faiss_index(DOCS, embeddings=embeddings, text_splitter=_splitter())
    pieces = list(store.docstore._dict.values())
    assert len(pieces) > len(DOCS)
    assert {p.metadata["title"] for p in pieces} == {"greek", "numbers"}


def test_saved_index_loads_back_with_the_same_search_results(embeddings, tmp_path):
    store = build_faiss_index(DOCS, embeddings=embeddings, text_splitter=_splitter())
    save_faiss_index(store, tmp_path / "idx")
    assert sorted(p.name for p in (tmp_path / "idx").iterdir()) == ["docstore.json", "index.faiss"]
    loaded = load_faiss_index(tmp_path / "idx", embeddings)
    for query in ("delta epsilon zeta", "four five six"):
        before = store.similarity_search_with_score(query, k=3)
        after = loaded.similarity_search_with_score(query, k=3)
        assert [(d.page_content, d.metadata, s) for d, s in before] == [
            (d.page_content, d.metadata, s) for d, s in after
        ]


def test_a_pickled_langchain_index_is_refused_without_being_unpickled(embeddings, tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    folder = tmp_path / "untrusted"
    store = build_faiss_index(DOCS, embeddings=embeddings, text_splitter=_splitter())
    store.save_local(str(folder))  # LangChain's own format: index.faiss + index.pkl
    (folder / "index.pkl").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(FileNotFoundError, match="holds no saved index"):
        load_faiss_index(folder, embeddings)
    assert not marker.exists()


def test_index_of_other_embeddings_is_refused(embeddings, tmp_path):
    save_faiss_index(build_faiss_index(DOCS, embeddings=embeddings), tmp_path)
    manifest = json.loads((tmp_path / "docstore.json").read_text())
    manifest["embedding_model"] = "some/other-model"
    (tmp_path / "docstore.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="was built with 'some/other-model'"):
        load_faiss_index(tmp_path, embeddings)


def test_index_and_docstore_that_do_not_match_are_refused(embeddings, tmp_path):
    save_faiss_index(build_faiss_index(DOCS, embeddings=embeddings, text_splitter=_splitter()), tmp_path)
    manifest = json.loads((tmp_path / "docstore.json").read_text())
    manifest["ids"] = manifest["ids"][:-1]
    (tmp_path / "docstore.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="do not belong together"):
        load_faiss_index(tmp_path, embeddings)


def test_metadata_that_is_not_json_is_an_error_at_save(embeddings, tmp_path):
    store = build_faiss_index([Document(page_content="x y z", metadata={"when": object()})], embeddings=embeddings)
    with pytest.raises(ValueError, match="not JSON-serializable"):
        save_faiss_index(store, tmp_path)


def test_no_documents_is_an_error(embeddings):
    with pytest.raises(ValueError, match="no documents"):
        build_faiss_index([], embeddings=embeddings)
