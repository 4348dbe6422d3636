"""`cacheblend-rag bench quality / report` from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cacheblend_rag.cli import main

DATA_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


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
    assert main(["bench", "report", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| blend@0.15 | 0.490 | 1.00 | 3 | -0.020 | [-0.020, -0.020] | - | 4.00 | 3 | 0 |" in out
    assert (tmp_path / "summary.md").read_text().count("| reuse |") == 1
    assert (tmp_path / "quality_vs_ttft.png").stat().st_size > 1000
    assert (tmp_path / "quality_vs_ratio.png").stat().st_size > 1000

    # Without the second ratio the ratio figure has no curve to show: the report drops it, old file included.
    kept = [r for r in rows if r["method"] != "blend@0.05"]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert main(["bench", "report", "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "quality_vs_ratio.png").exists() and (tmp_path / "quality_vs_ttft.png").exists()


def test_report_on_an_empty_folder_is_a_clear_error(tmp_path, capsys):
    assert main(["bench", "report", "--out", str(tmp_path)]) == 2
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
    assert main(["bench", "quality", "--out", str(tmp_path), "--model", "no-such-model", *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.jsonl").exists()


@pytest.mark.real_model
@pytest.mark.skipif(not DATA_DIR.is_dir(), reason=f"benchmark data not present at {DATA_DIR.resolve()}")
def test_quality_end_to_end_on_the_small_model(tmp_path, capsys):
    argv = ["bench", "quality", "--datasets", "samsum", "--methods", "full,blend@0.15,reuse", "--limit", "1",
            "--samsum-shots", "3", "--model", "smollm2-135m-instruct", "--max-new-tokens", "8", "--out", str(tmp_path),
            "--data-dir", str(DATA_DIR)]  # fmt: skip
    assert main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in records] == ["full", "blend@0.15", "reuse"]
    assert all(r["metric"] == "Rouge-L" and 0 <= r["score"] <= 1 and r["ttft_s"] > 0 for r in records)
    assert "### samsum (Rouge-L)" in capsys.readouterr().out
    assert main(argv) == 0  # resumed: nothing left to run
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 3


def test_quality_figure_compares_only_methods_measured_on_the_same_cases(tmp_path):
    from cacheblend_rag.evaluation.quality import plot_quality_vs_ttft, summarize
    from cacheblend_rag.evaluation.report import comparable_cases

    rows = [_record("musique", m, f"c{i}", 0.1 * i, 1.0) for i in range(6) for m in ("full", "reuse", "blend@0.15")]
    rows += [_record("musique", "prefix", "c0", 0.9, 4.0)]  # one case: its mean is not comparable
    rows += [_record("musique", "blend@0.05", f"c{i}", 0.2, 0.5) for i in range(2, 6)]  # 4 of 6 cases
    rows += [_record("musique", "blend@0.30", f"c{i}", 0.2, 0.5) for i in range(3)]  # half: left out too
    cases, kept, left = comparable_cases(rows)["musique"]
    assert left == ["prefix", "blend@0.30"] and cases == {"c2", "c3", "c4", "c5"} and "blend@0.05" in kept
    full = next(r for r in summarize(rows) if r.method == "full")
    assert full.score_ci[0] < full.score < full.score_ci[1]  # the interval drawn as the error bar
    assert plot_quality_vs_ttft(rows, tmp_path / "fig.png").stat().st_size > 1000
