"""The fidelity profile: measured on a sample, guard settings replayed exactly, a setting chosen for a target, kept
as JSON for one model, and refused whole when damaged. The commands that write and apply it: test_calibrate_cli.py."""

from __future__ import annotations

import json
import math

import pytest
from calibrate_helpers import LADDER, hand_profile

from cacheblend_rag import CacheBlendEngine, EngineConfig, Guard
from cacheblend_rag.controller import FidelityProfile, SampleQuestion, Setting, measure_fidelity
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words


def tiny_engine(guard=None, model=None, tokenizer=None):
    # isolated entries: on them this tiny model's three questions reach every end of the guard's ladder
    config = EngineConfig(chunk_separator="", guard=guard, miss_policy="blend", chunk_context="captured")
    return CacheBlendEngine(model or make_tiny_model("qwen2"), tokenizer or make_tiny_tokenizer(), config=config)


def sample(n=3):
    return [
        SampleQuestion(f"q{i}", tuple(random_words(100 * i + s, 24) for s in range(3)), random_words(i, 5), None, 4)
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def measured():
    """A tiny model, and its fidelity profile over three questions."""
    model, tokenizer = make_tiny_model("qwen2"), make_tiny_tokenizer()
    engine = tiny_engine(model=model, tokenizer=tokenizer)
    profile = measure_fidelity(engine, sample(), ratios=(0.15, 0.3), thresholds=(0.0, 0.1, math.inf), ladder=LADDER)
    return model, tokenizer, profile


def test_a_replayed_guard_is_what_the_engine_does_with_that_guard(measured):
    model, tokenizer, profile = measured
    # a threshold at each KL the guard compares (risky: above it; successive blends agree: at most it), 0 and inf
    kl_reuse = {q["risk"]["kl_reuse"] for q in profile.questions}
    thresholds = sorted({0.0, math.inf, *kl_reuse, *(s["kl_prev"] for q in profile.questions for s in q["steps"])})
    ends = set()
    margins = sorted({0.0, 1.0, *(min(q["risk"]["margin"] + 1e-6, 1.0) for q in profile.questions)})
    guards = [Guard(max_kl=t, min_margin=0.0, ratios=LADDER) for t in thresholds]
    guards += [Guard(min_margin=m, ratios=LADDER) for m in margins]
    for guard in guards:
        threshold = (guard.max_kl, guard.min_margin)
        engine = tiny_engine(guard, model, tokenizer)
        for item, question in zip(sample(), profile.questions, strict=True):
            engine.precompute(list(item.chunks), item.question)
            metrics = engine.prefill(engine.build_prompt(list(item.chunks), item.question), "blend").metrics
            replay = profile.outcome(Setting(profile.base_ratio, guard), question)
            assert replay["escalated"] == bool(metrics.escalations), (threshold, item.id)
            assert replay["ratio"] == (metrics.escalations[-1] if metrics.escalations else profile.base_ratio)
            assert replay["compute_share"] == pytest.approx(metrics.compute_share, rel=1e-6)
            ends.add(replay["ratio"])
    assert ends == {profile.base_ratio, *LADDER}  # not escalated, stopped on the ladder, and at its end


def test_guard_at_threshold_inf_never_escalates_zero_escalates_all_and_a_margin_takes_the_near_ties(measured):
    _, _, profile = measured
    base = Setting(profile.base_ratio)
    for question in profile.questions:
        at_inf = profile.outcome(Setting(profile.base_ratio, Guard(max_kl=math.inf, min_margin=0, ratios=LADDER)),
                                 question)  # fmt: skip
        assert at_inf == {**profile.outcome(base, question), "escalated": False}
        at_zero = profile.outcome(Setting(profile.base_ratio, Guard(max_kl=0.0, ratios=LADDER)), question)
        assert at_zero["escalated"] and at_zero["ratio"] == 1.0  # successive blends never agree within 0 nats
        margin = question["risk"]["margin"]
        for m, risky in ((margin, False), (margin + 1e-6, True)):
            guard = Guard(min_margin=min(m, 1.0), ratios=LADDER)
            assert profile.outcome(Setting(profile.base_ratio, guard), question)["escalated"] == risky
    assert profile.estimate(Setting(profile.base_ratio, Guard(max_kl=0.0, ratios=LADDER))).escalated == 1.0


def test_the_profile_round_trips_through_json(measured, tmp_path):
    _, _, profile = measured
    path = tmp_path / "fidelity.json"
    profile.save(path)
    loaded = FidelityProfile.load(path)
    assert loaded == profile and math.inf in loaded.thresholds
    assert json.loads(path.read_text())["sample_size"] == 3
    assert [e.first_token for e in loaded.table()] == [e.first_token for e in profile.table()]


def test_a_profile_for_another_model_or_dtype_or_damaged_is_refused(measured, tmp_path):
    model, tokenizer, profile = measured
    engine = tiny_engine(model=model, tokenizer=tokenizer)
    profile.check_model(engine.fingerprint, "float32")
    with pytest.raises(ConfigError, match="run `cacheblend-rag calibrate` for this model and dtype"):
        profile.check_model(tiny_engine(model=make_tiny_model("qwen2", seed=1)).fingerprint, "float32")
    with pytest.raises(ConfigError, match="in float32, this engine runs .* in bfloat16"):
        profile.check_model(engine.fingerprint, "bfloat16")
    damaged = hand_profile().to_json()
    damaged["questions"][1]["fixed"].pop()
    (tmp_path / "damaged.json").write_text(json.dumps(damaged))
    with pytest.raises(ConfigError, match="question 'q1' of the fidelity profile lacks records of"):
        FidelityProfile.load(tmp_path / "damaged.json")
    (tmp_path / "bad.json").write_text('{"format": "cacheblend-rag/loading-profile/1"}')
    with pytest.raises(ConfigError, match="is not a cacheblend-rag/fidelity-profile/1 file"):
        FidelityProfile.load(tmp_path / "bad.json")


def test_choose_picks_the_cheapest_setting_expected_to_meet_the_target():
    profile = hand_profile()  # 4 questions: k of 4 counts as (k + 1) / 6
    choice = profile.choose(target_first_token=0.6)
    assert choice.met and choice.estimate.setting == Setting(0.5) and choice.guard is None  # 3 of 4: 0.67
    choice = profile.choose(target_first_token=0.8)
    assert choice.met and choice.guard == Guard(max_kl=0.1, min_margin=0.0, ratios=LADDER)  # 4 of 4: 0.83
    escalated_to_full = 0.1 + (0.4 - 0.02) + (1.0 - 0.02)  # the first pass (reuse's compute) is paid once
    assert choice.estimate.compute_share == pytest.approx((2 * escalated_to_full + 0.1 + 0.38 + 0.1) / 4)
    assert choice.estimate.escalated == 0.75
    assert choice.blend.recompute_ratio == 0.15 and choice.min_ratio == 0.15
    config = choice.engine_config(EngineConfig())
    assert config.guard == choice.guard and config.blend.recompute_ratio == 0.15
    assert profile.choose(target_first_token=0.5).estimate.setting == Setting(0.15)  # 2 of 4: 0.5
    assert profile.choose(target_first_token=0.5, max_kl=0.0).estimate.setting == Setting(1.0)  # only KL 0 passes


def test_only_full_recompute_promises_every_first_token():
    profile = hand_profile()
    assert profile.estimate(Setting(0.15, Guard(max_kl=0.1, min_margin=0.0, ratios=LADDER))).first_token == 1.0
    choice = profile.choose(target_first_token=1.0)  # the guard agreed on all 4, which says 0.83 of the next
    assert choice.met and choice.estimate.setting == Setting(1.0) and choice.estimate.exact


def test_a_perfect_sample_counts_for_more_the_more_questions_it_has():
    def agreeing(n):
        return hand_profile([dict(q, id=f"q{i}") for i, q in enumerate(hand_profile().questions[2:3] * n)])

    for n, meets in ((6, False), (17, False), (18, True), (30, True)):  # (n + 1) / (n + 2) >= 0.95 from n = 18
        choice = agreeing(n).choose(target_first_token=0.95)
        assert (choice.estimate.setting != Setting(1.0)) == meets, n
        assert choice.estimate.first_token == 1.0 and choice.met
    assert "(0.875 expected on a new question)" in agreeing(6).choose(target_first_token=0.8).describe()


def test_choose_says_not_met_and_gives_the_closest_when_no_setting_meets_the_target():
    worse = [dict(q, fixed=[dict(r, top1=min(r["top1"], 0.9)) for r in q["fixed"]]) for q in hand_profile().questions]
    choice = hand_profile(worse).choose(target_first_token=None, target_top1=0.95)
    assert not choice.met and "does NOT meet" in choice.describe()
    # every setting measured 0.9; full recompute's 0.9 is what it gives everywhere, the others' counts as 0.77
    assert choice.estimate.top1 == pytest.approx(0.9) and choice.estimate.setting == Setting(1.0)
    with pytest.raises(ConfigError, match="target top1 must be a share in"):
        hand_profile().choose(target_top1=1.5)


def test_the_held_back_check_chooses_on_the_first_questions_and_measures_on_the_rest():
    check = hand_profile().held_back_check(calibrate_share=0.5, target_first_token=0.7)
    # q0, q1 are both wrong at r=0.15, and q0 at r=0.5: the guard escalates both, which costs more than full
    assert check.choice.estimate.n == 2 and check.held_back.n == 2 and check.choice.estimate.exact
    assert check.held_back.setting == check.choice.estimate.setting and check.met
    late = hand_profile(hand_profile().questions[2:] + hand_profile().questions[:2]).held_back_check(
        calibrate_share=0.5, target_first_token=0.7
    )  # chosen on q2, q3 (right everywhere): r=0.15 (3/4 expected), which misses on q0, q1
    assert late.choice.estimate.setting == Setting(0.15) and late.choice.met
    assert late.held_back.first_token == 0.0 and not late.met and "does NOT meet" in late.describe()
    with pytest.raises(ConfigError, match="held-back check needs questions on both sides"):
        hand_profile().subset(0, 1).held_back_check()


@pytest.mark.parametrize(
    "damage, field",
    [
        (lambda q: q["fixed"][0].update(first_token=float("nan")), "fixed[0].first_token must be a finite number"),
        (lambda q: q["fixed"][1].update(first_token=2.0), "fixed[1].first_token must be in [0, 1]"),
        (lambda q: q["reuse"].update(kl_mean="abc"), "reuse.kl_mean must be a finite number"),
        (lambda q: q["fixed"][2].pop("compute_share"), "fixed[2].compute_share must be a finite number"),
        (lambda q: q.update(risk={}), "risk.margin must be a finite number"),
        (lambda q: q.update(steps="xx"), "steps must be a list"),
        (lambda q: q["steps"][0].update(agree_prev="yes"), "steps[0].agree_prev must be true or false"),
    ],
)
def test_a_profile_with_a_bad_record_is_refused_whole_naming_file_question_and_field(damage, field, tmp_path):
    path = tmp_path / "fidelity.json"
    hand_profile().save(path)
    data = json.loads(path.read_text())
    damage(data["questions"][2])
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        FidelityProfile.load(path)
    message = str(err.value)
    assert str(path) in message and "question 2 ('q2')" in message and field in message
    assert "nan" not in message.split(field)[0].lower()  # the refusal, never a "nan" figure taken as a result


def test_a_profile_of_more_questions_than_any_calibration_measures_is_refused_before_choosing(tmp_path):
    from cacheblend_rag.controller.fidelity_profile import MAX_PROFILE_QUESTIONS

    path = tmp_path / "fidelity.json"
    hand_profile().save(path)
    data = json.loads(path.read_text())
    data["questions"] = data["questions"] * (MAX_PROFILE_QUESTIONS // 4 + 1)
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=f"above {MAX_PROFILE_QUESTIONS}.*--limit"):
        FidelityProfile.load(path)


def test_a_profile_measured_with_captured_entries_equals_one_measured_on_isolated_entries():
    # The reference answer is a full prefill asked for, which stores only the entries it computes exactly: measuring
    # on an engine whose full prefills keep every chunk's KV ("captured") reads the isolated entries, as on an
    # "isolated" engine. (Were the reference's in-context KV stored, every later method of the same prompt would
    # read it and look exact.) Neither precomputes in groups, so that both build isolated entries.
    model, tokenizer = make_tiny_model("qwen2"), make_tiny_tokenizer()
    profiles = []
    for chunk_context in ("captured", "isolated"):  # full prefills keep every chunk's KV, or only exact entries
        config = EngineConfig(chunk_separator="", miss_policy="blend", chunk_context=chunk_context)
        engine = CacheBlendEngine(model, tokenizer, config=config)
        profiles.append(measure_fidelity(engine, sample(2), ratios=(0.15,), thresholds=(0.1,), ladder=LADDER))
    for a, b in zip(profiles[0].questions, profiles[1].questions, strict=True):
        assert a["reuse"]["kl_mean"] > 1e-4  # reuse of isolated entries is not exact
        for field in ("reuse", "fixed", "risk", "steps"):
            got, want = flat(a[field]), flat(b[field])
            assert [k for k, _ in got] == [k for k, _ in want], field
            assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-6), field


def flat(value, path=""):
    """[(path, number)] of every number in a record (bools as 0/1), in a fixed order."""
    if isinstance(value, dict):
        return [item for key in sorted(value) for item in flat(value[key], f"{path}.{key}")]
    if isinstance(value, (list, tuple)):
        return [item for i, v in enumerate(value) for item in flat(v, f"{path}[{i}]")]
    return [(path, float(value))] if isinstance(value, (int, float)) else []
