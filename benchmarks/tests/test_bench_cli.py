"""The benchmark scripts' command lines: `benchmarks/quality.py`, `report.py` and `sweep.py`, and what they share
(`benchlib.cli`)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import quality as quality_script
import report as report_script
import sweep
from bench_helpers import TINY_SHAPE
from benchlib import cli, quality, timing
from benchlib.report import comparable_cases

from cacheblend_rag.testing import random_words

DATA_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"


def _record(dataset: str, method: str, case: str, score: float, ttft: float) -> dict:
    return {"dataset": dataset, "method": method, "case_id": case, "task": "qa", "metric": "F1", "score": score,
            "ttft_s": ttft, "error": None}  # fmt: skip


def test_report_rebuilds_table_and_figures_from_jsonl(tmp_path, capsys):
    rows = [
        _record("musique", m, f"c{i}", s + 0.01 * i, t)
        for i in range(3)
        for m, s, t in (("full", 0.5, 4.0), ("reuse", 0.2, 0.5), ("blend@0.15", 0.48, 1.0), ("blend@0.05", 0.4, 0.8))
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report_script.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| blend@0.15 | 0.490 | 1.00 | 3 | -0.020 | [-0.020, -0.020] | - | 4.00 | 3 | 0 |" in out
    assert (tmp_path / "summary.md").read_text().count("| reuse |") == 1
    assert (tmp_path / "quality_vs_ttft.png").stat().st_size > 1000
    assert (tmp_path / "quality_vs_ratio.png").stat().st_size > 1000

    # Without the second ratio the ratio figure has no curve to show: the report drops it, old file included.
    kept = [r for r in rows if r["method"] != "blend@0.05"]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert report_script.main(["--out", str(tmp_path)]) == 0
    assert not (tmp_path / "quality_vs_ratio.png").exists() and (tmp_path / "quality_vs_ttft.png").exists()


def test_report_on_an_empty_folder_is_a_clear_error(tmp_path, capsys):
    assert report_script.main(["--out", str(tmp_path)]) == 2
    assert "no results" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--methods", "full,stuff"], "unknown method 'stuff'"),
        (["--datasets", "squad"], "unknown data set 'squad'"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--data-dir", "/nonexistent/data"], "--data-dir '/nonexistent/data' is not a folder"),
    ],
)
def test_quality_checks_its_arguments_before_loading_a_model(args, message, tmp_path, capsys):
    assert quality_script.main(["--out", str(tmp_path), "--model", "no-such-model", *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.jsonl").exists()


@pytest.mark.real_model
@pytest.mark.skipif(not DATA_DIR.is_dir(), reason=f"benchmark data not present at {DATA_DIR.resolve()}")
def test_quality_end_to_end_on_the_small_model(tmp_path, capsys):
    argv = ["--datasets", "samsum", "--methods", "full,blend@0.15,reuse", "--limit", "1",
            "--samsum-shots", "3", "--model", "smollm2-135m-instruct", "--max-new-tokens", "8", "--out", str(tmp_path),
            "--data-dir", str(DATA_DIR)]  # fmt: skip
    assert quality_script.main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in records] == ["full", "blend@0.15", "reuse"]
    assert all(r["metric"] == "Rouge-L" and 0 <= r["score"] <= 1 and r["ttft_s"] > 0 for r in records)
    assert "### samsum (Rouge-L)" in capsys.readouterr().out
    assert quality_script.main(argv) == 0  # resumed: nothing left to run
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 3


def test_quality_figure_compares_only_methods_measured_on_the_same_cases(tmp_path):
    rows = [_record("musique", m, f"c{i}", 0.1 * i, 1.0) for i in range(6) for m in ("full", "reuse", "blend@0.15")]
    rows += [_record("musique", "prefix", "c0", 0.9, 4.0)]  # one case: its mean is not comparable
    rows += [_record("musique", "blend@0.05", f"c{i}", 0.2, 0.5) for i in range(2, 6)]  # 4 of 6 cases
    rows += [_record("musique", "blend@0.30", f"c{i}", 0.2, 0.5) for i in range(3)]  # half: left out too
    cases, kept, left = comparable_cases(rows)["musique"]
    assert left == ["prefix", "blend@0.30"] and cases == {"c2", "c3", "c4", "c5"} and "blend@0.05" in kept
    full = next(r for r in quality.summarize(rows) if r.method == "full")
    assert full.score_ci[0] < full.score < full.score_ci[1]  # the interval drawn as the error bar
    assert quality.plot_quality_vs_ttft(rows, tmp_path / "fig.png", model="tiny").stat().st_size > 1000


@pytest.mark.parametrize(
    "name, folder",
    [("quality", "quality"), ("report", "quality"), ("fidelity", "fidelity"), ("throughput", "throughput"),
     ("sweep", "sweep"), ("ttft", "ttft"), ("tiers", "tiers"), ("controller", "controller"), ("load", "load"),
     ("decode_batch", "decode-batch"), ("precompute_cost", "precompute-cost"), ("folder_warm", "folder-warm"),
     ("dtype_fidelity", "dtype-fidelity"), ("ask_index", "ask-index")],
)  # fmt: skip
def test_every_benchmark_writes_under_benchmarks_results_by_default(name, folder, capsys, monkeypatch):
    import importlib

    monkeypatch.setenv("COLUMNS", "400")  # --help on one line per option
    with pytest.raises(SystemExit):
        importlib.import_module(name).main(["--help"])
    root = Path(__file__).resolve().parents[1] / "results"
    assert f"(default: {root / folder})" in capsys.readouterr().out


def test_figures_name_the_real_model_not_an_alias(tmp_path, monkeypatch):
    # The default preset's old name is an alias: a figure must carry the model's own name.
    assert cli.model_name("qwen2.5-0.5b-instruct") == "qwen2.5-coder-0.5b-instruct"
    assert cli.model_name(None) == cli.model_name("qwen2.5-coder-0.5b-instruct")
    assert cli.model_name("/models/my-llama") == "/models/my-llama"
    args = SimpleNamespace(random_weights=False, model="qwen2.5-0.5b-instruct", model_shape="7b")
    assert timing.model_label(args) == "qwen2.5-coder-0.5b-instruct"

    rows = [_record("musique", m, f"c{i}", 0.5, 1.0) for i in range(2) for m in ("full", "reuse")]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run.json").write_text(json.dumps({"model": "qwen2.5-coder-0.5b-instruct"}))
    titles = []
    monkeypatch.setattr(quality, "plot_panels", lambda data, path, **kw: titles.append(kw["title"]) or path)
    quality.write_report(tmp_path)
    assert titles == ["Quality vs TTFT: qwen2.5-coder-0.5b-instruct"]


def test_sweep_measures_every_mode_per_point_and_skips_overlong(tmp_path, monkeypatch, capsys):
    """benchmarks/sweep.py end to end on a tiny random-weight model: JSON layout, a TTFT per mode and point, the
    figure. No timing is compared: only that every point was measured with the chunks warm, and that a point beyond
    the model's context is skipped with a message rather than a traceback."""
    monkeypatch.setitem(timing.RANDOM_SHAPES, "tiny", TINY_SHAPE)
    argv = [
        "--random-weights", "--model-shape", "tiny",
        "--counts", "1,2", "--chunk-tokens", "16",
        "--lengths", "8,32,70", "--chunks", "2",  # 2 x 70 tokens + prefix and question > 160: skipped
        "--ratios", "0.15", "0.3", "--repeats", "1", "--out", str(tmp_path),
    ]  # fmt: skip
    assert sweep.main(argv) == 0
    printed = capsys.readouterr().out
    assert "skipped 2 chunks x 70 tokens" in printed and "exceeds the model's limit of 160" in printed

    report = json.loads((tmp_path / "sweep.json").read_text())
    assert report["model"] == "random-tiny"
    modes = ["full", "prefix", "reuse", "blend r=0.15", "blend r=0.30"]
    assert report["modes"] == modes and report["ratios"] == [0.15, 0.3]
    counts, lengths = report["sweeps"]["chunk_count"], report["sweeps"]["chunk_length"]
    assert counts["varies"] == "chunks" and counts["chunk_tokens"] == 16
    assert lengths["varies"] == "chunk_tokens" and lengths["chunks"] == 2
    assert [(p["chunks"], p["chunk_tokens"]) for p in counts["points"]] == [(1, 16), (2, 16)]
    assert [(p["chunks"], p["chunk_tokens"]) for p in lengths["points"]] == [(2, 8), (2, 32)]
    assert counts["skipped"] == [] and [(s["chunks"], s["chunk_tokens"]) for s in lengths["skipped"]] == [(2, 70)]
    for p in counts["points"] + lengths["points"]:
        assert p["prompt_tokens"] >= p["chunks"] * p["chunk_tokens"]
        assert list(p["ttft_s"]) == modes and all(t > 0 for t in p["ttft_s"].values())
        assert set(p["speedup"]) == {"blend r=0.15", "blend r=0.30"} and all(s > 0 for s in p["speedup"].values())
        assert p["chunks_missed"] == 0, "every timed cached run should find its chunks in the store"

    png = tmp_path / "sweep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_interleaved_tier_ttft_times_each_setup_from_its_own_tier(tiny_engine, tmp_path):
    """The tier benchmarks' timing loop (`tiers.py`, `codecs.py`): a median and the last metrics per setup, each
    request's chunks read from the tier the setup names; a setup whose chunks come from elsewhere is an error."""
    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.store import DiskStore, MemoryStore
    from cacheblend_rag.testing import random_words

    texts = [random_words(3, 20), random_words(4, 25)]
    tiny_engine.precompute(texts, random_words(5, 4))
    prompt = tiny_engine.build_prompt(texts, random_words(5, 4))
    engines = {}
    for name, tier in (("memory", MemoryStore(codec="int8")), ("disk", DiskStore(str(tmp_path / "disk")))):
        store = timing.fill_tier(tiny_engine, prompt, tier, name)
        engine = CacheBlendEngine(tiny_engine.model, tiny_engine.tokenizer, config=tiny_engine.config, store=store)
        engines[name] = engine, name
    med, last = timing.interleaved_tier_ttft(engines, prompt, 0.5, repeats=3)
    assert set(med) == set(last) == {"memory", "disk"} and all(t > 0 for t in med.values())
    assert last["disk"].hits_by_tier == {"disk": 2} and last["memory"].hits_by_tier == {"memory": 2}
    assert last["memory"].bytes_loaded > 0

    wrong = {"mislabelled": (engines["disk"][0], "memory")}
    with pytest.raises(AssertionError, match="mislabelled: expected 2 hits in memory"):
        timing.interleaved_tier_ttft(wrong, prompt, 0.5, repeats=1)


