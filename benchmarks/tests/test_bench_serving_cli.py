"""The serving benchmarks' command lines: `benchmarks/load.py` (its arguments, intervals, cold requests and a whole
run on a tiny model) and `benchmarks/gpu_check.py` (a whole run on a CPU, the floor it counts, a batched step's ops)."""

from __future__ import annotations

import json

import load
import pytest
from bench_helpers import TINY_SHAPE
from benchlib import load_report, timing


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--arrivals", "poisson", "--rates", "0,1"], "--rates must be comma-separated rates > 0"),
        (["--cold-share", "1.5"], "--cold-share must be comma-separated shares in [0, 1]"),
        (["--concurrency", "two"], "--concurrency must be comma-separated client counts"),
        (["--settings", "blend-turbo"], "unknown settings ['blend-turbo']"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--token-gaps", "none,-1"], "--token-gaps must be comma-separated 'none' or seconds >= 0"),
        (["--token-gaps", ","], "--token-gaps must name at least one gap"),
    ],
)
def test_load_checks_its_arguments_before_loading_a_model(args, message, no_model_loads, capsys):
    with pytest.raises(SystemExit) as exit_:
        load.main(["--model", "smollm2-135m-instruct", *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_load_interval_is_students_t_over_the_repeats():
    lo, hi = load_report.t_interval([1.0, 2.0, 3.0])  # mean 2, sd 1, t(0.975, 2) = 4.303
    assert (lo, hi) == pytest.approx((2 - 4.303 / 3**0.5, 2 + 4.303 / 3**0.5))
    assert load_report.t_interval([5.0]) is None  # one repeat: no interval
    assert load_report.t_quantile_975(1) == 12.706 and load_report.t_quantile_975(60) == pytest.approx(2.000, abs=1e-3)


def test_load_cold_requests_get_chunks_no_other_request_has():
    pool = [f"passage {i}" for i in range(6)]
    fresh = iter(range(100))
    first = load.plan_requests(pool, 8, 3, 0.25, seed=0, fresh=fresh)
    again = load.plan_requests(pool, 8, 3, 0.25, seed=0, fresh=fresh)
    assert [r.cold for r in first] == [r.cold for r in again] and sum(r.cold for r in first) == 2  # same ones
    cold = [c for r in first + again if r.cold for c in r.chunks]
    assert len(set(cold)) == len(cold) == 12 and not set(cold) & set(pool)
    assert all(set(r.chunks) <= set(pool) for r in first if not r.cold)


@pytest.mark.parametrize("arrivals", ["closed", "poisson"])
def test_load_end_to_end_with_repeats_cold_requests_and_the_serial_check(arrivals, tmp_path, monkeypatch, capsys):
    """benchmarks/load.py on a tiny random-weight model: both arrival processes, a mixed warm/cold stream, 95%
    intervals over 2 repeats, and batched greedy answers equal to the same requests served alone. No timing is
    compared. The Poisson rates are high enough (1-2 arrivals a millisecond) that the 4 requests arrive inside the
    first one's prefill, so that some decode step surely runs between a prefill's layers at gap 0."""
    monkeypatch.setitem(timing.RANDOM_SHAPES, "tiny", TINY_SHAPE)
    load_args = ["--concurrency", "1,4"] if arrivals == "closed" else ["--rates", "60000,120000", "--requests", "4"]
    argv = ["--random-weights", "--model-shape", "tiny", "--chunks", "2", "--chunk-tokens", "8", "--pool", "4",
            "--new-tokens", "3", "--arrivals", arrivals, *load_args, "--repeats", "2", "--cold-share", "0,0.5",
            "--settings", "blend-serial,blend-batched", "--token-gaps", "none,0", "--check-serial",
            "--out", str(tmp_path)]  # fmt: skip
    assert load.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    key = "clients" if arrivals == "closed" else "rate_per_min"
    loads = [1, 4] if arrivals == "closed" else [60000.0, 120000.0]
    settings = [("blend-serial", None), ("blend-batched", None), ("blend-batched", 0.0)]  # serial: no gap rows
    assert [(r["setting"], r["token_gap"], r["cold_share"], r[key]) for r in results["rows"]] == [
        (s, gap, share, x) for s, gap in settings for share in (0.0, 0.5) for x in loads
    ]
    for row in results["rows"]:
        assert len(row["runs"]) == 2
        s = row["summary"]["tokens_per_s"]
        assert s["ci95"][0] <= s["mean"] <= s["ci95"][1]
        for run in row["runs"]:
            assert run["cold_requests"] == round(row["cold_share"] * run["requests"])
            warm = 1 - run["cold_requests"] / run["requests"]
            assert run["hit_share"] == pytest.approx(warm), "warm requests find every chunk, cold ones none"
        if row["setting"] == "blend-batched":
            assert row["serial_check"] == {"differing": 0, "checked": row["runs"][0]["requests"]}
        else:
            assert "serial_check" not in row  # served one at a time already
    hosted = {gap: sum(run["hosted_steps"] for r in results["rows"] if r["token_gap"] == gap for run in r["runs"])
              for gap in (None, 0.0)}  # fmt: skip
    assert hosted[None] == 0 and hosted[0.0] > 0, hosted  # gap 0: decode steps ran inside other requests' prefills
    summary = (tmp_path / "summary.md").read_text()
    assert "95% t interval over the repeats" in summary and "| blend-batched, 50% cold |" in summary
    busiest = "4 clients" if arrivals == "closed" else "120000 requests/min"
    assert f"- blend-batched, 50% cold, {busiest}: differing answers: 0 of 4" in summary
    assert f"- blend-batched, gap 0 s, 50% cold, {busiest}: differing answers: 0 of 4" in summary
    assert "| gap p99 (s) | longest gap (s) |" in summary
    assert "differing answers: 0 of 4" in capsys.readouterr().out
    assert (tmp_path / "load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpu_check_end_to_end_on_a_cpu(tmp_path, monkeypatch, capsys):
    """benchmarks/gpu_check.py (the script a lent GPU runs) on a tiny random-weight model on the CPU: every mode,
    the `paper` rule and a shallow first pass at every length, prefill alone and through `generate`, loading with
    and without the prefetch thread, the decode steps and the profile. No timing is compared."""
    import gpu_check

    monkeypatch.setitem(timing.RANDOM_SHAPES, "tiny", TINY_SHAPE)
    argv = ["--device", "cpu", "--dtype", "float32", "--model-shape", "tiny", "--chunks", "2", "--lengths", "8,16",
            "--ratios", "0.15", "--new-tokens", "3", "--batch", "3", "--repeats", "1", "--memory-gb", "0.1",
            "--profile", "--out", str(tmp_path), "--latest", str(tmp_path / "latest.json"),
            "--commit", "abc123"]  # fmt: skip
    assert gpu_check.main(argv) == 0
    printed = capsys.readouterr().out
    assert "-- profile blend" in printed and "-- cProfile full" in printed
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["device"] == "cpu" and report["shape"] == "tiny" and len(report["lengths"]) == 2
    for rows in report["lengths"].values():
        assert list(rows) == ["full", "reuse", "blend r=0.15", "paper r=0.15", "attention:0.25 r=0.15"]
        assert all(r["prefill_ms"] > 0 and r["generate_ttft_ms"] > 0 for r in rows.values())
    pipeline = report["pipeline"]  # a second engine on the same model, chunk KV loaded without the prefetch thread
    assert list(pipeline) == ["reuse, pipelined", "reuse, inline", "blend r=0.15, pipelined", "blend r=0.15, inline",
                              "full, no cuDNN attention"]  # fmt: skip
    assert all(row["prefill_ms"] > 0 for row in pipeline.values())
    assert pipeline["reuse, inline"]["generate_compute_ms"] > 0
    assert set(report["decode_step"]) == {"one_request_ms", "3_requests_ms", "slots_one_request_ms",
                                          "slots_3_requests_ms"}  # fmt: skip
    assert report["generate_decode_tok_per_s"] > 0
    for rows in report["lengths"].values():  # each mode beside its floor
        for r in rows.values():
            assert r["floor_ms"] > 0 and r["over_floor"] == pytest.approx(r["prefill_ms"] / r["floor_ms"], rel=0.02)
        assert rows["reuse"]["tflop"] < min(rows["blend r=0.15"]["tflop"], rows["full"]["tflop"])
        assert rows["attention:0.25 r=0.15"]["tflop"] < rows["blend r=0.15"]["tflop"]  # a shallower first pass
        assert rows["attention:0.25 r=0.15"]["min_gb"] < rows["blend r=0.15"]["min_gb"]
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["commit"] == "abc123" and set(latest["full_ms"]) == set(report["lengths"])
    assert set(latest["shallow_probe_ms"]) == set(report["lengths"])
    assert latest["decode_tps"] == {"1": report["generate_decode_tok_per_s"]}
    from benchlib.gpu_latest import main as add_load

    runs = [{"tokens_per_s": 100.0}, {"tokens_per_s": 120.0}]
    load = {"rows": [{"setting": "blend-batched", "clients": 8, "runs": runs},
                     {"setting": "full-batched", "clients": 8, "runs": [{"tokens_per_s": 90.0}]}]}  # fmt: skip
    (tmp_path / "results.json").write_text(json.dumps(load))
    assert add_load([str(tmp_path / "latest.json"), str(tmp_path / "results.json")]) == 0
    merged = json.loads((tmp_path / "latest.json").read_text())
    assert merged["decode_tps"]["8"] == 110.0 and merged["full_batched_tps"] == {"8": 90.0}


def test_the_floor_of_a_full_prefill_of_a_7b_shape_is_its_known_flop_count():
    # ~115 TFLOP for 7.7k tokens of a Llama-2-7B shape (6.5B weights at 2 FLOPs each per token, plus causal
    # attention); full KV reuse of the same prompt computes a 20-token question and reads its stored KV.
    from benchlib.floor import DeviceRates, Shape, prefill_bytes, prefill_flops

    shape = Shape(layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128, intermediate=11008, vocab=32000)
    full = prefill_flops(shape, 7708, 7708)
    assert 110e12 < full < 120e12
    reuse = prefill_flops(shape, 7708, 20)
    assert reuse < full / 100
    assert shape.kv_bytes(7708) == 2 * 32 * 32 * 128 * 7708 * 2  # ~4.0 GB
    rates = DeviceRates(flops_per_s=990e12, bytes_per_s=4.8e12)
    assert rates.floor_ms(full, prefill_bytes(shape, 7708, 0)) == pytest.approx(1000 * full / 990e12)  # compute-bound
    reuse_floor = rates.floor_ms(reuse, prefill_bytes(shape, 7708, 7688))
    assert 2.0 < reuse_floor < 6.0  # bandwidth-bound: the weights and the KV, about the 5 ms of the estimate


def test_a_batched_steps_ops_stay_flat_over_the_slot_pool_and_grow_per_request():
    from decode_batch import count_ops

    rows = {r["batch"]: r for r in count_ops([1, 8, 32])}
    assert rows[8]["slot pool"] == rows[32]["slot pool"] < rows[8]["per-request"] < rows[32]["per-request"]
