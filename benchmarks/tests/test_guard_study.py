"""The guard study's bookkeeping (benchmarks/benchlib/guard_study.py): fidelity records and probes become fidelity
profile questions, and a guard's replay pays the blend and then full recompute."""

from __future__ import annotations

import pytest
from benchlib.guard_study import load_cases, probe_consistency, profile, rows, signal_table


def rec(case, method, *, first=1.0, kl=0.1, top1=0.9, share=0.2, ttft=2.0, **extra):
    return {"dataset": "musique", "case_id": case, "method": method, "prompt_tokens": 100, "first_token": first,
            "kl_mean": kl, "top1": top1, "compute_share": share, "ttft_s": ttft, **extra}  # fmt: skip


def case_records(case, *, margin, flipped):
    return [
        rec(case, "full", kl=0.0, top1=1.0, share=1.0, ttft=10.0),
        rec(case, "reuse", first=0.0, kl=0.3, share=0.01, ttft=1.0),
        rec(case, "attention@0.05", kl=0.2, share=0.07, ttft=1.5),
        rec(case, "attention@0.15", first=0.0 if flipped else 1.0, kl=0.1, share=0.17, ttft=2.0),
    ], {"dataset": "musique", "case_id": case, "method": "attention@0.15", "prompt_tokens": 100,
        "first_token_id": 7, "reference_first_id": 8 if flipped else 7, "recorded_first_token": 0.0 if flipped else 1.0,
        "risk": {"margin": margin, "kl_reuse": 0.5, "agree_reuse": True, "stale_attention": 0.3}}  # fmt: skip


@pytest.fixture
def study():
    records, probes = [], []
    for i, (margin, flipped) in enumerate([(0.01, True), (0.5, False), (0.02, False), (0.6, False)]):
        r, p = case_records(f"musique-{i}", margin=margin, flipped=flipped)
        records += r
        probes.append(p)
    return records, probes


def test_probes_add_the_signals_and_are_checked_against_the_recorded_blend(study):
    records, probes = study
    cases = load_cases(records, probes, grid=(0.05, 0.15))["musique"]
    assert [c["attention@0.15"]["risk"]["margin"] for c in cases] == [0.01, 0.5, 0.02, 0.6]
    assert probe_consistency(probes) == (4, 4)
    probes[0] = {**probes[0], "reference_first_id": 7}  # the probe now agrees with full where the record did not
    assert probe_consistency(probes) == (3, 4)
    assert load_cases(records, [], grid=(0.05, 0.15)) == {}  # no signals, no case


def test_the_margin_guard_replays_blend_then_full_recompute(study):
    records, probes = study
    cases = load_cases(records, probes, grid=(0.05, 0.15))["musique"]
    table = {r.name: r for r in rows(profile(cases, (0.05, 0.15), (1.0,)))}
    fixed = table["r=0.15"]
    assert fixed.first_token[0] == 0.75 and fixed.compute_share == pytest.approx(0.17)
    (name,) = [n for n in table if n.startswith("guard KL to reuse > 0.2 ")]
    escalated = table[name]  # every case has KL to reuse 0.5: all escalate to full
    assert escalated.escalated == 1.0 and escalated.first_token[0] == 1.0 and escalated.kl[0] == 0.0
    assert escalated.compute_share == pytest.approx(0.17 + 1.0)  # the blend, then a full prefill over its first pass
    assert escalated.ttft_mean == pytest.approx(2.0 + 10.0) and escalated.speedup_mean == pytest.approx(10 / 12)
    assert table["full recompute"].speedup_mean == 1.0


def test_signal_table_ranks_the_flipped_case(study):
    records, probes = study
    cases = load_cases(records, probes, grid=(0.05, 0.15))["musique"]
    by_name = {name: (rho, flip, worse) for name, rho, flip, worse in signal_table(cases)}
    assert by_name["low_margin"][1] == 1.0  # the flipped case has the lowest margin
    assert "low_reuse_margin" not in by_name  # these records predate the reuse pass's margin

    for case in cases:  # records that carry it: the flipped case's reuse pass was the least sure
        case["attention@0.15"]["risk"]["reuse_margin"] = 0.05 if case["attention@0.15"]["first_token"] < 1 else 0.9
    by_name = {name: (rho, flip, worse) for name, rho, flip, worse in signal_table(cases)}
    assert by_name["low_reuse_margin"][1] == 1.0


