"""benchmarks/set_lead_ins.py: a lead-in file per data set from one case's chunks, on synthetic data files."""

from __future__ import annotations

import json

from cacheblend_rag.evaluation.datasets import Case
from cacheblend_rag.testing import random_words


def test_the_text_is_the_cases_chunks_cut_at_a_space(load_script):
    lead = load_script("set_lead_ins")
    case = Case(id="c", chunks=("alpha beta gamma", "delta epsilon"), question="q", answers=("a",), task="qa")
    assert lead.lead_in_text(case, 1000) == "alpha beta gamma\n\ndelta epsilon"
    assert lead.lead_in_text(case, 14) == "alpha beta"  # "alpha beta gam" cut back to a whole word
    assert lead.lead_in_text(case, 3) == "alp"  # no space to cut at


def test_writes_one_file_per_data_set_from_the_chosen_case(load_script, tmp_path, capsys):
    lead = load_script("set_lead_ins")
    records = [{"question": f"q{i}", "answers": ["a"], "ctxs": [{"title": "", "text": random_words(i, 30)}]}
               for i in range(3)]  # fmt: skip
    (tmp_path / "musique").mkdir()
    (tmp_path / "musique" / "musique_s.json").write_text(json.dumps(records))
    out = tmp_path / "out"
    args = ["--datasets", "musique", "--case", "2", "--chars", "40", "--out", str(out), "--data-dir", str(tmp_path)]
    assert lead.main(args) == 0
    text = (out / "musique.txt").read_text()
    assert random_words(2, 30).startswith(text.strip()) and 20 < len(text) <= 41
    assert lead.main([*args[:2], "--case", "3", *args[4:]]) == 2
    assert "musique has 3 cases; choose --case below that" in capsys.readouterr().err


def test_an_unknown_data_set_or_folder_is_a_clear_error(load_script, tmp_path, capsys):
    lead = load_script("set_lead_ins")
    assert lead.main(["--datasets", "nosuch", "--out", str(tmp_path / "out"), "--data-dir", str(tmp_path)]) == 2
    assert "unknown data set 'nosuch'" in capsys.readouterr().err
    assert lead.main(["--datasets", "musique", "--out", str(tmp_path / "out"), "--data-dir", str(tmp_path / "no")]) == 2
    assert "is not a folder" in capsys.readouterr().err
