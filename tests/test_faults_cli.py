"""The command line on surprising input: other documents for a saved index, links, special files, odd names.

Each case ends in a clear `error:` line with exit code 2 (no traceback, no model loaded first), or in the
documented behaviour, never in a silent wrong answer.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from cacheblend_rag.cli import main
from cacheblend_rag.testing import random_words


def docs_folder(root, **files: str):
    root.mkdir(parents=True)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def ask(model, *args: str) -> list[str]:
    return ["ask", "--model", str(model), "--chunk-tokens", "16", "--max-new-tokens", "2", *args]


def sources_of(index_dir) -> set[str]:
    return {c["source"] for c in json.loads((index_dir / "chunks.json").read_text())["chunks"]}


# ---------------------------------------------------------------- saved indexes and their sources


def test_other_docs_with_a_saved_index_rebuild_it_and_say_so(tmp_path, capsys, tiny_model_dir):
    old = docs_folder(tmp_path / "old", **{"old.txt": random_words(1, 12)})
    new = docs_folder(tmp_path / "new", **{"new.txt": random_words(2, 12)})
    index = tmp_path / "index"
    assert main(ask(tiny_model_dir, "--docs", str(old), "--index", str(index), random_words(3, 3))) == 0
    assert sources_of(index) == {"old.txt"}
    capsys.readouterr()

    assert main(ask(tiny_model_dir, "--docs", str(old), "--index", str(index), random_words(3, 3))) == 0
    assert "index: 1 file reused, 0 re-indexed, 0 removed" in capsys.readouterr().err  # nothing changed

    argv = ask(tiny_model_dir, "--docs", str(new), "--index", str(index), "--show-sources", random_words(3, 3))
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "rebuilding" in out.err and str(new) in out.err
    assert "new.txt #0" in out.out and "old.txt" not in out.out
    assert sources_of(index) == {"new.txt"}


def test_a_changed_file_is_indexed_again_alone_and_another_chunk_size_rebuilds_the_index(
    tmp_path, capsys, tiny_model_dir
):
    docs = docs_folder(tmp_path / "docs", **{"a.txt": random_words(1, 12), "b.txt": random_words(2, 12)})
    index = tmp_path / "index"
    assert main(ask(tiny_model_dir, "--docs", str(docs), "--index", str(index), random_words(3, 3))) == 0
    (docs / "a.txt").write_text(random_words(4, 30))
    capsys.readouterr()
    assert main(ask(tiny_model_dir, "--docs", str(docs), "--index", str(index), random_words(3, 3))) == 0
    assert "index: 1 file reused, 1 re-indexed (a.txt), 0 removed" in capsys.readouterr().err
    argv = ask(tiny_model_dir, "--docs", str(docs), "--index", str(index), random_words(3, 3))
    assert main([*argv, "--chunk-tokens", "32"]) == 0  # the last one given wins
    assert "chunk_tokens" in capsys.readouterr().err


def test_an_index_folder_holding_other_files_is_refused_without_advice_to_delete_it(tmp_path, capsys, no_model_loads):
    docs = docs_folder(tmp_path / "docs", **{"a.txt": random_words(1, 12)})
    for argv in (["ask", "--docs", str(docs), "--index", str(docs), "q?"], ["ask", "--index", str(docs), "q?"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1
        assert "pick a new or empty folder" in err and "delete" not in err
    assert (docs / "a.txt").exists()


def test_an_index_path_that_is_a_file_is_one_error_line(tmp_path, capsys, no_model_loads):
    docs = docs_folder(tmp_path / "docs", **{"a.txt": random_words(1, 12)})
    file = str(tmp_path / "file")
    (tmp_path / "file").write_text("not a folder")
    for argv in (
        ["ask", "--docs", str(docs), "--index", file, "q?"],
        ["ask", "--index", file, "q?"],
        ["index", "--docs", str(docs), "--out", file],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "is a file" in err and "Traceback" not in err


def test_an_index_folder_with_an_invalid_utf8_name_works(tmp_path, capsys, tiny_model_dir):
    index = os.path.join(os.fsencode(tmp_path), b"index-\xff")
    name = os.fsdecode(index)  # how Python hands such a name over from argv
    docs = docs_folder(tmp_path / "docs", **{"a.txt": random_words(1, 12)})
    with open(os.path.join(os.fsencode(docs), b"b-\xfe.txt"), "w") as f:  # a document with such a name too
        f.write(random_words(2, 12))
    assert main(ask(tiny_model_dir, "--docs", str(docs), "--index", name, random_words(3, 3))) == 0
    assert main(ask(tiny_model_dir, "--index", name, "--show-sources", "--top-k", "2", random_words(3, 3))) == 0
    out = capsys.readouterr()
    assert "loaded index of 2 chunks" in out.err and "b-\\udcfe.txt #0" in out.out  # printed escaped


def test_a_deeply_nested_chunks_json_is_one_error_line(tmp_path, capsys, no_model_loads):
    folder = tmp_path / "index"
    folder.mkdir()
    (folder / "chunks.json").write_text("[" * 200_000)
    (folder / "index.faiss").write_bytes(b"\0" * 45)
    assert main(["ask", "--index", str(folder), "q?"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "chunks.json" in err and "delete" not in err


# ---------------------------------------------------------------- which files --docs reads


def test_glob_reads_extensionless_files(tmp_path, capsys, tiny_model_dir):
    docs = docs_folder(
        tmp_path / "docs",
        **{"copyright": random_words(1, 12), "pkg/copyright": random_words(2, 12), "notes.txt": random_words(3, 9)},
    )
    out = tmp_path / "index"
    base = ["index", "--docs", str(docs), "--out", str(out), "--model", str(tiny_model_dir), "--chunk-tokens", "16"]
    assert main([*base, "--glob", "**/copyright"]) == 0
    assert sources_of(out) == {"copyright", "pkg/copyright"}
    assert main([*base, "--glob", "**/copyright", "--suffix", ".txt"]) == 0
    assert sources_of(out) == {"copyright", "pkg/copyright", "notes.txt"}


def test_links_leading_out_of_the_docs_folder_are_skipped_unless_asked(tmp_path, capsys, tiny_model_dir):
    outside = docs_folder(
        tmp_path / "outside", **{"secret.txt": random_words(5, 12), "sub/deep.txt": random_words(6, 9)}
    )
    docs = docs_folder(tmp_path / "docs", **{"a.txt": random_words(1, 12), "inner/b.txt": random_words(2, 9)})
    (docs / "link.txt").symlink_to(outside / "secret.txt")
    (docs / "dir-link").symlink_to(outside / "sub")
    (docs / "inner-link.txt").symlink_to(docs / "a.txt")  # stays inside: read
    out = tmp_path / "index"
    base = ["index", "--docs", str(docs), "--out", str(out), "--model", str(tiny_model_dir), "--chunk-tokens", "16"]
    assert main(base) == 0
    assert sources_of(out) == {"a.txt", "inner/b.txt", "inner-link.txt"}
    assert "skipped 2 links" in capsys.readouterr().err
    assert main([*base, "--follow-links"]) == 0
    assert sources_of(out) == {"a.txt", "inner/b.txt", "inner-link.txt", "link.txt", "dir-link/deep.txt"}


def test_a_document_above_the_size_cap_is_refused_naming_it_before_a_model_loads(tmp_path, capsys, no_model_loads):
    docs = docs_folder(tmp_path / "docs", **{"small.txt": random_words(1, 12), "big.txt": random_words(2, 2000)})
    assert main(["ask", "--docs", str(docs), "--max-doc-mb", "0.001", "q?"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "big.txt" in err and "--max-doc-mb" in err


def test_docs_that_are_a_fifo_are_refused(tmp_path, capsys, no_model_loads):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert main(["ask", "--docs", str(fifo), "q?"]) == 2
    assert "not a regular file" in capsys.readouterr().err


# ---------------------------------------------------------------- --profile on special files


@pytest.mark.parametrize("kind", ["binary", "folder", "fifo", "device", "huge"])
def test_a_profile_that_is_not_a_small_regular_text_file_is_one_error_line(kind, tmp_path, capsys, no_model_loads):
    docs = docs_folder(tmp_path / "docs", **{"a.txt": random_words(1, 12)})
    path = tmp_path / "profile"
    if kind == "binary":
        path.write_bytes(bytes(range(256)) * 4)
    elif kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)  # reading it would block until a writer comes
    elif kind == "device":
        path = "/dev/zero"  # reading it would never end
    else:
        with open(path, "wb") as f:
            f.truncate(1 << 30)  # sparse: nothing is written
    assert main(["ask", "--docs", str(docs), "--profile", str(path), "q?"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and str(path) in err
    if kind == "huge":
        assert "limit" in err  # refused from its size, before reading a gigabyte


# ---------------------------------------------------------------- what a request reports


def test_a_cold_question_reports_its_misses_and_a_warm_one_its_hits(tmp_path, capsys, tiny_model_dir):
    docs = docs_folder(tmp_path / "docs", **{"a.txt": random_words(1, 12)})
    question = random_words(3, 3)
    assert main(ask(tiny_model_dir, "--docs", str(docs), "--top-k", "1", question, question)) == 0
    out = capsys.readouterr()
    first, second = [line for line in out.out.splitlines() if "mode=blend" in line]
    assert "chunks hit/miss=0/1" in first  # the chunk's prefill is part of the first request
    assert "chunks hit/miss=1/0" in second
    assert "chunk KV:" not in out.err  # nothing computed ahead of the request behind the user's back


def test_precompute_all_answers_first_then_fills_the_store_for_later_runs(tmp_path, capsys, tiny_model_dir):
    # The first answer does not wait for the whole folder: the questions are answered (their chunks computed in
    # their own requests), then every other chunk's KV goes to --kv-dir, which the next run reads.
    docs = docs_folder(tmp_path / "docs", **{"a.txt": random_words(1, 12), "b.txt": random_words(2, 12)})
    kv = tmp_path / "kv"
    argv = ask(tiny_model_dir, "--docs", str(docs), "--top-k", "1", "--kv-dir", str(kv), "--precompute-all")
    assert main([*argv, random_words(3, 3)]) == 0
    out = capsys.readouterr()
    assert "chunks hit/miss=0/1" in out.out  # answered before any precompute
    assert "precomputed the KV of 2 chunks" in out.err and "after the answers" in out.err
    assert "computed) for later runs" in out.err  # grouped entries: each chunk's KV after its group's text
    assert main([*ask(tiny_model_dir, "--docs", str(docs), "--top-k", "2", "--kv-dir", str(kv)),
                 random_words(4, 3)]) == 0  # fmt: skip
    assert "chunks hit/miss=2/0" in capsys.readouterr().out  # the next run finds both chunks stored


def test_precompute_all_without_a_lasting_store_is_skipped_with_advice(tmp_path, capsys, tiny_model_dir):
    docs = docs_folder(tmp_path / "docs", **{"a.txt": random_words(1, 12)})
    assert main(ask(tiny_model_dir, "--docs", str(docs), "--precompute-all", random_words(3, 3))) == 0
    out = capsys.readouterr()
    assert "chunks hit/miss=0/1" in out.out and "--precompute-all: skipped" in out.err and "--kv-dir" in out.err
    assert "precomputed the KV" not in out.err


@pytest.mark.skipif(sys.platform != "linux", reason="FIFOs and /dev/zero as on Linux")
def test_dev_zero_as_docs_is_refused(capsys, no_model_loads):
    assert main(["ask", "--docs", "/dev/zero", "q?"]) == 2
    assert "not a regular file" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["fifo", "device", "folder", "huge", "binary"])
def test_calibrate_questions_must_be_a_small_utf8_regular_file(kind, tmp_path, capsys):
    import os

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Some text about a warranty that lasts two years.")
    target = tmp_path / "questions"
    if kind == "fifo":
        os.mkfifo(target)  # reading it would wait forever for a writer
    elif kind == "device":
        target = "/dev/zero"  # endless
    elif kind == "folder":
        target.mkdir()
    elif kind == "huge":
        target.write_text("What is it?\n" * 400_000)
    else:
        target.write_bytes(b"\xff\xfe\x00binary")
    code = main(["calibrate", "--out", str(tmp_path / "f.json"), "--docs", str(docs), "--questions", str(target)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert "--questions" in err and "Traceback" not in err


def test_an_index_records_the_model_of_cacheblend_rag_model_when_no_model_is_named(monkeypatch, tmp_path):
    import argparse

    from cacheblend_rag.cli.sources import choose_documents

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Some text.")
    args = argparse.Namespace(docs=str(docs), suffix=None, glob=None, follow_links=False, max_doc_mb=8,
                              encoding="utf-8", chunk_tokens=512, model=None)  # fmt: skip
    monkeypatch.setenv("CACHEBLEND_RAG_MODEL", "smollm2-135m-instruct")
    assert choose_documents(args)[1].tokenizer == "smollm2-135m-instruct"
    monkeypatch.delenv("CACHEBLEND_RAG_MODEL")
    assert choose_documents(args)[1].tokenizer == "qwen2.5-coder-0.5b-instruct"
