"""The command line end to end: index a folder, retrieve, answer, print metrics."""

from __future__ import annotations

import pytest

from cacheblend_rag.cli import main


def test_models_lists_the_presets(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-0.5b-instruct (default)" in out and "smollm2-135m-instruct" in out


def test_ask_without_docs_or_index_is_a_clear_error(capsys):
    assert main(["ask", "--model", "smollm2-135m-instruct", "question?"]) == 2
    assert "give --docs DIR" in capsys.readouterr().err


@pytest.mark.real_model
def test_ask_answers_from_a_folder_and_reuses_chunks(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "zorbania.txt").write_text(
        "The kingdom of Zorbania lies in the northern mountains. Its capital is Quillton, a city of stone bridges.\n\n"
        "Zorbania exports wool, copper and a blue cheese called vessa."
    )
    (docs / "sports.md").write_text("The national sport of Zorbania is ice rowing, played on frozen lakes.")
    index_dir = tmp_path / "index"
    code = main(
        [
            "ask",
            "--docs",
            str(docs),
            "--index",
            str(index_dir),
            "--model",
            "smollm2-135m-instruct",
            "--chunk-tokens",
            "32",
            "--top-k",
            "2",
            "--max-new-tokens",
            "16",
            "What is the capital of Zorbania?",
            "What is the capital city of Zorbania called?",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "Quillton" in out
    assert out.count("mode=blend") == 2
    assert "chunks hit/miss=2/0" in out  # chunks precomputed before each request, then read from the store
    assert (index_dir / "chunks.json").exists()

    # A second run with a KV folder: the first fills it, the second reads every chunk back from disk.
    kv_dir = tmp_path / "kv"
    argv = [
        "ask",
        "--index",
        str(index_dir),
        "--model",
        "smollm2-135m-instruct",
        "--top-k",
        "2",
        "--max-new-tokens",
        "4",
        "--kv-dir",
        str(kv_dir),
        "What is the capital of Zorbania?",
    ]
    assert main(argv) == 0
    assert "chunk KV: 0 from the store, 2 computed now" in capsys.readouterr().err
    assert main([*argv, "--mode", "reuse"]) == 0  # a new engine, as a new process would have
    out = capsys.readouterr()
    assert "chunk KV: 2 from the store, 0 computed now" in out.err  # read back from the KV folder
    assert "chunks hit/miss=2/0" in out.out


@pytest.mark.real_model
def test_profile_then_ask_with_the_controller(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    argv = ["profile", "--model", "smollm2-135m-instruct", "--out", str(profile), "--kv-dir", str(tmp_path / "kv")]
    argv += ["--token-counts", "64", "128", "--chunk-tokens", "32", "--ratios", "0", "1", "--repeats", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "written to" in out and "memory" in out and "disk" in out and profile.exists()
    assert not (tmp_path / "kv" / ".profile").exists() or not any((tmp_path / "kv" / ".profile").rglob("*.val"))

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The kingdom of Zorbania lies in the north. Its capital is Quillton.")
    argv = ["ask", "--docs", str(docs), "--model", "smollm2-135m-instruct", "--chunk-tokens", "32"]
    argv += ["--top-k", "1", "--max-new-tokens", "4", "--profile", str(profile), "What is the capital?"]
    assert main(argv) == 0
    assert "(controller (" in capsys.readouterr().out  # the controller chose r
    assert main([*argv, "--ratio", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "r=0.20" in out and "(controller" not in out  # a pinned ratio wins

    (tmp_path / "bad.json").write_text("{}")
    assert main([*argv[:-3], "--profile", str(tmp_path / "bad.json"), "What?"]) == 2
    assert "not a cacheblend-rag/loading-profile" in capsys.readouterr().err
