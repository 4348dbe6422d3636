"""docs/benchmarks.md's generated tables agree with the committed results files (`benchmarks/tables.py --check`)."""

from __future__ import annotations

import tables


def test_the_benchmark_doc_tables_match_the_committed_results():
    assert tables.main(["--check"]) == 0


def test_a_changed_result_is_reported_as_a_stale_table(tmp_path):
    text = tables.DOC.read_text(encoding="utf-8")
    start = text.index("<!-- table:ttft -->\n") + len("<!-- table:ttft -->\n")
    edited = text[:start] + "| a row no results file holds |\n" + text[start:]
    rebuilt, stale = tables.rebuild(edited)
    assert stale == ["ttft"] and rebuilt == text
    doc = tmp_path / "benchmarks.md"
    doc.write_text(edited, encoding="utf-8")
    assert tables.main(["--check", "--doc", str(doc)]) == 1
