"""Fidelity to full recompute: the teacher-forced measure (`cacheblend_rag.evaluation.fidelity`), then the fidelity
benchmark's resumable runner, report and command line (`benchmarks/`), on tiny random models and hand-made records."""

from __future__ import annotations

import json
import math

import pytest
import torch
from benchlib.fidelity_report import (
    case_groups,
    common_cases,
    fidelity_markdown,
    left_out,
    paired_difference,
    summarize_fidelity,
    sweep_group,
    write_fidelity_report,
)
from benchlib.fidelity_run import RESULTS_FILE, FidelityMethod, fidelity_methods, run_fidelity
from benchlib.records import load_records
from fidelity import main

from cacheblend_rag import BlendConfig, CacheBlendEngine, EngineConfig, blend_rule
from cacheblend_rag.engine.request.prompt import PromptTemplate
from cacheblend_rag.errors import CacheBlendError, ConfigError
from cacheblend_rag.evaluation import Case, Dataset, TaskSpec
from cacheblend_rag.evaluation.fidelity import (
    Reference,
    bootstrap_ci,
    compare,
    fidelity_over_cases,
    measure,
    reference_answer,
)
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

pytestmark = pytest.mark.usefixtures("one_thread")

PLAIN = PromptTemplate(system=None, instruction="", question_template="{question}", use_chat_template=False)


@pytest.fixture
def engine() -> CacheBlendEngine:
    model = make_tiny_model("qwen2", mute_eos=True)  # never stops early: answers of the full budget
    return CacheBlendEngine(model, make_tiny_tokenizer(), config=EngineConfig(miss_policy="blend", chunk_separator=""))


def tiny_dataset(n: int = 2, name: str = "tinyqa") -> Dataset:
    spec = TaskSpec(name, "qa", PLAIN, max_new_tokens=5)
    cases = tuple(
        Case(f"c{i}", tuple(random_words(10 * i + s, 16) for s in range(3)), random_words(i, 4), ("x",), "qa")
        for i in range(n)
    )
    return Dataset(spec, cases)


# -- the comparison --------------------------------------------------------------------------------------------


def test_compare_scores_kl_top1_first_token_and_log_probability():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 0.0]])
    ref = Reference([0, 1], torch.log_softmax(logits, -1), "ab", 1.0, 10)
    same = compare(ref, logits)
    assert same["kl_mean"] == pytest.approx(0.0, abs=1e-7) and same["top1"] == 1.0 and same["first_token"] == 1.0
    assert same["logprob"] == pytest.approx(float(ref.logprobs[0, 0] + ref.logprobs[1, 1]))
    other = torch.tensor([[0.0, 2.0, 0.0], [0.0, 3.0, 0.0]])  # wrong first pick, right second
    diff = compare(ref, other)
    p, q = ref.logprobs[0].exp(), torch.log_softmax(other[0], -1)
    assert diff["kl_max"] == pytest.approx(float((p * (ref.logprobs[0] - q)).sum()), rel=1e-5)
    assert diff["kl_mean"] == pytest.approx(diff["kl_max"] / 2, rel=1e-5)
    assert diff["top1"] == 0.5 and diff["first_token"] == 0.0


def test_blend_at_ratio_one_is_perfectly_faithful_and_reuse_is_not(engine):
    ds = tiny_dataset(1)
    case = ds.cases[0]
    engine.precompute(list(case.chunks), case.question, template=PLAIN)
    prompt = engine.build_prompt(list(case.chunks), case.question, template=PLAIN)
    ref = reference_answer(engine, prompt, 6)
    assert len(ref.token_ids) == 6 and ref.logprobs.shape[0] == 6
    # Teacher forcing in one forward matches full's own step-by-step decoding.
    exact = measure(engine, prompt, ref, blend_rule("paper", 1.0))
    assert exact["kl_max"] < 1e-5 and exact["top1"] == 1.0 and exact["first_token"] == 1.0
    assert exact["compute_share"] > 0.9
    reuse = measure(engine, prompt, ref, None)
    assert reuse["kl_mean"] > 1e-4 and reuse["compute_share"] < 0.2


def test_fidelity_over_cases_averages_each_figure_and_brackets_kl_and_top1():
    cases = [_rec("paper@0.15", f"c{i}", kl, top1) for i, (kl, top1) in enumerate([(0.1, 0.9), (0.3, 0.7), (0.2, 0.8)])]
    stats = fidelity_over_cases(cases)
    assert stats.n == 3 and stats.kl_mean == pytest.approx(0.2) and stats.top1 == pytest.approx(0.8)
    assert stats.kl_max == pytest.approx(0.4) and stats.logprob == pytest.approx(-0.2) and stats.first_token == 1.0
    assert stats.kl_ci[0] < 0.2 < stats.kl_ci[1] and stats.top1_ci[0] < 0.8 < stats.top1_ci[1]
    with pytest.raises(ValueError, match="no case"):
        fidelity_over_cases([])


