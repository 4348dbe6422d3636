"""benchmarks/selection_headroom.py: its case list, method names and report, on synthetic records."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "selection_headroom.py"


@pytest.fixture()
def headroom(monkeypatch):
    spec = importlib.util.spec_from_file_location("selection_headroom_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_cases_and_methods(headroom):
    assert headroom.parse_cases("0-2,5") == [0, 1, 2, 5]
    names = headroom.method_names()
    assert names[0] == "reuse" and headroom.BASELINE in names and "oracle-product@0.05" in names
    assert len(names) == len(set(names)) == 1 + 3 * len(headroom.RATIOS) * 2


def test_report_pairs_each_method_with_the_paper_rule_on_common_cases(headroom, tmp_path, capsys):
    recs = [
        {"dataset": "musique", "case_id": c, "method": m, "kl_mean": kl + i, "top1": 0.9, "compute_share": 0.1}
        for i, c in enumerate(("a", "b"))
        for m, kl in (("paper@0.15", 0.1), ("oracle-product@0.05", 0.3))
    ]
    recs.append({"dataset": "musique", "case_id": "c", "method": "paper@0.15", "kl_mean": 9.0, "top1": 0.0,
                 "compute_share": 0.1})  # fmt: skip  # no oracle on this case: left out of every row
    (tmp_path / headroom.RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert headroom.main(["--report-only", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "musique: 2 cases with every method" in out
    assert (
        "| oracle-product@0.05 | 0.8000 [0.3000, 1.3000] | 0.900 [0.900, 0.900] | 0.100 | +0.2000 [+0.2000, +0.2000] |"
        in out
    )
    assert "| paper@0.15 | 0.6000 [0.1000, 1.1000] |" in out


def test_report_without_records_says_what_to_run(headroom, tmp_path, capsys):
    assert headroom.main(["--report-only", "--out", str(tmp_path)]) == 2
    assert "run without --report-only first" in capsys.readouterr().err
