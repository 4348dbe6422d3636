"""benchmarks/answer_drift.py: the per-quarter split of an answer's KL and its report, on synthetic records."""

from __future__ import annotations

import json
import math

import pytest


@pytest.fixture()
def drift(load_script):
    return load_script("answer_drift")


def test_quarters_split_the_answer_by_position(drift):
    assert drift.quarters([1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0]) == [1.0, 2.0, 3.0, 4.0]
    assert drift.quarters([0.0] * 6 + [6.0]) == pytest.approx([0.0, 0.0, 0.0, 3.0])  # 7 tokens: 2, 2, 1, 2
    assert sum(math.isnan(x) for x in drift.quarters([1.0])) == 3  # shorter than 4 tokens: empty quarters
    assert drift.parse_cases("0-2,5") == [0, 1, 2, 5]


def test_report_only_compares_methods_on_their_common_cases(drift, tmp_path, capsys):
    recs = [
        {"dataset": "multi_news", "case": c, "method": m, "kl": kl}
        for c in ("a", "b")
        for m, kl in (("reuse", [0.4, 0.4, 0.1, 0.1]), ("attention@0.15", [0.2, 0.2, 0.1, 0.1]))
    ]
    recs.append({"dataset": "multi_news", "case": "c", "method": "reuse", "kl": [9.0] * 4})  # no attention: dropped
    (tmp_path / drift.RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert drift.main(["--report-only", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "multi_news: 2 cases" in out and "0.4000 [0.4000, 0.4000]" in out and "9.0" not in out
    assert "0.25 [0.25, 0.25]" in out and "0.50 [0.50, 0.50]" in out  # last half / first quarter
    assert (tmp_path / "summary.txt").read_text().strip() == out.strip()


def test_report_only_without_records_says_what_to_run(drift, tmp_path, capsys):
    assert drift.main(["--report-only", "--out", str(tmp_path)]) == 2
    assert "run without --report-only first" in capsys.readouterr().err