def test_methods_name_rule_and_ratio_and_refuse_mismatches():
    names = [m.name for m in fidelity_methods(["paper", "epic"], [0.05, 0.15])]
    assert names == ["reuse", "paper@0.05", "paper@0.15", "epic@0.05", "epic@0.15"]
    with pytest.raises(ConfigError, match="a ratio goes with blend rules only"):
        FidelityMethod("paper")
    with pytest.raises(ConfigError, match="unknown blend rule"):
        FidelityMethod("nope", 0.1)


# -- the runner ----------------------------------------------------------------------------------------------


def test_run_fidelity_resumes_and_only_measures_what_is_missing(engine, tmp_path):
    ds = tiny_dataset(2)
    first = run_fidelity(engine, [ds], fidelity_methods(["paper"], [0.5]), tmp_path, show_progress=False)
    assert sorted(r["method"] for r in first) == ["full", "full", "paper@0.50", "paper@0.50", "reuse", "reuse"]
    again = run_fidelity(engine, [ds], fidelity_methods(["paper"], [0.5]), tmp_path, show_progress=False)
    assert len(again) == 6 and len(load_records(tmp_path, filename=RESULTS_FILE)) == 6
    more = run_fidelity(engine, [ds], fidelity_methods(["epic"], [0.5]), tmp_path, show_progress=False)
    assert len(more) == 8 and {r["method"] for r in more[6:]} == {"epic@0.50"}
    full = next(r for r in more if r["method"] == "full")
    assert full["kl_mean"] == 0.0 and full["answer_tokens"] == 5 and full["reference"]


def test_run_fidelity_refuses_another_setup_in_the_same_folder(engine, tmp_path):
    run_fidelity(engine, [tiny_dataset(1)], [], tmp_path, settings={"model": "a"}, show_progress=False)
    with pytest.raises(CacheBlendError, match="holds results of another setup"):
        run_fidelity(engine, [tiny_dataset(1)], [], tmp_path, settings={"model": "b"}, show_progress=False)


# -- the report ------------------------------------------------------------------------------------------------


def _rec(method: str, case: str, kl: float, top1: float, dataset: str = "musique") -> dict:
    rule, _, ratio = method.partition("@")
    return {"dataset": dataset, "case_id": case, "method": method, "rule": rule,
            "ratio": float(ratio) if ratio else None, "kl_mean": kl, "kl_max": 2 * kl, "top1": top1,
            "first_token": 1.0, "logprob": -kl, "compute_share": 0.1, "ttft_s": 1.0}  # fmt: skip


DEFAULT = BlendConfig().rule  # the targets compare the default rule with the paper's


def synthetic_records() -> list[dict]:
    recs = []
    for i in range(8):
        c = f"c{i}"
        recs += [_rec("full", c, 0.0, 1.0), _rec("reuse", c, 0.5 + 0.01 * i, 0.6), _rec("paper@0.15", c, 0.1, 0.8)]
        recs += [_rec(f"{DEFAULT}@0.05", c, 0.08, 0.85), _rec(f"{DEFAULT}@0.15", c, 0.05, 0.9)]
    recs += [_rec("epic@0.05", "c0", 0.3, 0.7)]  # measured on one case only: left out
    recs += [_rec("gradual@0.05", f"c{i}", 0.2, 0.7) for i in range(5)]  # on 5 of 8: the table shrinks to 5
    return recs


def test_bootstrap_interval_brackets_the_mean_and_collapses_for_constants():
    lo, hi = bootstrap_ci([0.1, 0.2, 0.3, 0.9])
    assert lo < 0.375 < hi and bootstrap_ci([0.2] * 5) == pytest.approx((0.2, 0.2))
    assert all(math.isnan(x) for x in bootstrap_ci([]))


def test_report_compares_methods_only_on_common_cases():
    recs = synthetic_records()
    cases, kept, left = common_cases(recs)["musique"]
    assert len(cases) == 5 and left == ["epic@0.05"] and "gradual@0.05" in kept
    rows = summarize_fidelity(recs)
    assert [r.method for r in rows] == ["full", "reuse", *sorted([f"{DEFAULT}@0.05", f"{DEFAULT}@0.15", "gradual@0.05",
                                                                   "paper@0.15"])]  # fmt: skip
    reuse = rows[1]
    assert reuse.n == 5 and reuse.kl_ci[0] <= reuse.kl_mean <= reuse.kl_ci[1]
    # Paired differences use every case both methods finished, beyond the table's common cases.
    n, mean, _ = paired_difference(recs, "musique", f"{DEFAULT}@0.05", "paper@0.15", "kl_mean")
    assert n == 8 and mean == pytest.approx(-0.02)


