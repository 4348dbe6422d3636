"""Tests of the retriever's search: the packaged all-MiniLM-L6-v2 embeddings (loaded once for the module), the FAISS
index built over chunks, and the index saved to a folder and loaded back (its format, its record of its source).
Chunking and document loading are in test_retrieval.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cacheblend_rag.errors import CacheBlendError, ConfigError, PromptError
from cacheblend_rag.retrieval import (
    EMBEDDING_MODEL_NAME,
    Chunk,
    ChunkIndex,
    Document,
    IndexFormatError,
    build_index_from_folder,
    load_embedder,
    split_documents,
)


class WordTokenizer:
    """One token per whitespace-separated word: chunk sizes easy to reason about."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(word) for word in text.split()]


TOPICS = {
    "photosynthesis": "Photosynthesis lets green plants capture sunlight with chlorophyll in their leaves "
    "and "
    "turn carbon dioxide and water into glucose, releasing oxygen as a by-product.",
    "volcano": "A volcano erupts when molten rock called magma rises through cracks in the Earth's crust, "
    "spilling lava, ash and gas over the surrounding land.",
    "basketball": "Basketball is played by two teams of five who score by shooting the ball through a hoop "
    "ten feet above the court; James Naismith invented it in 1891.",
    "bread": "To bake bread, mix flour, water, salt and yeast, knead the dough, let it rise for an hour, "
    "shape the loaf and bake it in a hot oven until the crust is brown.",
    "jupiter": "Jupiter is the largest planet in the solar system, a gas giant with a Great Red Spot storm "
    "and dozens of moons, including Ganymede, the biggest moon of all.",
}


@pytest.fixture(scope="module")
def embedder():
    return load_embedder()


@pytest.fixture(scope="module")
def chunks() -> list[Chunk]:
    documents = [Document(text, f"{name}.txt") for name, text in TOPICS.items()]
    return split_documents(documents, WordTokenizer(), chunk_tokens=64)


@pytest.fixture(scope="module")
def index(embedder, chunks: list[Chunk]) -> ChunkIndex:
    return ChunkIndex.build(chunks, embedder, batch_size=2, show_progress=False)


def test_load_embedder_is_cached_per_device(embedder) -> None:
    assert load_embedder("cpu") is embedder
    assert embedder.get_embedding_dimension() == 384


@pytest.mark.parametrize(
    ("question", "topic"),
    [
        ("How do plants make food from light?", "photosynthesis"),
        ("What happens when lava comes out of a mountain?", "volcano"),
        ("Who invented the sport with hoops?", "basketball"),
        ("Which planet is the biggest?", "jupiter"),
        ("How long should dough rise?", "bread"),
    ],
)
def test_the_chunk_on_the_topic_is_retrieved_first(index: ChunkIndex, question: str, topic: str) -> None:
    hits = index.search(question, k=3)
    assert hits[0].chunk.source == f"{topic}.txt"
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert -1.0 <= hits[-1].score <= hits[0].score <= 1.0 + 1e-5


def test_search_k_larger_than_index_returns_all(index: ChunkIndex) -> None:
    assert len(index) == len(TOPICS)
    hits = index.search("anything at all", k=50)
    assert sorted(h.chunk.source for h in hits) == sorted(f"{t}.txt" for t in TOPICS)


@pytest.mark.parametrize("query", ["", "   \n"])
def test_empty_query_is_an_error(index: ChunkIndex, query: str) -> None:
    with pytest.raises(PromptError, match="non-empty"):
        index.search(query)


def test_bad_k_and_empty_build_are_errors(index: ChunkIndex, embedder) -> None:
    with pytest.raises(ConfigError, match="k must be a positive integer, got 0"):
        index.search("question", k=0)
    with pytest.raises(PromptError, match="zero chunks"):
        ChunkIndex.build([], embedder, show_progress=False)
    with pytest.raises(ConfigError, match="batch_size"):
        ChunkIndex.build([Chunk("t", "s", 0, 1)], embedder, batch_size=0)


def test_save_load_round_trip_gives_same_results(index: ChunkIndex, embedder, tmp_path: Path) -> None:
    index.save(tmp_path / "idx")
    loaded = ChunkIndex.load(tmp_path / "idx", embedder)
    assert loaded.chunks == index.chunks
    assert loaded.model_name == EMBEDDING_MODEL_NAME
    for question in ["Which planet is the biggest?", "baking at home"]:
        before, after = index.search(question, k=5), loaded.search(question, k=5)
        assert [h.chunk for h in before] == [h.chunk for h in after]
        assert [h.score for h in before] == pytest.approx([h.score for h in after], abs=1e-6)


