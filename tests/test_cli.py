"""The command line end to end: index a folder, retrieve, answer, print metrics."""

from __future__ import annotations

import json

import pytest

from cacheblend_rag.cli import main
from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.testing import random_words


def test_models_lists_the_presets(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-0.5b-instruct (default): Qwen2.5-Coder-0.5B-Instruct" in out
    assert "smollm2-135m-instruct" in out and "qwen2.5-coder-1.5b-instruct" in out
    # The presets' first names read as the plain Instruct models, which are not packaged: not listed.
    assert "qwen2.5-0.5b-instruct" not in out and "qwen2.5-1.5b-instruct" not in out


def test_an_old_preset_name_is_refused_naming_the_coder_preset(capsys, no_model_loads):
    assert main(["ask", "--model", "qwen2.5-0.5b-instruct", "--docs", "d", "Q"]) == 2  # checked before any load
    err = capsys.readouterr().err
    assert "'qwen2.5-0.5b-instruct' is not a packaged model" in err and "Qwen2.5-Coder-0.5B-Instruct" in err
    assert "Pass 'qwen2.5-coder-0.5b-instruct'" in err


def test_every_option_has_help_and_shows_its_default():
    from cacheblend_rag.cli.args import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    for name in ("ask", "index", "profile"):
        parser = commands[name]
        text = " ".join(parser.format_help().split())  # unwrapped
        for action in parser._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help text"
            if action.option_strings and action.default not in (None, False, "==SUPPRESS=="):
                shown = " ".join(map(str, action.default)) if isinstance(action.default, list) else action.default
                assert f"(default: {shown}" in text or f"(default: {action.default})" in text, (name, action.dest)
    assert "--lead-in" not in commands["ask"].format_help()
    assert "bench" not in commands  # the benchmarks are scripts under benchmarks/, not a subcommand


def test_ask_without_docs_or_index_is_a_clear_error(capsys):
    assert main(["ask", "--model", "smollm2-135m-instruct", "question?"]) == 2
    assert "give --docs DIR" in capsys.readouterr().err


def latin1_folder(root):
    """A folder with one Latin-1 text file: not valid UTF-8 (the byte 0xe9 for "é")."""
    root.mkdir()
    (root / "notes.txt").write_bytes(f"{random_words(1, 20)} caf\xe9 {random_words(2, 20)}".encode("latin-1"))
    return root


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--docs", "/no/such/dir"], "'/no/such/dir' does not exist"),
        (["--docs", "DOCS", "--top-k", "0"], "--top-k must be >= 1, got 0"),
        (["--docs", "DOCS", "--chunk-tokens", "4"], "--chunk-tokens must be >= 16, got 4"),
        (["--docs", "DOCS", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--docs", "DOCS", "--temperature", "-1"], "--temperature must be >= 0"),
        (["--docs", "DOCS", "--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
        (["--docs", "DOCS", "--temperature", "inf"], "--temperature must be a finite number >= 0, got inf"),
        (["--docs", "DOCS", "--ratio", "nan"], "--ratio must be a finite number"),
        (["--docs", "DOCS", "--suffix", "copyright"], "pass a glob instead, e.g. --glob '**/copyright'"),
        (["--docs", "DOCS", "--ratio", "1.5"], "recompute_ratio"),
        (["--docs", "DOCS", "--profile", "/no/such/profile.json"], "/no/such/profile.json"),
        (["--docs", "EMPTY"], "pass e.g. --suffix .log or --glob '**/*.log' to match"),
        (["--docs", "LATIN1"], "pass their encoding, e.g. --encoding latin-1"),
    ],
)
def test_ask_checks_arguments_and_paths_before_loading_a_model(args, message, tmp_path, capsys, no_model_loads):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("Quillton is the capital of Zorbania.")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "page.html").write_text("<p>not a text suffix</p>")
    latin1_folder(tmp_path / "latin1")
    folders = {"DOCS": "docs", "EMPTY": "empty", "LATIN1": "latin1"}
    argv = ["ask", *(str(tmp_path / folders[a]) if a in folders else a for a in args), "question?"]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_index_reads_latin1_files_with_encoding_and_other_suffixes_with_suffix(tmp_path, capsys, tiny_model_dir):
    docs = latin1_folder(tmp_path / "docs")
    (docs / "page.html").write_text(random_words(3, 12))
    out = tmp_path / "index"
    base = ["index", "--docs", str(docs), "--out", str(out), "--model", str(tiny_model_dir), "--chunk-tokens", "16"]
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "--encoding latin-1" in err and "encoding='latin-1'" not in err  # the command line's words only

    assert main([*base, "--encoding", "latin-1"]) == 0
    chunks = json.loads((out / "chunks.json").read_text())["chunks"]
    assert "café" in " ".join(c["text"] for c in chunks)  # decoded as Latin-1, not skipped
    assert {c["source"] for c in chunks} == {"notes.txt"}

    assert main([*base, "--encoding", "latin-1", "--suffix", ".txt", "--suffix", ".HTML"]) == 0
    assert {c["source"] for c in json.loads((out / "chunks.json").read_text())["chunks"]} == {"notes.txt", "page.html"}


def test_ask_answers_from_latin1_files_with_encoding(tmp_path, capsys, tiny_model_dir):
    docs = latin1_folder(tmp_path / "docs")
    argv = ["ask", "--docs", str(docs), "--encoding", "latin-1", "--model", str(tiny_model_dir)]
    argv += ["--chunk-tokens", "16", "--top-k", "1", "--max-new-tokens", "2", random_words(1, 4)]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "mode=blend" in out.out and "(float32 on cpu)" in out.out  # the metrics name what ran, and where
    assert "ready in" in out.err and "s (float32 on cpu)" in out.err


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
            # SmolLM2-135M needs r = 0.5 here under the default rule (attention): at 0.15 and 0.3 it gives full KV
            # reuse's answer (it recites the sports chunk). `gradual` finds Quillton at 0.15; `epic` and
            # `attention-anchors` (chunk starts recomputed) stop the recital. The question's attention ranks periods
            # and line breaks highest, not the second chunk's first tokens, whose KV (prefilled alone) reads as the
            # start of a new message.
            "--ratio",
            "0.5",
            "What is the capital of Zorbania?",
            "What is the capital city of Zorbania called?",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "Quillton" in out
    # The first question finds no chunk stored: the miss policy answers it with a full prefill (cheaper than
    # prefilling both chunks and blending) and stores them after; the second reads them from the store and blends.
    assert "mode=full" in out and "[full prefill: 2 of 2 chunks not stored yet]" in out
    assert out.count("mode=blend") == 1
    assert "chunks hit/miss=0/2" in out
    assert "chunks hit/miss=2/0" in out
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
    assert "chunks hit/miss=0/2" in capsys.readouterr().out
    assert main([*argv, "--mode", "reuse"]) == 0  # a new engine, as a new process would have
    assert "chunks hit/miss=2/0" in capsys.readouterr().out  # read back from the KV folder


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


def test_guard_is_a_switch_and_its_margin_a_separate_option(capsys):
    from cacheblend_rag.cli import build_parser
    from cacheblend_rag.cli.ask import engine_config
    from cacheblend_rag.config import Guard

    def guard(*options):
        args = build_parser().parse_args(["ask", "--docs", "d", *options, "What is the default?", "Q2"])
        assert args.questions == ["What is the default?", "Q2"]  # --guard never takes the first question
        return engine_config(args).guard

    assert guard() is None
    assert guard("--guard") == Guard() and Guard().min_margin == 0.1
    assert guard("--guard", "--guard-margin", "0.05") == Guard(min_margin=0.05)
    assert guard("--guard-margin", "0.05", "--guard") == Guard(min_margin=0.05)
    assert main(["ask", "--docs", "d", "--guard-margin", "0.05", "Q"]) == 2
    assert "the fidelity guard, which is off: add --guard" in capsys.readouterr().err
    assert main(["ask", "--docs", "d", "--guard", "--guard-margin", "1.5", "Q"]) == 2
    assert "--guard-margin must be a probability in [0, 1]" in capsys.readouterr().err
    args = build_parser().parse_args(["ask", "--guard", "0.05"])  # a word after the switch is a question
    assert args.guard is True and args.guard_margin is None and args.questions == ["0.05"]


def test_ctrl_c_ends_with_one_line_and_status_130(monkeypatch, capsys):
    import cacheblend_rag.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "models", interrupted)
    assert cli.main(["models"]) == 130
    err = capsys.readouterr().err
    assert err == "interrupted\n" and "Traceback" not in err


def test_ctrl_c_during_an_answer_ends_the_answer_line(monkeypatch, capsys, tmp_path, tiny_model_dir):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(random_words(1, 30))

    def stream(self, *args, **kwargs):
        yield "Part of an answer"
        raise KeyboardInterrupt  # what Ctrl-C raises in the main thread while tokens are decoded

    monkeypatch.setattr(CacheBlendEngine, "stream", stream)
    argv = ["ask", "--docs", str(docs), "--model", str(tiny_model_dir), "--chunk-tokens", "16", "--top-k", "1"]
    assert main([*argv, random_words(2, 4), random_words(3, 4)]) == 130
    captured = capsys.readouterr()
    assert captured.out.endswith("A: Part of an answer\n") and captured.out.count("A: ") == 1  # no later question
    assert captured.err.endswith("\ninterrupted\n") and "Traceback" not in captured.err


def test_bf16_on_a_cpu_without_bf16_instructions_is_warned_about(monkeypatch, capsys, tmp_path):
    import cacheblend_rag.cli.ask as ask
    from cacheblend_rag.cli import build_parser

    monkeypatch.setattr(ask, "cpu_has_bf16", lambda: False)
    args = build_parser().parse_args(["ask", "--dtype", "bfloat16", "What is it?"])
    config = ask.engine_config(args)
    assert config.dtype == "bfloat16" and "no bf16 matrix instructions" in capsys.readouterr().err
    monkeypatch.setattr(ask, "cpu_has_bf16", lambda: True)
    ask.engine_config(args)
    assert capsys.readouterr().err == ""


def test_help_and_models_import_no_model_machinery():
    import subprocess
    import sys

    # --help of every command, and the presets' list: answered before torch, transformers or FAISS load.
    code = (
        "import contextlib, io, sys\n"
        "from cacheblend_rag.cli import build_parser, main\n"
        "parser = build_parser()\n"
        "for argv in (['--help'], ['ask', '--help'], ['index', '--help'], ['calibrate', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        parser.parse_args(argv)\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    assert main(['models']) == 0\n"
        "assert 'qwen2.5-coder-0.5b-instruct (default)' in out.getvalue()\n"
        "heavy = ('torch', 'transformers', 'faiss', 'sentence_transformers', 'huggingface_hub')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_parser_is_built_without_importing_torch_and_every_lazy_export_resolves():
    import subprocess
    import sys

    import cacheblend_rag
    import cacheblend_rag.controller

    code = "import sys; from cacheblend_rag.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"  # --help and argument errors answer before any model machinery loads
    for package in (cacheblend_rag, cacheblend_rag.controller):
        assert all(getattr(package, name) is not None for name in package.__all__)
        with pytest.raises(AttributeError, match="has no attribute 'nope'"):
            package.nope  # noqa: B018


def test_chunk_context_goes_from_the_command_line_to_the_engine_and_the_index():
    from cacheblend_rag.cli import build_parser
    from cacheblend_rag.cli.ask import engine_config
    from cacheblend_rag.cli.sources import index_context

    def config(*options):
        return engine_config(build_parser().parse_args(["ask", "--docs", "d", *options, "What is it?"]))

    grouped = config()  # the default: groups of up to 3072 tokens, read as captured entries
    assert grouped.chunk_context == "grouped" and grouped.group_tokens == 3072 and grouped.capture_policy == "all"
    captured = config("--chunk-context", "captured")
    assert captured.group_tokens == 0 and captured.capture_policy == "all"
    isolated = config("--chunk-context", "isolated")
    assert isolated.group_tokens == 0 and isolated.capture_policy == "exact"

    class Engine:  # what `index_context` reads of an engine
        config = grouped

    assert index_context(Engine()) == "groups"  # type: ignore[arg-type]
    Engine.config = captured
    assert index_context(Engine()) is None  # type: ignore[arg-type]


def test_the_options_that_left_the_command_line_are_refused(capsys):
    from cacheblend_rag.cli import build_parser

    for gone in (["--capture", "exact"], ["--context-neighbours", "2"], ["--precompute-groups", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["ask", "--docs", "d", *gone, "What is it?"])
        assert "unrecognized arguments" in capsys.readouterr().err


def test_a_long_question_is_echoed_by_its_start_and_length():
    from cacheblend_rag.cli.ask import ECHO_CHARS, echoed

    assert echoed("What does the warranty cover?") == "What does the warranty cover?"
    long = "word " * 1000
    shown = echoed(long)
    assert len(shown) < ECHO_CHARS + 40 and shown.endswith("... (5,000 characters)") and shown.startswith("word word")


def test_docs_says_when_an_index_replaces_it(no_model_loads):
    from cacheblend_rag.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    ask_help = sub.choices["ask"].format_help()
    assert "not needed with --index" in " ".join(ask_help.split())
