"""The `calibrate` command that measures and writes a fidelity profile, and `ask --fidelity-profile` that applies it
(with the loading profile as its floor, and the guard's escalation said); a killed calibration resumes from its
journal. The profile itself is tested in test_calibrate.py."""

from __future__ import annotations

import pytest
from calibrate_helpers import LADDER, hand_profile

from cacheblend_rag import CacheBlendEngine, Guard
from cacheblend_rag.controller import FidelityProfile
from cacheblend_rag.testing import random_words


def docs_and_questions(tmp_path):
    """A folder of four short documents and, beside it, questions.txt: three questions (and a blank line)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"d{i}.txt").write_text(random_words(10 + i, 40))
    (tmp_path / "questions.txt").write_text("\n".join(random_words(20 + i, 5) for i in range(3)) + "\n\n")
    return docs


@pytest.fixture
def engines_built(monkeypatch):
    """The keyword arguments (config, controller) of every engine the command line builds."""
    built = []
    original = CacheBlendEngine.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        built.append(kwargs)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(CacheBlendEngine, "from_pretrained", classmethod(spy))
    return built


def test_calibrate_writes_a_profile_that_ask_applies_with_the_loading_profile_as_floor(
    tmp_path, capsys, tiny_model_dir, engines_built
):
    from cacheblend_rag.cli import main
    from cacheblend_rag.controller import ComputePoint, LoadingProfile, TierSpeed

    docs = docs_and_questions(tmp_path)
    out = tmp_path / "fidelity.json"
    model = ["--model", str(tiny_model_dir), "--chunk-tokens", "16", "--top-k", "2"]
    argv = ["calibrate", "--out", str(out), "--docs", str(docs), "--questions", str(tmp_path / "questions.txt")]
    assert main([*argv, *model, "--max-new-tokens", "3", "--thresholds", "0", "0.1", "inf"]) == 0
    printed = capsys.readouterr().out
    profile = FidelityProfile.load(out)
    assert len(profile.questions) == 3 and "over" in profile.source
    guards = ("guard never -> r=1 (from r=0.15)", "guard KL to reuse > 0.1 -> r=1", "guard margin < 0.05 -> r=1")
    for name in ("r=0.05", "full (r=1)", *guards, "chosen: ", "held back: ", "s per question"):
        assert name in printed
    choice = profile.choose(target_first_token=0.9)
    assert f"chosen: {choice.estimate.setting.name}" in printed

    # ask: the choice sets the engine's ratio and guard; with a loading profile it is the controller's floor
    loading = LoadingProfile(
        profile.model, "float32", "cpu", (ComputePoint(64, 0.01, 0.02),), {"memory": TierSpeed(1e9)}
    )
    loading.save(tmp_path / "loading.json")
    ask = ["ask", "--docs", str(docs), *model, "--max-new-tokens", "2", "--fidelity-profile", str(out)]
    ask += ["--target-first-token", "0.9", "--profile", str(tmp_path / "loading.json"), random_words(20, 5)]
    assert main(ask) == 0
    config, controller = engines_built[-1]["config"], engines_built[-1]["controller"]
    assert config.blend.recompute_ratio == choice.blend.recompute_ratio and config.guard == choice.guard
    assert controller.min_ratio == choice.min_ratio

    # a hand-made profile for this model whose cheapest setting expected to agree 0.8 of the time is a guard
    hand_profile(model=profile.model).save(tmp_path / "hand.json")
    ask[ask.index(str(out))] = str(tmp_path / "hand.json")
    ask[ask.index("0.9")] = "0.8"
    assert main(ask) == 0
    assert engines_built[-1]["config"].guard == Guard(max_kl=0.1, min_margin=0.0, ratios=LADDER)
    assert engines_built[-1]["controller"].min_ratio == 0.15


def test_ask_refuses_a_fidelity_profile_of_another_model_or_with_a_pinned_ratio(tmp_path, capsys, tiny_model_dir):
    from cacheblend_rag.cli import main

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(random_words(1, 30))
    hand_profile().save(tmp_path / "hand.json")
    ask = ["ask", "--docs", str(tmp_path / "docs"), "--model", str(tiny_model_dir), "--chunk-tokens", "16"]
    ask += ["--max-new-tokens", "1", "--fidelity-profile", str(tmp_path / "hand.json"), random_words(2, 3)]
    assert main(ask) == 2
    assert "run `cacheblend-rag calibrate` for this model and dtype" in capsys.readouterr().err
    assert main([*ask, "--ratio", "0.3"]) == 2
    assert "--ratio pins r and --fidelity-profile chooses it" in capsys.readouterr().err
    assert main([*ask, "--guard"]) == 2
    assert "--guard sets the guard and --fidelity-profile chooses it" in capsys.readouterr().err
    assert main([*ask, "--guard", "--guard-margin", "0.05"]) == 2
    assert "--guard sets the guard and --fidelity-profile chooses it" in capsys.readouterr().err


def test_ask_guard_escalates_a_near_tie_and_says_why(tmp_path, capsys, tiny_model_dir, engines_built):
    from cacheblend_rag.cli import main

    (tmp_path / "docs").mkdir()
    for i in range(3):
        (tmp_path / "docs" / f"d{i}.txt").write_text(random_words(40 + i, 30))
    ask = ["ask", "--docs", str(tmp_path / "docs"), "--model", str(tiny_model_dir), "--chunk-tokens", "16"]
    ask += ["--max-new-tokens", "1", "--miss-policy", "blend", random_words(3, 4)]
    assert main([*ask, "--guard", "--guard-margin", "1"]) == 0  # every first token is below a margin of 1
    assert engines_built[-1]["config"].guard == Guard(min_margin=1.0)
    assert "[guard: first-token margin" in capsys.readouterr().out
    assert main([*ask, "--guard"]) == 0
    assert engines_built[-1]["config"].guard == Guard(min_margin=0.1)
    assert main(ask) == 0 and engines_built[-1]["config"].guard is None
    assert main([*ask, "--guard", "--guard-margin", "1.5"]) == 2
    assert "--guard-margin must be a probability in [0, 1]" in capsys.readouterr().err


def test_calibrate_needs_one_source_of_questions(tmp_path, capsys):
    from cacheblend_rag.cli import main

    assert main(["calibrate", "--out", str(tmp_path / "f.json"), "--model", "smollm2-135m-instruct"]) == 2
    assert "give either --dataset NAME" in capsys.readouterr().err
    assert main(["calibrate", "--out", str(tmp_path / "f.json"), "--docs", str(tmp_path)]) == 2
    assert "--docs needs --questions FILE" in capsys.readouterr().err
    assert main(["calibrate", "--out", str(tmp_path / "f.json"), "--dataset", "musique", "--ratios", "0", "1"]) == 2
    assert "ratios must be one or more numbers in (0, 1]" in capsys.readouterr().err


def test_a_killed_calibration_resumes_from_its_journal_and_loses_at_most_the_question_in_flight(
    tmp_path, capsys, tiny_model_dir, monkeypatch
):
    import cacheblend_rag.controller.calibration as calibration
    from cacheblend_rag.cli import main

    docs = docs_and_questions(tmp_path)
    out = tmp_path / "fidelity.json"
    argv = ["calibrate", "--out", str(out), "--docs", str(docs), "--questions", str(tmp_path / "questions.txt")]
    argv += ["--model", str(tiny_model_dir), "--chunk-tokens", "16", "--top-k", "2", "--max-new-tokens", "3"]
    measured = []
    real = calibration.measure_question

    def killed_at_the_third(engine, sample, **kw):
        if len(measured) == 2:
            raise KeyboardInterrupt  # as a kill: the third question never finishes
        measured.append(sample.id)
        return real(engine, sample, **kw)

    monkeypatch.setattr(calibration, "measure_question", killed_at_the_third)
    assert main(argv) == 130 and not out.exists()
    journal = tmp_path / "fidelity.json.partial.jsonl"
    assert len(journal.read_text().splitlines()) == 3  # the header and two questions, synced as they finished
    with journal.open("a") as f:
        f.write('{"id": "q2", "fixed": [')  # a line cut by the kill: not taken
    measured.clear()
    monkeypatch.setattr(calibration, "measure_question", lambda engine, sample, **kw: (
        measured.append(sample.id), real(engine, sample, **kw))[1])  # fmt: skip
    assert main(argv) == 0
    assert measured == ["q2"] and "resuming: 2 questions" in capsys.readouterr().err
    assert len(FidelityProfile.load(out).questions) == 3 and not journal.exists()
