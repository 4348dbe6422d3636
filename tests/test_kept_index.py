"""A folder's kept index (`build_index_from_folder(..., index_dir=...)`): reused while its files are unchanged, only
new and changed files embedded again, removed files dropped, a damaged one rebuilt, other settings kept apart.
Embeddings are counted with a stand-in embedder, so "nothing was embedded" is checked, not timed."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from cacheblend_rag.retrieval import IndexSource, build_index_from_folder, index_key
from cacheblend_rag.retrieval.kept_index import FILES_FILE


class WordTokenizer:
    """One token per word."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(word) for word in text.split()]


class CountingEmbedder:
    """Vectors from a hash of each text; counts the texts it embeds."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def get_sentence_embedding_dimension(self) -> int:
        return 16

    def encode(self, sentences, **kwargs):
        self.texts.extend(sentences)
        rows = [np.frombuffer(hashlib.sha256(s.encode()).digest()[:16], dtype=np.uint8) for s in sentences]
        return np.stack(rows).astype(np.float32) + 1.0


def words(seed: int, n: int = 30) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(f"w{rng.integers(1000)}" for _ in range(n))


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, name in enumerate(("a.md", "b.txt", "c.md")):
        (folder / name).write_text(words(i), encoding="utf-8")
    return folder


def build(docs: Path, index_dir: Path, embedder: CountingEmbedder, **kwargs):
    settings = dict(chunk_tokens=16, tokenizer_name="word", model_name="counting", show_progress=False)
    return build_index_from_folder(docs, WordTokenizer(), index_dir=index_dir, embedder=embedder, **settings | kwargs)


def test_a_second_build_of_an_unchanged_folder_embeds_nothing(docs: Path, tmp_path: Path) -> None:
    embedder = CountingEmbedder()
    first = build(docs, tmp_path / "index", embedder)
    assert len(embedder.texts) == len(first) == 6  # 30 words per file, 16 a chunk
    again = CountingEmbedder()
    second = build(docs, tmp_path / "index", again)
    assert again.texts == []
    assert second.chunks == first.chunks
    np.testing.assert_array_equal(second.vectors(), first.vectors())


def test_a_changed_file_is_embedded_again_alone_and_the_index_equals_a_fresh_build(docs: Path, tmp_path: Path) -> None:
    build(docs, tmp_path / "index", CountingEmbedder())
    (docs / "b.txt").write_text(words(7, 20), encoding="utf-8")
    embedder = CountingEmbedder()
    updated = build(docs, tmp_path / "index", embedder)
    assert embedder.texts == [c.text for c in updated.chunks if c.source == "b.txt"]
    fresh = build(docs, tmp_path / "fresh", CountingEmbedder())
    assert updated.chunks == fresh.chunks  # same chunks, same order as a build from nothing
    np.testing.assert_allclose(updated.vectors(), fresh.vectors(), rtol=1e-6)
    new_text = embedder.texts[0]
    assert updated.search(new_text, k=1)[0].chunk.text == new_text  # its vector is the one searched


def test_a_removed_file_drops_out_and_an_added_one_comes_in(docs: Path, tmp_path: Path) -> None:
    build(docs, tmp_path / "index", CountingEmbedder())
    (docs / "a.md").unlink()
    (docs / "d.md").write_text(words(9), encoding="utf-8")
    embedder = CountingEmbedder()
    index = build(docs, tmp_path / "index", embedder)
    assert [c.source for c in index.chunks] == ["b.txt", "b.txt", "c.md", "c.md", "d.md", "d.md"]
    assert {c for c in embedder.texts} == {c.text for c in index.chunks if c.source == "d.md"}
    kept = json.loads((tmp_path / "index" / FILES_FILE).read_text())
    assert [f["source"] for f in kept["files"]] == ["b.txt", "c.md", "d.md"]


@pytest.mark.parametrize("damage", ["index.faiss", "chunks.json", FILES_FILE])
def test_a_damaged_kept_index_is_rebuilt_with_a_warning(docs: Path, tmp_path: Path, damage: str, caplog) -> None:
    first = build(docs, tmp_path / "index", CountingEmbedder())
    (tmp_path / "index" / damage).write_bytes(b"\x00garbage")
    embedder = CountingEmbedder()
    with caplog.at_level(logging.WARNING):
        rebuilt = build(docs, tmp_path / "index", embedder)
    assert "is rebuilt" in caplog.text
    assert len(embedder.texts) == len(first) and rebuilt.chunks == first.chunks
    again = CountingEmbedder()
    build(docs, tmp_path / "index", again)
    assert again.texts == []  # the rebuilt index is kept and reused


def test_other_chunk_settings_or_embedding_model_give_another_key_and_a_rebuild(docs: Path, tmp_path: Path) -> None:
    record = IndexSource(str(docs), (".md",), (), False, "utf-8", 512, "tok", "model-a", "digest")
    key = index_key(record)
    assert index_key(IndexSource(str(docs), (".md",), (), False, "utf-8", 512, "tok", "model-a", "other")) == key
    assert index_key(IndexSource(str(docs), (".md",), (), False, "utf-8", 256, "tok", "model-a", "digest")) != key
    assert index_key(IndexSource(str(docs), (".md",), (), False, "utf-8", 512, "tok", "model-b", "digest")) != key
    assert index_key(record, overlap_tokens=4) != key

    build(docs, tmp_path / "index", CountingEmbedder())
    for change in ({"chunk_tokens": 20}, {"model_name": "counting-2"}):
        embedder = CountingEmbedder()
        index = build(docs, tmp_path / "index", embedder, **change)
        assert len(embedder.texts) == len(index)  # nothing reused from an index of other settings


def test_kept_indexes_of_folders_that_are_gone_are_dropped_and_others_kept(docs: Path, tmp_path: Path) -> None:
    from cacheblend_rag.retrieval.kept_index import drop_orphans

    gone = tmp_path / "gone"
    gone.mkdir()
    (gone / "x.md").write_text(words(5), encoding="utf-8")
    root = tmp_path / "indexes"
    build(docs, root / "kept", CountingEmbedder())
    build(gone, root / "orphan", CountingEmbedder())
    (root / "mine").mkdir()
    (root / "mine" / "notes.txt").write_text("not an index")
    (gone / "x.md").unlink()
    gone.rmdir()
    assert drop_orphans(root) == [root / "orphan"]
    assert sorted(p.name for p in root.iterdir()) == ["kept", "mine"]


def test_ask_keeps_the_index_beside_the_chunk_kv_and_reuses_it(tmp_path: Path, capsys, tiny_model_dir) -> None:
    from cacheblend_rag.cli import main
    from cacheblend_rag.testing import random_words

    docs = tmp_path / "docs"
    docs.mkdir()
    for i, name in enumerate(("a.txt", "b.txt")):
        (docs / name).write_text(random_words(i, 12))
    argv = ["ask", "--model", str(tiny_model_dir), "--chunk-tokens", "16", "--max-new-tokens", "2", "--docs",
            str(docs), "--kv-dir", str(tmp_path / "kv"), random_words(3, 3)]  # fmt: skip
    assert main(argv) == 0
    assert "index: 0 files reused, 2 re-indexed (a.txt, b.txt), 0 removed" in capsys.readouterr().err
    assert len(list((tmp_path / "kv" / "folder-indexes").iterdir())) == 1
    assert main(argv) == 0
    assert "index: 2 files reused, 0 re-indexed, 0 removed" in capsys.readouterr().err
    (docs / "b.txt").unlink()
    assert main([*argv, "--no-index-cache"]) == 0  # built in memory: the kept one is left as it is
    assert "index: 0 files reused, 1 re-indexed (a.txt), 0 removed" in capsys.readouterr().err
    assert main(argv) == 0
    assert "index: 1 file reused, 0 re-indexed, 1 removed (b.txt)" in capsys.readouterr().err