def test_saved_metadata_is_json_not_pickle(index: ChunkIndex, tmp_path: Path) -> None:
    index.save(tmp_path)
    payload = json.loads((tmp_path / "chunks.json").read_text(encoding="utf-8"))
    assert payload["format_version"] == 1
    assert payload["embedding_model"] == EMBEDDING_MODEL_NAME and payload["embedding_dim"] == 384
    assert [c["text"] for c in payload["chunks"]] == [c.text for c in index.chunks]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda d: (d / "chunks.json").write_text("{not json", encoding="utf-8"), "not valid JSON"),
        (lambda d: (d / "chunks.json").write_text("[" * 200_000, encoding="utf-8"), "nests too deeply"),
        (lambda d: (d / "chunks.json").unlink(), "chunks.json is missing"),
        (lambda d: (d / "index.faiss").unlink(), "index.faiss is missing"),
        (lambda d: (d / "index.faiss").write_bytes(b"garbage"), "checksum"),
        (lambda d: _edit_json(d, format_version=99), "format version 99"),
        (lambda d: _edit_json(d, embedding_model="other/model"), "other/model"),
        (lambda d: _edit_json(d, chunks=[{"text": "only"}]), "malformed"),
    ],
)
def test_corrupt_or_mismatched_index_says_to_rebuild(
    index: ChunkIndex, embedder, tmp_path: Path, damage, match: str
) -> None:
    index.save(tmp_path)
    damage(tmp_path)
    with pytest.raises(IndexFormatError, match=match) as info:
        ChunkIndex.load(tmp_path, None if "other/model" in match else embedder)
    assert "rebuild it from the documents" in str(info.value) and "delete" not in str(info.value)
    assert isinstance(info.value, CacheBlendError)


def _edit_json(folder: Path, **changes: object) -> None:
    path = folder / "chunks.json"
    payload = json.loads(path.read_text(encoding="utf-8"))
    payload.update(changes)
    path.write_text(json.dumps(payload), encoding="utf-8")


def test_wrong_embedding_dimension_is_caught(index: ChunkIndex, tmp_path: Path) -> None:
    class TinyEmbedder:
        def get_sentence_embedding_dimension(self) -> int:
            return 8

        def encode(self, sentences, **kwargs):  # pragma: no cover - never reached
            raise AssertionError

    index.save(tmp_path)
    with pytest.raises(IndexFormatError, match="384-dimensional vectors but the embedder makes 8"):
        ChunkIndex.load(tmp_path, TinyEmbedder())


def test_build_index_from_folder(embedder, tmp_path: Path) -> None:
    for name, text in TOPICS.items():
        (tmp_path / f"{name}.md").write_text(text, encoding="utf-8")
    index = build_index_from_folder(tmp_path, WordTokenizer(), chunk_tokens=16, embedder=embedder, show_progress=False)
    assert all(c.token_count <= 16 for c in index.chunks)
    assert index.search("Tell me about magma and eruptions", k=1)[0].chunk.source == "volcano.md"


def test_unnamed_embedder_is_saved_as_custom_and_reloads_with_itself(embedder, chunks, tmp_path: Path) -> None:
    class Wrapped:
        """A stand-in embedder that reports no model name."""

        def encode(self, sentences, **kwargs):
            return embedder.encode(sentences, **kwargs)

        def get_sentence_embedding_dimension(self) -> int:
            return 384

    wrapped = Wrapped()
    ChunkIndex.build(chunks, wrapped, show_progress=False).save(tmp_path)
    assert ChunkIndex.load(tmp_path, wrapped).model_name == "custom"
    with pytest.raises(IndexFormatError, match="'custom' but is being loaded with"):
        ChunkIndex.load(tmp_path, embedder)  # the packaged model knows its name, so it refuses


def test_the_index_records_its_source_and_loads_it_back(index: ChunkIndex, embedder, tmp_path: Path) -> None:
    from cacheblend_rag.retrieval import IndexSource, find_document_files

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("some text")
    files = find_document_files(tmp_path / "docs")
    record = IndexSource(
        str(tmp_path / "docs"), files.suffixes, files.globs, False, "utf-8", 64, "m", "e", files.digest()
    )
    ChunkIndex(index.chunks, index._index, embedder, index.model_name, record).save(tmp_path / "index")
    assert ChunkIndex.load(tmp_path / "index", embedder).source == record
    (tmp_path / "docs" / "a.txt").write_text("other, longer text")
    assert find_document_files(tmp_path / "docs").digest() != record.files_sha256
    index.save(tmp_path / "plain")
    assert ChunkIndex.load(tmp_path / "plain", embedder).source is None  # built without a record