def three_documents(docs):
    """A folder of three ~120-word documents of random words (d0.txt, d1.txt, d2.txt)."""
    docs.mkdir()
    for i in range(3):
        (docs / f"d{i}.txt").write_text(random_words(900 + i, 120))
    return docs


@pytest.mark.real_model
def test_precompute_cost_and_folder_warm_end_to_end_on_the_small_model(tmp_path, capsys):
    import folder_warm
    import precompute_cost

    docs = three_documents(tmp_path / "docs")
    small = ["--docs", str(docs), "--model", "smollm2-135m-instruct", "--dtype", "float32"]
    assert precompute_cost.main([*small, "--chunk-tokens", "64", "--out", str(tmp_path / "pc")]) == 0
    report = json.loads((tmp_path / "pc" / "results.json").read_text())
    assert report["chunks"] > 3 and report["counts"]["grouped"]["computed"] == report["chunks"] and report["ratio"] > 0
    assert folder_warm.main([*small, "--question", "what?", "--top-k", "2", "--repeats", "1",
                             "--out", str(tmp_path / "fw")]) == 0  # fmt: skip
    assert "disk / memory" in capsys.readouterr().out


@pytest.mark.real_model
def test_ask_index_reuses_the_unchanged_folder_and_indexes_the_changed_file_alone(tmp_path, capsys):
    import ask_index

    docs = three_documents(tmp_path / "docs")
    argv = ["--docs", str(docs), "--model", "smollm2-135m-instruct", "--change", "d1.txt", "--out", str(tmp_path / "o")]
    assert ask_index.main(argv) == 0
    runs = json.loads((tmp_path / "o" / "results.json").read_text())["runs"]
    indexed = [(r["reused"], r["reindexed"]) for r in runs]
    assert indexed == [(0, ["d0.txt", "d1.txt", "d2.txt"]), (3, []), (2, ["d1.txt"])]
    assert "retrieval set-up (s)" in capsys.readouterr().out
    assert (docs / "d1.txt").read_text() == random_words(901, 120)  # the folder given is never written


