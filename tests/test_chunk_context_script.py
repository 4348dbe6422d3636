"""benchmarks/chunk_context.py: the contexts it prefills chunks after, the KV it stores, and its report."""

from __future__ import annotations

import json

import pytest
import torch

from cacheblend_rag.testing import random_words


@pytest.fixture()
def context_script(load_script):
    return load_script("chunk_context")


def test_contexts(context_script):
    chunks = [(1, 2), (3,), (4, 5, 6)]
    assert context_script.contexts("alone", chunks, (9,)) == [(), (), ()]
    assert context_script.contexts("predecessor", chunks, (9,)) == [(), (1, 2), (3,)]
    assert context_script.contexts("all-before", chunks, (9,)) == [(), (1, 2), (1, 2, 3)]
    assert context_script.contexts("unrelated", chunks, (9, 8)) == [(9, 8)] * 3
    assert context_script.contexts("lead-in", chunks, (9, 8)) == [(), (9, 8), (9, 8)]
    with pytest.raises(ValueError, match="unknown context"):
        context_script.contexts("after", chunks, ())


def test_chunks_stored_after_all_earlier_chunks_make_reuse_a_full_prefill(context_script, tiny_engine):
    chunks = [random_words(s, 12) for s in (21, 22, 23)]
    prefix = random_words(3, 5)
    prompt = tiny_engine.build_prompt(chunks, prefix=prefix, suffix=random_words(4, 6))
    tiny_engine.precompute(chunks, prefix=prefix)
    full = tiny_engine.prefill(prompt, "full").logits.double()
    alone = tiny_engine.prefill(prompt, "reuse").logits.double()
    assert float((alone - full).abs().max()) > 1e-3  # the set-up can tell stale KV from exact KV

    before = context_script.contexts("all-before", prompt.chunk_ids, ())
    context_script.store_with_context(tiny_engine, prompt, before)
    exact = tiny_engine.prefill(prompt, "reuse").logits.double()
    torch.testing.assert_close(exact, full, atol=1e-4, rtol=1e-4)

    # One chunk of context is not all of it: the third chunk still misses the first.
    context_script.store_with_context(tiny_engine, prompt, context_script.contexts("predecessor", prompt.chunk_ids, ()))
    assert float((tiny_engine.prefill(prompt, "reuse").logits.double() - full).abs().max()) > 1e-4

    # Storing `alone` again restores what precompute stored.
    context_script.store_with_context(tiny_engine, prompt, context_script.contexts("alone", prompt.chunk_ids, ()))
    torch.testing.assert_close(tiny_engine.prefill(prompt, "reuse").logits.double(), alone)


def test_report_pairs_each_row_with_the_same_method_on_alone_kv(context_script, tmp_path, capsys):
    recs = [
        {"dataset": "multi_news", "case_id": c, "method": m, "kl_mean": kl + i, "top1": 0.9, "compute_share": 0.1}
        for i, c in enumerate(("a", "b"))
        for m, kl in (("alone/reuse", 0.5), ("predecessor/reuse", 0.1))
    ]
    (tmp_path / context_script.RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert context_script.main(["--report-only", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "multi_news: 2 cases with every method" in out
    row = "| predecessor/reuse | 0.6000 [0.1000, 1.1000] | 0.900 [0.900, 0.900] | 0.100 | -0.4000 [-0.4000, -0.4000] |"
    assert row in out
    assert "| alone/reuse | 1.0000 [0.5000, 1.5000] | 0.900 [0.900, 0.900] | 0.100 | - |" in out
    assert (tmp_path / "summary.md").read_text().startswith("multi_news: 2 cases")


def test_report_without_records_says_what_to_run(context_script, tmp_path, capsys):
    assert context_script.main(["--report-only", "--out", str(tmp_path)]) == 2
    assert "run without --report-only first" in capsys.readouterr().err
