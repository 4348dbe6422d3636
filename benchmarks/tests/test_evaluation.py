"""Evaluation: scoring and the data set loaders on the real files (`cacheblend_rag.evaluation`), then the quality
benchmark's methods and resumable runner (`benchmarks/benchlib`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from benchlib import quality
from benchlib.methods import MapReduce, MapRerank, parse_method, parse_methods, parse_rerank_output
from benchlib.quality import RESULTS_FILE, load_records, run_quality, summarize, summary_markdown, write_report

from cacheblend_rag import blend_rule
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.evaluation import (
    Case,
    Dataset,
    DatasetError,
    TaskSpec,
    best_score,
    load_dataset,
    normalize_answer,
    resolve_data_dir,
    score_answer,
)
from cacheblend_rag.evaluation.datasets import QA_SPEC_TEMPLATE, load_samsum, split_passages
from cacheblend_rag.evaluation.scoring import parse_short_answer, token_f1
from cacheblend_rag.testing import random_words

DATA_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA_DIR.is_dir(), reason=f"benchmark data not present at {DATA_DIR.resolve()}")


# Tiny models: one torch thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


# -- scoring ---------------------------------------------------------------------------------------------------


def test_squad_normalization_drops_case_punctuation_and_articles():
    assert normalize_answer("The  Eiffel-Tower, in PARIS!") == "eiffeltower in paris"
    assert normalize_answer("an apple a day") == "apple day"
    assert normalize_answer("Theater") == "theater"  # "the" inside a word stays


def test_token_f1_counts_overlapping_words():
    assert token_f1("The Exeter College.", "Exeter College") == 1.0
    assert token_f1("Exeter", "Exeter College") == pytest.approx(2 * 1.0 * 0.5 / 1.5)
    assert token_f1("Oxford", "Exeter College") == 0.0
    assert token_f1("", "") == 1.0 and token_f1("the", "Exeter") == 0.0


def test_f1_is_the_best_over_every_alias_of_every_gold():
    # 2WikiMQA answers are lists of aliases per gold answer; the loader flattens them
    golds = [alias for gold in [["United States", "USA"], ["Croatia"]] for alias in gold]
    assert best_score("USA", golds, "f1") == 1.0
    assert best_score("croatia.", golds, "f1") == 1.0
    assert best_score("France", golds, "f1") == 0.0
    with pytest.raises(TypeError, match="single string"):
        best_score("USA", "USA", "f1")
    with pytest.raises(ValueError, match="metric must be one of f1, rouge_l, got 'bleu'"):
        best_score("USA", golds, "bleu")


def test_qa_scoring_keeps_the_first_line_and_reduces_yes_no():
    assert parse_short_answer("\nYes, he was.\nBecause ...") == "Yes"
    assert parse_short_answer("Norway\nexplanation") == "Norway"  # not mistaken for "No"
    assert score_answer("qa", "Exeter College\nThe author studied there.", ["Exeter College"]) == 1.0


def test_rouge_l_sanity():
    gold = "Hannah needs Betty's number but Amanda doesn't have it."
    assert best_score(gold, [gold], "rouge_l") == pytest.approx(1.0)
    assert best_score("completely unrelated words here", [gold], "rouge_l") == 0.0
    partial = best_score("Hannah needs the number of Betty.", [gold], "rouge_l")
    assert 0.2 < partial < 0.9
    assert best_score("Amanda lacks it", ["zzz", gold], "rouge_l") == best_score("Amanda lacks it", [gold], "rouge_l")


# -- loaders ---------------------------------------------------------------------------------------------------


@needs_data
def test_musique_loader_reads_the_papers_150_cases():
    ds = load_dataset("musique", DATA_DIR)
    assert len(ds.cases) == 150 and ds.spec.task == "qa"
    case = ds.cases[0]
    assert len(case.chunks) == 10 and case.answers == ("Exeter College",)
    assert case.question.endswith("?") and case.question[0].islower()


@needs_data
def test_wikimqa_loader_flattens_alias_lists():
    ds = load_dataset("2wikimqa", DATA_DIR, limit=20)
    assert ds.spec.name == "wikimqa" and len(ds.cases) == 20
    raw = json.loads((DATA_DIR / "wikimqa" / "wikimqa_s_clean.json").read_text())
    for case, rec in zip(ds.cases, raw, strict=False):
        assert set(case.answers) == {a for gold in rec["answers"] for a in gold}


@needs_data
def test_multi_news_loader_splits_passages_and_restores_newlines():
    ds = load_dataset("multi_news", DATA_DIR, limit=5)
    assert ds.spec.task == "summary" and len(ds.cases) == 5
    for case in ds.cases:
        assert len(case.chunks) >= 2
        assert all("NEWLINE_CHAR" not in c and not c.startswith("Passage") for c in case.chunks)
        assert len(case.answers) == 1 and len(case.answers[0]) > 100


def test_split_passages():
    ctx = "Passage 1:\nfirst NEWLINE_CHAR NEWLINE_CHAR line\nPassage 2:\nsecond\nPassage 3:\n  \n"
    assert split_passages(ctx) == ["first\n\nline", "second"]


@needs_data
def test_samsum_few_shot_cases_are_deterministic_and_prefix_stable():
    a = load_samsum(DATA_DIR, limit=6, shots=5)
    b = load_samsum(DATA_DIR, limit=3, shots=5)
    assert [c.chunks for c in a.cases[:3]] == [c.chunks for c in b.cases]  # --limit does not reshuffle
    assert len(a.cases[0].chunks) == 5 and a.cases[0].chunks != a.cases[1].chunks
    assert all(c.startswith("Dialogue: ") and "\nSummary: " in c for c in a.cases[0].chunks)
    test0 = json.loads((DATA_DIR / "samsum" / "test.jsonl").read_text().splitlines()[0])
    assert a.cases[0].question == test0["context"].strip() and a.cases[0].answers == (test0["response"].strip(),)
    assert load_samsum(DATA_DIR, limit=2, shots=5, seed=1).cases[0].chunks != a.cases[0].chunks


def test_loaders_name_the_missing_file_and_the_option(tmp_path):
    with pytest.raises(DatasetError, match=r"musique_s\.json.*--data-dir"):
        load_dataset("musique", tmp_path)
    with pytest.raises(DatasetError, match="--data-dir"):
        load_dataset("samsum", tmp_path / "nowhere")
    with pytest.raises(DatasetError, match="unknown data set 'squad'"):
        load_dataset("squad", tmp_path)


@needs_data
def test_the_data_folder_is_the_argument_else_the_environment_else_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("CACHEBLEND_RAG_DATA", raising=False)
    with pytest.raises(DatasetError, match="--data-dir DIR or set CACHEBLEND_RAG_DATA"):
        resolve_data_dir(None)
    monkeypatch.setenv("CACHEBLEND_RAG_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(DatasetError, match="CACHEBLEND_RAG_DATA=.*is not a folder"):
        resolve_data_dir(None)
    monkeypatch.setenv("CACHEBLEND_RAG_DATA", str(DATA_DIR))
    assert resolve_data_dir(None) == DATA_DIR
    assert resolve_data_dir(tmp_path) == tmp_path  # an argument wins over the environment
    from_env = load_dataset("musique", None, limit=1).cases[0]
    assert from_env.chunks == load_dataset("musique", DATA_DIR, 1).cases[0].chunks


def test_loader_rejects_malformed_answers(tmp_path):
    (tmp_path / "wikimqa").mkdir()
    bad = [{"ctxs": [{"title": "", "text": "w3 w4"}], "question": "q", "answers": ["flat"]}]
    (tmp_path / "wikimqa" / "wikimqa_s_clean.json").write_text(json.dumps(bad))
    with pytest.raises(DatasetError, match="list of lists"):
        load_dataset("wikimqa", tmp_path)


# -- methods ---------------------------------------------------------------------------------------------------


def test_method_names_parse_and_canonicalize():
    names = [m.name for m in parse_methods("full, prefix,reuse,blend@0.3,blend@0.30,blend,mapreduce,maprerank")]
    assert names == ["full", "prefix", "reuse", "blend@0.30", "blend@0.15", "mapreduce", "maprerank"]
    with pytest.raises(ConfigError, match="unknown method 'stuff'"):
        parse_methods("stuff")
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        parse_methods("blend@1.5")


def test_named_rules_are_methods_that_pin_their_rule_per_request():
    gradual, default = parse_methods("gradual@0.15,blend@0.15")
    assert (gradual.name, default.name) == ("gradual@0.15", "blend@0.15")
    assert gradual.rule == "gradual" and default.rule is None
    with pytest.raises(ConfigError, match="gradual@R needs a number"):
        parse_method("gradual@x")
    with pytest.raises(ConfigError, match="unknown method 'nope@0.1'.*RULE@R"):
        parse_method("nope@0.1")

    class Spy:  # the engine's generate, recording what the method asks for
        def generate(self, chunks, question, **options):
            self.options = options
            keys = ("compute_share", "chunks_hit", "chunks_missed", "load_s", "compute_s", "decode_s")
            keys += ("generated_tokens",)
            metrics = SimpleNamespace(ttft_s=0.1, prompt_tokens=9, recomputed_tokens=2, **dict.fromkeys(keys, 0))
            return SimpleNamespace(text="x", metrics=metrics, finish_reason="stop")

    case = Case("c", ("a chunk",), "q?", ("x",), "qa")
    engine = Spy()
    gradual.run(engine, QA_SPEC, case, 8)
    assert engine.options["blend"] == blend_rule("gradual", 0.15) and "recompute_ratio" not in engine.options
    default.run(engine, QA_SPEC, case, 8)
    assert "blend" not in engine.options and engine.options["recompute_ratio"] == 0.15


def test_rerank_output_parsing():
    assert parse_rerank_output(" Exeter College\nScore: 85") == ("Exeter College", 85.0)
    assert parse_rerank_output("Answer: Paris\nScore: 40\nextra") == ("Paris", 40.0)
    assert parse_rerank_output("I do not know") == ("I do not know", -1.0)


QA_SPEC = TaskSpec("fake_qa", "qa", QA_SPEC_TEMPLATE, max_new_tokens=4)


def _fake_dataset(n: int = 2, task: str = "qa") -> Dataset:
    cases = tuple(
        Case(
            id=f"fake-{i}",
            chunks=tuple(random_words(100 * i + j, 12) for j in range(3)),
            question=random_words(100 * i + 50, 4),
            answers=(random_words(100 * i + 51, 2), "w5"),
            task=task,  # type: ignore[arg-type]
        )
        for i in range(n)
    )
    return Dataset(QA_SPEC, cases)


class CountingEngine:
    """Wraps an engine and counts its generate calls, to check what a resumed run redoes."""

    def __init__(self, engine):
        self.engine, self.calls = engine, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, *args, **kwargs):
        self.calls += 1
        return self.engine.generate(*args, **kwargs)


@pytest.mark.parametrize("family", ["llama"])
def test_map_methods_call_once_per_chunk_plus_reduce(tiny_engine):
    ds = _fake_dataset(1)
    case, engine = ds.cases[0], CountingEngine(tiny_engine)
    # Map requests keep the data set's prefix, so the chunk KV warmed for the one-request methods serves them.
    assert engine.precompute(list(case.chunks), case.question, template=ds.spec.template) == (0, len(case.chunks))
    for method, calls in ((MapReduce(), len(case.chunks) + 1), (MapRerank(), 2 * len(case.chunks))):
        method.warm(engine, ds.spec, case)
        before = engine.calls
        res = method.run(engine, ds.spec, case, max_new_tokens=4)
        assert engine.calls - before == calls
        assert res.extra["map_calls"] == len(case.chunks)
        assert res.ttft_s >= res.extra["map_s"] > 0  # every map call happens before the answer's first token
        assert res.extra["ttft_parallel_s"] <= res.ttft_s
        assert res.extra["map_chunks_missed"] == 0
    assert all("Score:" in text for text in res.extra["map_outputs"])  # the rerank reply always reaches a score


def test_map_methods_skip_few_shot_and_rerank_skips_summaries():
    few_shot = TaskSpec("s", "summary", QA_SPEC.template, 8, chunks_are_context=False)
    summary = TaskSpec("m", "summary", QA_SPEC.template, 8)
    assert not MapReduce().supports(few_shot) and MapReduce().supports(summary)
    assert not MapRerank().supports(summary) and MapRerank().supports(QA_SPEC)


# -- runner ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2"])
def test_runner_writes_jsonl_resumes_without_redoing_cases_and_reports(tiny_engine, tmp_path):
    methods = parse_methods("full,reuse,blend@0.15,mapreduce")
    engine = CountingEngine(tiny_engine)
    ds1 = Dataset(QA_SPEC, _fake_dataset(2).cases[:1])
    records = run_quality(engine, [ds1], methods, tmp_path, show_progress=False, settings={"model": "tiny"})
    first_calls = engine.calls
    assert len(records) == 4 and first_calls == 3 + len(ds1.cases[0].chunks) + 1
    lines = (tmp_path / RESULTS_FILE).read_text().splitlines()
    assert [json.loads(line)["method"] for line in lines] == [m.name for m in methods]
    rec = json.loads(lines[0])
    assert rec["case_id"] == "fake-0" and 0.0 <= rec["score"] <= 1.0 and rec["ttft_s"] > 0 and rec["metric"] == "F1"

    # Resume with the second case added: only the new case runs.
    engine.calls = 0
    two = [_fake_dataset(2)]
    records = run_quality(engine, two, methods, tmp_path, show_progress=False, settings={"model": "tiny"})
    assert engine.calls == first_calls and len(records) == 8
    assert len(load_records(tmp_path)) == 8
    engine.calls = 0
    run_quality(engine, two, methods, tmp_path, show_progress=False, settings={"model": "tiny"})
    assert engine.calls == 0

    files = write_report(tmp_path)
    table = files["summary_md"].read_text()
    assert "| blend@0.15 |" in table and "| mapreduce |" in table
    assert all(r.n == 2 for r in summarize(load_records(tmp_path)))
    assert files["quality_vs_ttft"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "quality_vs_ratio" not in files and not (tmp_path / "quality_vs_ratio.png").exists()  # one ratio only

    with pytest.raises(Exception, match="another setup"):
        run_quality(engine, two, methods, tmp_path, show_progress=False, settings={"model": "other"})


@pytest.mark.parametrize("family", ["llama"])
def test_runner_drops_a_torn_last_line_and_redoes_that_case(tiny_engine, tmp_path):
    methods = parse_methods("full,reuse")
    run_quality(tiny_engine, [_fake_dataset(1)], methods, tmp_path, show_progress=False)
    path = tmp_path / RESULTS_FILE
    text = path.read_text()
    path.write_text(text[: len(text) - 20])  # the process died while writing the second record
    assert len(load_records(tmp_path)) == 1
    engine = CountingEngine(tiny_engine)
    records = run_quality(engine, [_fake_dataset(1)], methods, tmp_path, show_progress=False)
    assert engine.calls == 1 and [r["method"] for r in records] == ["full", "reuse"]
    assert [json.loads(line)["method"] for line in path.read_text().splitlines()] == ["full", "reuse"]


@pytest.mark.parametrize("family", ["llama"])
def test_runner_records_an_engine_refusal_and_goes_on(tiny_engine, tmp_path):
    long_case = Case(
        "too-long", tuple(random_words(i, 200) for i in range(3)), "w3 w4", ("w5",), "qa"
    )  # > 512 positions
    ds = Dataset(QA_SPEC, (long_case, _fake_dataset(1).cases[0]))
    records = run_quality(tiny_engine, [ds], parse_methods("full"), tmp_path, show_progress=False)
    assert records[0]["error"] and records[0]["score"] is None and records[1]["score"] is not None
    row = summarize(records)[0]
    assert row.n == 1 and row.errors == 1


def test_report_without_results_is_a_clear_error(tmp_path):
    with pytest.raises(Exception, match="no results"):
        write_report(tmp_path)


def test_summary_compares_with_full_on_the_same_cases_only():
    def rec(method, case, score, ttft):
        return {"dataset": "d", "method": method, "case_id": case, "metric": "F1", "score": score, "ttft_s": ttft}

    records = [
        rec("full", "a", 1.0, 10.0), rec("full", "b", 0.0, 20.0), rec("full", "c", 0.5, 30.0),
        rec("blend@0.15", "a", 0.5, 2.0), rec("blend@0.15", "c", 0.5, 10.0),  # b not run
        rec("prefix", "z", 1.0, 5.0),  # no full result for z
    ]  # fmt: skip
    rows = {r.method: r for r in summarize(records)}
    blend = rows["blend@0.15"]
    assert blend.n == 2 and blend.n_paired == 2
    assert blend.delta_vs_full == pytest.approx((0.5 - 1.0 + 0.5 - 0.5) / 2)  # not 0.5 - mean(full) over 3 cases
    assert blend.speedup_vs_full == pytest.approx((10.0 / 2.0 + 30.0 / 10.0) / 2)  # median of 5 and 3
    assert rows["full"].delta_vs_full == 0.0 and rows["full"].speedup_vs_full == 1.0
    assert rows["prefix"].n_paired == 0 and math.isnan(rows["prefix"].delta_vs_full)
    table = summary_markdown(list(rows.values()))
    # paired differences -0.5 and 0.0: sd 0.354, so the 95% half-width is 1.96 * 0.354 / sqrt(2) = 0.490
    assert blend.delta_ci95 == pytest.approx(1.96 * math.sqrt(0.125) / math.sqrt(2))
    assert "| blend@0.15 | 0.500 | 6.00 | 2 | -0.250 | [-0.740, +0.240] | - | 4.00 | 2 | 0 |" in table
    assert "| full | 0.500 | 20.00 | 3 | +0.000 | - | - | 1.00 | 3 | 0 |" in table


def test_agreement_with_full_scores_each_answer_against_fulls_answer():
    def rec(method, case, answer, task="qa"):
        return {"dataset": "d", "method": method, "case_id": case, "task": task, "metric": "F1", "score": 0.0,
                "ttft_s": 1.0, "answer": answer}  # fmt: skip

    records = [
        rec("full", "a", "the red house"), rec("full", "b", "Paris"),
        rec("reuse", "a", "a blue house"), rec("reuse", "b", "London"),
        rec("blend@0.15", "a", "Red house."), rec("blend@0.15", "b", "paris"),
    ]  # fmt: skip
    rows = {r.method: r for r in summarize(records)}
    assert rows["full"].agreement_with_full == 1.0
    assert rows["blend@0.15"].agreement_with_full == 1.0  # SQuAD normalisation: case, articles, punctuation
    assert rows["reuse"].agreement_with_full == pytest.approx((0.5 + 0.0) / 2)  # "blue house" vs "red house"
    assert "| reuse | 0.000 | 1.00 | 2 | +0.000 | [+0.000, +0.000] | 0.250 | 1.00 | 2 | 0 |" in summary_markdown(
        list(rows.values())
    )


def test_ratio_figure_uses_only_cases_where_every_ratio_ran(tmp_path, monkeypatch):
    def rec(method, case, score):
        return {"dataset": "d", "method": method, "case_id": case, "metric": "F1", "score": score, "ttft_s": 1.0}

    records = [rec(m, c, 1.0) for m in ("full", "reuse", "blend@0.15") for c in "abc"]
    records += [rec("blend@0.05", "a", 0.0), rec("blend@0.05", "b", 0.0), rec("prefix", "c", 1.0)]
    records.append({**rec("blend@0.05", "c", None), "error": "PromptError: too long"})
    assert quality.common_cases(records, ["full", "blend@0.05"]) == {("d", "a"), ("d", "b")}
    assert quality.common_cases(records, ["full", "prefix"]) == {("d", "c")}

    seen = {}
    monkeypatch.setattr(quality, "plot_panels", lambda data, path, **kw: seen.update(data=data, **kw) or path)
    quality.plot_quality_vs_ratio(records, tmp_path / "ratio.png", model="tiny")
    assert seen["panel_titles"] == {"d": "d (2 cases with every ratio)"}
    assert seen["ylabel"] == {"d": "mean F1"}  # each panel names its own metric
    assert {r["method"]: r["n"] for r in seen["data"]} == {"full": 2, "reuse": 2, "blend@0.15": 2, "blend@0.05": 2}
    assert quality.plot_quality_vs_ratio([rec("full", "a", 1.0)], tmp_path / "none.png", model="tiny") is None
    one_ratio = [r for r in records if r["method"] != "blend@0.05"]
    assert quality.plot_quality_vs_ratio(one_ratio, tmp_path / "one.png", model="tiny") is None  # one point is no curve
    assert not (tmp_path / "one.png").exists()