def test_rules_run_on_fewer_cases_get_their_own_table_beside_the_reference_rows():
    recs = synthetic_records() + [_rec("paper@0.05", f"c{i}", 0.15, 0.8) for i in (1, 2, 3)]
    groups = case_groups(recs)["musique"]
    assert len(groups) == 2 and groups[0][0] == {f"c{i}" for i in range(5)} and "paper@0.05" not in groups[0][1]
    cases, methods = groups[1]
    # gradual finished c0..c4, so it covers c1..c3 and is repeated; epic (c0 only) stays out
    assert cases == {"c1", "c2", "c3"} and methods[-1] == "paper@0.05" and "gradual@0.05" in methods
    assert "epic@0.05" not in methods and left_out(recs, "musique") == ["epic@0.05"]
    rows = [r for r in summarize_fidelity(recs) if r.group == 1]
    assert [r.method for r in rows][:2] == ["full", "reuse"] and {r.n for r in rows} == {3}
    reuse = rows[1]
    assert reuse.kl_mean == pytest.approx(0.52)  # the mean over c1..c3 only, not over the first table's cases
    text = fidelity_markdown(summarize_fidelity(recs), recs)
    assert "#### musique: rules run on fewer cases (3 cases)" in text and "| paper@0.05 | 0.1500" in text


def test_report_writes_summary_targets_and_a_figure_per_data_set(tmp_path):
    recs = synthetic_records() + [_rec(m, "s0", 0.1, 0.9, "samsum") for m in ("full", "reuse", "paper@0.15")]
    files = write_fidelity_report(tmp_path, recs)
    text = files["summary"].read_text()
    assert "### musique (5 cases)" in text and "Left out (measured on fewer than 2 common cases): epic@0.05." in text
    assert f"| musique | {DEFAULT}@0.05 | paper@0.15 | 8 |" in text and "A at least as faithful" in text
    assert "| musique | reuse | paper@0.15 | 8 |" in text and "intervals apart" in text
    assert files["musique"].stat().st_size > 1000 and files["samsum"].stat().st_size > 1000
    assert json.loads(files["json"].read_text())[0]["dataset"] == "musique"


def test_a_ratio_sweep_on_fewer_cases_gets_a_figure_of_its_own(tmp_path):
    recs = synthetic_records()
    assert sweep_group(summarize_fidelity(recs), "musique") is None  # no table sweeps more ratios
    ratios = (0.02, 0.10, 0.30)
    recs += [_rec(f"paper@{r:.2f}", f"c{i}", 0.1, 0.8) for r in ratios for i in (0, 1, 2)]
    recs += [_rec(f"{DEFAULT}@{r:.2f}", f"c{i}", 0.1, 0.8) for r in ratios for i in (0, 1, 2)]
    rows = summarize_fidelity(recs)
    group = sweep_group(rows, "musique")
    assert group is not None and group > 0
    swept = {r.method for r in rows if r.group == group}
    # the sweep's table has every ratio of the default rule, the better-covered 0.05 and 0.15 included
    assert {f"{DEFAULT}@{r:.2f}" for r in (0.02, 0.05, 0.10, 0.15, 0.30)} <= swept
    files = write_fidelity_report(tmp_path, recs)
    sweep_png = files["musique_ratios"]
    assert sweep_png.name == "fidelity_musique_ratios.png" and sweep_png.stat().st_size > 1000
    # a table of fewer cases with two ratios per rule is not a sweep
    narrow = [r for r in rows if r.group == 0 or r.ratio is None or r.ratio <= 0.05]
    assert sweep_group(narrow, "musique") is None


# -- the command line ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, match",
    [
        (["--ratios", "0,0.5"], r"--ratios must be comma-separated numbers in \(0, 1\]"),
        (["--ratios", "a"], "--ratios must be"),
        (["--rules", "nope"], "unknown blend rule 'nope'"),
        (["--limit", "0"], "--limit must be >= 1"),
    ],
)
def test_bench_fidelity_checks_its_arguments_before_loading_a_model(tmp_path, capsys, args, match):
    import re

    assert main(["--out", str(tmp_path), *args]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_bench_fidelity_report_only_rebuilds_from_the_records(tmp_path, capsys):
    (tmp_path / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in synthetic_records()))
    (tmp_path / "run.json").write_text(json.dumps({"model": "tiny-qwen2"}))
    assert main(["--report-only", "--out", str(tmp_path)]) == 0
    assert "| reuse |" in capsys.readouterr().out and (tmp_path / "fidelity_musique.png").exists()


def test_reuse_verdict_tells_a_paired_difference_from_an_overlap(tmp_path):
    # Blend's KL varies a lot between cases, reuse is always a bit worse on the same case: the unpaired
    # intervals overlap, the paired difference does not reach 0.
    recs = []
    for i in range(8):
        kl = 0.1 * (i + 1)
        recs += [_rec("full", f"c{i}", 0.0, 1.0), _rec("paper@0.15", f"c{i}", kl, 0.9)]
        recs += [_rec("reuse", f"c{i}", kl + 0.05, 0.8), _rec(f"{DEFAULT}@0.15", f"c{i}", kl, 0.9)]
        recs += [_rec(f"{DEFAULT}@0.05", f"c{i}", kl, 0.9)]
    text = write_fidelity_report(tmp_path, recs)["summary"].read_text()
    assert "| musique | reuse | paper@0.15 | 8 | +0.0500 [+0.0500, +0.0500]" in text
    assert "intervals overlap; paired KL difference above 0" in text and "intervals apart" not in text
