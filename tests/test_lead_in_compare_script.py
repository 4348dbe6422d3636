"""benchmarks/lead_in_compare.py: two fidelity runs paired per case, on synthetic records."""

from __future__ import annotations

import json

import pytest


def write(folder, recs):
    folder.mkdir()
    (folder / "fidelity.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def rec(case, method, kl, top1):
    return {"dataset": "musique", "case_id": case, "method": method, "kl_mean": kl, "top1": top1, "compute_share": 0.1}


def test_pairs_each_method_with_itself_without_the_lead_in(load_script, tmp_path, capsys):
    compare = load_script("lead_in_compare")
    alone = [rec(c, m, kl, 0.8) for c in ("a", "b", "c") for m, kl in (("reuse", 0.4), ("paper@0.15", 0.2))]
    alone += [rec(c, "attention@0.05", 0.3, 0.8) for c in ("a", "b", "c")]
    alone.append(rec("a", "full", 0.0, 1.0))
    lead = [rec(c, m, kl, 0.9) for c in ("a", "b") for m, kl in (("reuse", 0.25), ("attention@0.05", 0.1))]
    lead.append(rec("b", "attention@0.15", 0.05, 0.95))
    write(tmp_path / "alone", alone)
    write(tmp_path / "lead", lead)
    out = tmp_path / "compare.md"
    args = ["--alone", str(tmp_path / "alone"), "--lead-in", str(tmp_path / "lead"), "--out", str(out)]
    assert compare.main(args) == 0
    text = capsys.readouterr().out
    assert text == out.read_text() + "\n"
    assert "musique: 1 cases with every method" in text  # case b alone has every method; case c had no lead-in run
    assert (
        "| reuse+lead-in | 0.2500 [0.2500, 0.2500] | 0.900 [0.900, 0.900] | 0.100 | -0.1500 [-0.1500, -0.1500] |"
        in text
    )
    # The target row pairs over the cases both methods have: a and b.
    assert (
        "| musique | attention@0.05+lead-in | paper@0.15 | 2 | -0.1000 [-0.1000, -0.1000] | +0.100 [+0.100, +0.100] |"
        in text
    )


def test_an_empty_run_says_what_to_do(load_script, tmp_path, capsys):
    compare = load_script("lead_in_compare")
    write(tmp_path / "alone", [rec("a", "reuse", 0.4, 0.8)])
    (tmp_path / "lead").mkdir()
    assert compare.main(["--alone", str(tmp_path / "alone"), "--lead-in", str(tmp_path / "lead")]) == 2
    assert "run `cacheblend-rag bench fidelity` there" in capsys.readouterr().err


def test_named_lead_in_runs_side_by_side(load_script, tmp_path, capsys):
    compare = load_script("lead_in_compare")
    alone = [rec(c, m, kl, 0.8) for c in ("a", "b") for m, kl in (("reuse", 0.4), ("paper@0.15", 0.2))]
    write(tmp_path / "alone", alone)
    write(tmp_path / "neutral", [rec(c, "attention@0.05", 0.3, 0.8) for c in ("a", "b")])
    write(tmp_path / "set", [rec(c, "attention@0.05", kl, 0.9) for c, kl in (("a", 0.1), ("b", 0.2))])
    args = ["--alone", str(tmp_path / "alone"), "--lead-in", str(tmp_path / "neutral")]
    assert compare.main([*args, "--lead-in", f"set-lead-in={tmp_path / 'set'}"]) == 0
    text = capsys.readouterr().out
    assert "| attention@0.05+set-lead-in | 0.1500 [0.1000, 0.2000] | 0.900 [0.900, 0.900] | 0.100 | - |" in text
    # each later lead-in against the first, paired per case
    assert "| musique | attention@0.05+set-lead-in | attention@0.05+lead-in | 2 | -0.1500 [-0.2000, -0.1000] |" in text
    assert "| musique | attention@0.05+set-lead-in | paper@0.15 | 2 | -0.0500 [-0.1000, +0.0000] |" in text
    with pytest.raises(SystemExit, match="a run's name is letters"):
        compare.main([*args, "--lead-in", f"a b={tmp_path / 'set'}"])
