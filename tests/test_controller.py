"""The loading controller: its profile arithmetic, the ratio it picks, the tier it recommends, and its use by the
engine (a pinned ratio always wins)."""

from __future__ import annotations

import json

import pytest

from cacheblend_rag import CacheBlendEngine, EngineConfig, StoreConfig
from cacheblend_rag.controller import ComputePoint, LoadingController, LoadingProfile, TierSpeed, profile_engine
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

MB = 2**20


def make_profile(model: str = "m", **tiers: TierSpeed) -> LoadingProfile:
    # 1000 tokens: 1 s at r = 0, +4 s per unit of r; 2000 tokens: 2 s and +10 s.
    return LoadingProfile(
        model=model,
        dtype="float32",
        device="cpu",
        compute=(ComputePoint(2000, 2.0, 10.0), ComputePoint(1000, 1.0, 4.0)),
        tiers=tiers or {"memory": TierSpeed(10_000 * MB), "disk": TierSpeed(100 * MB, 0.01)},
    )


def test_recompute_time_interpolates_between_profiled_lengths_and_scales_outside():
    p = make_profile()
    assert p.recompute_time(1000, 0.5) == pytest.approx(3.0)
    assert p.recompute_time(1500, 0.0) == pytest.approx(1.5)
    assert p.recompute_time(1500, 1.0) == pytest.approx(1.5 + 7.0)
    assert p.recompute_time(4000, 0.1) == pytest.approx(2 * (2.0 + 1.0))  # twice the longest profiled prompt
    assert p.recompute_time(500, 0.0) == pytest.approx(0.5)


def test_ratio_for_inverts_recompute_time_and_clips():
    p = make_profile()
    assert p.ratio_for(1000, 3.0) == pytest.approx(0.5)
    assert p.ratio_for(1000, 0.5) == 0.0
    assert p.ratio_for(1000, 60.0) == 1.0


def test_controller_keeps_the_quality_floor_when_loading_is_fast():
    c = LoadingController(make_profile(), min_ratio=0.15)
    d = c.choose_ratio(1000, {"memory": 50 * MB})
    assert d.ratio == 0.15 and d.source == "controller (quality floor)"
    assert d.recompute_s == pytest.approx(1.6) and d.load_s < 0.01


def test_controller_recomputes_more_while_a_slow_tier_loads():
    c = LoadingController(make_profile(), min_ratio=0.15)
    d = c.choose_ratio(1000, {"disk": 200 * MB}, {"disk": 5})  # 2 s + 5 x 10 ms of loading
    assert d.source == "controller (load time)"
    assert d.load_s == pytest.approx(2.05)
    assert d.ratio == pytest.approx((2.05 - 1.0) / 4.0)
    assert d.recompute_s == pytest.approx(d.load_s)  # recompute exactly hides the load
    assert c.choose_ratio(1000, {"disk": 10_000 * MB}).ratio == 1.0


def test_a_pinned_ratio_is_kept_whatever_the_load():
    c = LoadingController(make_profile(), pinned_ratio=0.3)
    d = c.choose_ratio(1000, {"disk": 1000 * MB})
    assert d.ratio == 0.3 and d.source == "pinned"


def test_cheapest_tier_that_adds_no_delay():
    c = LoadingController(make_profile(), min_ratio=0.15)  # budget at 1000 tokens, r=0.15: 1.6 s
    assert c.cheapest_tier(1000, 100 * MB, 6) == "disk"  # 1.06 s fits
    assert c.cheapest_tier(1000, 300 * MB, 6) == "memory"  # disk would take 3.06 s
    assert c.cheapest_tier(1000, 300 * MB, 6, ratio=0.6) == "disk"  # more recompute hides more load
    slow = LoadingController(make_profile(disk=TierSpeed(1 * MB)))
    assert slow.cheapest_tier(1000, 300 * MB) is None