def test_dtype_fidelity_pairs_each_dtypes_blend_against_its_own_reference():
    import torch
    from benchlib.dtype_fidelity import COMPARISONS, case_record, dtype_markdown

    from cacheblend_rag import CacheBlendEngine, EngineConfig
    from cacheblend_rag.engine import PromptTemplate
    from cacheblend_rag.evaluation.datasets import Case, TaskSpec
    from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer

    def engine(dtype):
        config = EngineConfig(dtype=dtype, miss_policy="blend", chunk_separator="", chunk_context="isolated")
        return CacheBlendEngine(make_tiny_model("qwen2"), make_tiny_tokenizer(), config=config)

    fp32, bf16 = engine("float32"), engine("bfloat16")
    assert bf16.dtype == torch.bfloat16
    spec = TaskSpec("tiny", "qa", PromptTemplate(instruction=random_words(1, 3)), max_new_tokens=4)
    cases = [Case(f"c{i}", (random_words(10 + i, 20), random_words(20 + i, 20)), random_words(30 + i, 4), ("a",), "qa")
             for i in range(3)]  # fmt: skip
    records = [case_record(fp32, bf16, spec, case) for case in cases]
    for r in records:
        assert set(COMPARISONS) <= set(r) and r["bf16_full"]["kl_mean"] < 0.05  # bf16 full stays near fp32 full
    text = dtype_markdown(records, machine="tiny")
    assert "3 cases (tiny 3)" in text and "| kl_mean |" in text and "noise floor" in text
