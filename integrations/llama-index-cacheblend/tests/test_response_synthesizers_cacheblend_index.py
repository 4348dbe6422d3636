"""The FAISS index on the packaged all-MiniLM-L6-v2: built, persisted, reloaded, and searched the same way."""

from __future__ import annotations

from pathlib import Path

import pytest
from llama_index.core import MockEmbedding
from llama_index.core.schema import Document

from llama_index.response_synthesizers.cacheblend import build_faiss_index, load_faiss_index, minilm_embedding

DOCS = [
    Document(text="The Eiffel Tower is a wrought-iron lattice tower in Paris, finished in 1889.", doc_id="eiffel"),
    Document(text="Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.", doc_id="photo"),
    Document(text="The Danube flows through Vienna, Budapest and Belgrade to the Black Sea.", doc_id="danube"),
]


@pytest.fixture(scope="module")
def embed_model():
    return minilm_embedding()


def test_packaged_embedder_ranks_the_related_text_first(embed_model) -> None:
    query = embed_model.get_query_embedding("Which river passes Budapest?")
    texts = [embed_model.get_text_embedding(d.text) for d in DOCS]
    assert len(query) == 384
    scores = [embed_model.similarity(query, t) for t in texts]
    assert max(range(3), key=scores.__getitem__) == 2


def test_persisted_index_reloads_and_retrieves_the_same_nodes(embed_model, tmp_path: Path) -> None:
    index = build_faiss_index(DOCS, embed_model=embed_model, persist_dir=tmp_path)
    before = index.as_retriever(similarity_top_k=2).retrieve("tall iron tower in France")
    assert before[0].node.ref_doc_id == "eiffel"

    reloaded = load_faiss_index(tmp_path, embed_model=embed_model)
    after = reloaded.as_retriever(similarity_top_k=2).retrieve("tall iron tower in France")
    assert [n.node.node_id for n in after] == [n.node.node_id for n in before]
    assert [n.node.get_content() for n in after] == [n.node.get_content() for n in before]
    assert [n.score for n in after] == pytest.approx([n.score for n in before])
    assert 0.0 < after[0].score <= 1.0  # cosine similarity: normalized vectors in an inner-product index


def test_loading_needs_a_saved_index_and_the_same_embedder(embed_model, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no saved index"):
        load_faiss_index(tmp_path / "missing", embed_model=embed_model)
    build_faiss_index(DOCS[:1], embed_model=embed_model, persist_dir=tmp_path)
    with pytest.raises(ValueError, match="384-dimensional vectors but the embedding model gives 8"):
        load_faiss_index(tmp_path, embed_model=MockEmbedding(embed_dim=8))
