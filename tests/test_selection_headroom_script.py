"""benchmarks/selection_headroom.py: its case list, method names and report, on synthetic records."""

from __future__ import annotations

import json

import pytest


@pytest.fixture()
def headroom(load_script):
    return load_script("selection_headroom")


def test_cases_and_methods(headroom):
    names = headroom.method_names()
    assert names[0] == "reuse" and headroom.BASELINE in names and "oracle-product@0.05" in names
    assert len(names) == len(set(names)) == 1 + 3 * len(headroom.RATIOS) + 4 * len(headroom.RATIOS)


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


def test_scores_on_a_tiny_model_ignore_the_exact_first_chunk(headroom, tiny_engine):
    from types import SimpleNamespace

    from cacheblend_rag.testing import random_words

    chunks = [random_words(s, 16) for s in (11, 12, 13)]
    prompt = tiny_engine.build_prompt(chunks, prefix=random_words(1, 5), suffix=random_words(2, 6))
    tiny_engine.precompute(chunks, prefix=random_words(1, 5))
    scores = headroom.rankings(tiny_engine, prompt, SimpleNamespace(token_ids=[5, 6, 7]))
    assert set(scores) == {*headroom.ORACLES, headroom.PROBE_PRODUCT}
    (s1, e1), (s2, e2), _ = prompt.chunk_spans
    for name, s in scores.items():
        assert s.shape == (prompt.num_tokens,) and bool((s >= 0).all()), name
        assert float(s[s2:].max()) > 0, name
    # The first chunk was precomputed right after the prefix: its cached KV is exact, so no error to weigh.
    for name in ("oracle-deviation", "oracle-product", "probe-x-error"):
        assert float(scores[name][s1:e1].max()) < 1e-6 * float(scores[name][s2:e2].max()), name