def test_profile_saves_and_loads_and_bad_files_get_clear_errors(tmp_path):
    p = make_profile()
    path = tmp_path / "profile.json"
    p.save(path)
    assert LoadingProfile.load(path) == p
    with pytest.raises(ConfigError, match="cacheblend-rag profile --out"):
        LoadingProfile.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        LoadingProfile.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ConfigError, match="not a cacheblend-rag/loading-profile"):
        LoadingProfile.load(tmp_path / "other.json")
    with pytest.raises(ConfigError, match="no read speed for tier 'redis'"):
        p.load_time("redis", 10)
    with pytest.raises(ConfigError, match="min_ratio must be in"):
        LoadingController(p, min_ratio=1.5)


# ---------------------------------------------------------------- with the engine

CHUNKS = [random_words(501, 40), random_words(502, 40)]


def ask(engine, **kw):
    return engine.generate(CHUNKS, prefix=random_words(1, 4), suffix=random_words(2, 5), max_new_tokens=4, **kw)


def test_engine_uses_the_controllers_ratio_unless_one_is_pinned(tmp_path):
    # A disk so slow (per the profile) that the controller recomputes everything it can while loading.
    config = EngineConfig(
        miss_policy="blend", chunk_separator="", store=StoreConfig(memory_budget_bytes=0, disk_dir=str(tmp_path))
    )
    model = make_tiny_model("llama")
    with pytest.raises(ConfigError, match="measured for model m in float32"):
        CacheBlendEngine(model, make_tiny_tokenizer(), config=config, controller=LoadingController(make_profile()))
    profile = make_profile(CacheBlendEngine(model, make_tiny_tokenizer()).fingerprint, disk=TierSpeed(1e3))
    engine = CacheBlendEngine(model, make_tiny_tokenizer(), config=config, controller=LoadingController(profile))
    ask(engine)
    engine.store.flush()
    auto = ask(engine)
    assert auto.metrics.hits_by_tier == {"disk": 2}
    assert auto.metrics.recompute_ratio == 1.0 and auto.metrics.controller["source"] == "controller (load time)"
    assert "(controller (load time))" in auto.metrics.summary()
    full = engine.generate(CHUNKS, prefix=random_words(1, 4), suffix=random_words(2, 5), max_new_tokens=4, mode="full")
    assert auto.token_ids == full.token_ids  # r = 1 is a full prefill
    pinned = ask(engine, recompute_ratio=0.15)
    assert pinned.metrics.recompute_ratio == 0.15 and pinned.metrics.controller is None


def test_profile_engine_measures_compute_and_tiers_on_a_tiny_model():
    engine = CacheBlendEngine(make_tiny_model("qwen2"), make_tiny_tokenizer(), config=EngineConfig(miss_policy="blend"))
    profile = profile_engine(
        engine, token_counts=(64, 128), ratios=(0.0, 1.0), chunk_tokens=32, repeats=1, show_progress=False
    )
    assert [p.num_tokens for p in profile.compute] == sorted(p.num_tokens for p in profile.compute)
    assert all(p.slope_s >= 0 and p.intercept_s >= 0 for p in profile.compute)
    assert set(profile.tiers) == {"memory", "disk"} and all(t.bytes_per_s > 0 for t in profile.tiers.values())
    assert profile.model == engine.fingerprint and profile.dtype == "float32"
    with pytest.raises(ConfigError, match="at least two distinct values"):
        profile_engine(engine, token_counts=(64,), ratios=(0.15,), chunk_tokens=32)


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d["compute"][0].update(slope_s=float("nan")),
        lambda d: d["compute"][0].update(intercept_s=float("inf")),
        lambda d: d["compute"][1].update(num_tokens=1e400),
        lambda d: d["compute"][1].update(num_tokens=2.5),
        lambda d: d["tiers"]["disk"].update(bytes_per_s=float("nan")),
        lambda d: d["tiers"]["disk"].update(latency_s=float("nan")),
    ],
)
def test_a_loading_profile_with_a_non_finite_or_absurd_number_is_refused_naming_the_file(damage, tmp_path):
    path = tmp_path / "loading.json"
    make_profile().save(path)
    data = json.loads(path.read_text())
    damage(data)
    path.write_text(json.dumps(data))  # json writes NaN / Infinity, as a hand-edited file could hold them
    with pytest.raises(ConfigError, match="invalid") as err:
        LoadingProfile.load(path)
    assert str(path) in str(err.value)
