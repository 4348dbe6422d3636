"""What the per-case benchmark scripts share: their case lists, the order they take cases in, their table."""

from __future__ import annotations

from types import SimpleNamespace

from cacheblend_rag.evaluation.case_scripts import cases_in_turn, paired_kl_table, parse_cases


def test_case_lists():
    assert parse_cases("0-2,5") == [0, 1, 2, 5]
    assert parse_cases("3") == [3]


def test_cases_in_turn_cover_the_sets_evenly_and_skip_missing_cases():
    sets = {"a": SimpleNamespace(cases=[0, 1, 2]), "b": SimpleNamespace(cases=[0])}
    got = [(name, i) for name, _, i in cases_in_turn(sets, [0, 1, 2])]
    assert got == [("a", 0), ("b", 0), ("a", 1), ("a", 2)]


def test_paired_table_uses_only_cases_with_every_method_and_each_row_baseline():
    recs = [
        {"dataset": "d", "case_id": c, "method": m, "kl_mean": kl, "top1": t, "compute_share": 0.2}
        for c, m, kl, t in (
            ("x", "base", 0.3, 0.8),
            ("x", "new", 0.1, 1.0),
            ("y", "base", 0.5, 0.6),
            ("y", "new", 0.2, 0.8),
            ("z", "base", 9.0, 0.0),  # no "new" on z: left out of every row
        )
    ]
    text = paired_kl_table(
        recs, sorted, lambda m: None if m == "base" else "base", first_column="rule", diff_column="KL - base"
    )
    lines = text.splitlines()
    assert lines[0] == "d: 2 cases with every method"
    assert lines[2] == "| rule | mean KL [95% CI] | top-1 [95% CI] | compute share | KL - base [95% CI] |"
    assert lines[4] == "| base | 0.4000 [0.3000, 0.5000] | 0.700 [0.600, 0.800] | 0.200 | - |"
    assert lines[5] == "| new | 0.1500 [0.1000, 0.2000] | 0.900 [0.800, 1.000] | 0.200 | -0.2500 [-0.3000, -0.2000] |"