def test_guard_signals_studies_a_run_that_measured_only_the_default_ratio(study, tmp_path):
    import json

    import guard_signals

    records, probes = study
    only_default = [r for r in records if r["method"] != "attention@0.05"]
    path = tmp_path / "fidelity.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in only_default))
    probe_path = tmp_path / "probe.jsonl"
    probe_path.write_text("".join(json.dumps(p) + "\n" for p in probes))
    argv = ["--records", str(path), "--probes", str(probe_path), "--out", str(tmp_path / "out")]
    assert guard_signals.main(argv) == 2  # the default grid needs r = 0.05 as well
    assert guard_signals.main([*argv, "--ratios", "0.15"]) == 0
    text = (tmp_path / "out" / "guard.md").read_text()
    assert "## musique (4 cases)" in text and "| r=0.05 |" not in text and "| r=0.15 |" in text
    with pytest.raises(SystemExit):
        guard_signals.main([*argv, "--ratios", "0.05"])  # the base blend's ratio must be there


def test_calibration_sizes_replay_the_choice_on_random_samples(study):
    from benchlib.calibration_size import calibration_sizes

    records, probes = study
    cases = load_cases(records, probes, grid=(0.05, 0.15))["musique"]
    prof = profile(cases, (0.05, 0.15), (1.0,))
    (row,) = calibration_sizes(prof, [0, 2, 4], draws=20, target_first_token=0.7)  # 0, 4: no side to choose on
    assert (row.n, row.held_back, row.draws) == (2, 2, 20)
    # r = 0.05 keeps every first token on every case: 2 of 2 count as 0.75, the cheapest choice for 0.7; it holds
    assert (row.top_choice, row.top_choice_share, row.met_held_back, row.first_token_mean) == ("r=0.05", 1.0, 1.0, 1.0)
    assert row.compute_share == pytest.approx((0.07, 0.07, 0.07))
    # for 0.95, two questions that agree are not enough: only full recompute is expected to hold
    (row,) = calibration_sizes(prof, [2], draws=20)
    assert (row.top_choice, row.met_on_sample) == ("full (r=1)", 1.0)
    # another chooser is replayed in its place: here one that asks for 0.7 whatever the target
    (row,) = calibration_sizes(prof, [2], draws=20, choose=lambda sample, _: sample.choose(target_first_token=0.7))
    assert row.top_choice == "r=0.05"
    flipped = [{**c, "attention@0.05": {**c["attention@0.05"], "first_token": 0.0}} if i == 0 else c
               for i, c in enumerate(cases)]  # fmt: skip
    (row,) = calibration_sizes(profile(flipped, (0.05, 0.15), (1.0,)), [2], draws=40, target_first_token=0.7)
    # the sample without case 0 still picks r = 0.05; held back, case 0 then misses: some draws fail
    assert 0.0 < row.met_held_back < 1.0 and row.first_token[1] == 0.5


def test_guard_signals_keeps_only_the_cases_measured_on_other_chunk_kv(study, tmp_path):
    import json

    import guard_signals

    records, probes = study
    paths = {name: tmp_path / f"{name}.jsonl" for name in ("fidelity", "probe", "captured")}
    paths["fidelity"].write_text("".join(json.dumps(r) + "\n" for r in records))
    paths["probe"].write_text("".join(json.dumps(p) + "\n" for p in probes))
    captured = [rec(c, "attention@0.15+capmix") for c in ("musique-1", "musique-3")] + [rec("musique-0", "full")]
    paths["captured"].write_text("".join(json.dumps(r) + "\n" for r in captured))
    argv = ["--records", str(paths["fidelity"]), "--probes", str(paths["probe"]), "--out", str(tmp_path / "out")]
    assert guard_signals.main([*argv, "--cases-of", str(paths["captured"])]) == 0
    assert "## musique (2 cases)" in (tmp_path / "out" / "guard.md").read_text()  # musique-0 has no variant record
    with pytest.raises(SystemExit):
        guard_signals.main([*argv, "--cases-of", str(tmp_path / "missing.jsonl")])
