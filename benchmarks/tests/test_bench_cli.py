"""The benchmark scripts' command lines: `benchmarks/quality.py`, `report.py` and `sweep.py`, and what they share
(`benchlib.cli`)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import load
import pytest
import quality as quality_script
import report as report_script
import sweep
from benchlib import cli, load_report, quality, timing
from benchlib.report import comparable_cases

from cacheblend_rag.testing import random_words

DATA_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"


def _record(dataset: str, method: str, case: str, score: float, ttft: float) -> dict:
    return {"dataset": dataset, "method": method, "case_id": case, "task": "qa", "metric": "F1", "score": score,
            "ttft_s": ttft, "error": None}  # fmt: skip


def test_report_rebuilds_table_and_figures_from_jsonl(tmp_path, capsys):
    rows = [
        _record("musique", m, f"c{i}", s + 0.01 * i, t)
        for i in range(3)
        for m, s, t in (("full", 0.5, 4.0), ("reuse", 0.2, 0.5), ("blend@0.15", 0.48, 1.0), ("blend@0.05", 0.4, 0.8))
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report_script.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| blend@0.15 | 0.490 | 1.00 | 3 | -0.020 | [-0.020, -0.020] | - | 4.00 | 3 | 0 |" in out
    assert (tmp_path / "summary.md").read_text().count("| reuse |") == 1
    assert (tmp_path / "quality_vs_ttft.png").stat().st_size > 1000
    assert (tmp_path / "quality_vs_ratio.png").stat().st_size > 1000

    # Without the second ratio the ratio figure has no curve to show: the report drops it, old file included.
    kept = [r for r in rows if r["method"] != "blend@0.05"]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert report_script.main(["--out", str(tmp_path)]) == 0
    assert not (tmp_path / "quality_vs_ratio.png").exists() and (tmp_path / "quality_vs_ttft.png").exists()


def test_report_on_an_empty_folder_is_a_clear_error(tmp_path, capsys):
    assert report_script.main(["--out", str(tmp_path)]) == 2
    assert "no results" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--methods", "full,stuff"], "unknown method 'stuff'"),
        (["--datasets", "squad"], "unknown data set 'squad'"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--data-dir", "/nonexistent/data"], "--data-dir '/nonexistent/data' is not a folder"),
    ],
)
def test_quality_checks_its_arguments_before_loading_a_model(args, message, tmp_path, capsys):
    assert quality_script.main(["--out", str(tmp_path), "--model", "no-such-model", *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.jsonl").exists()


@pytest.mark.real_model
@pytest.mark.skipif(not DATA_DIR.is_dir(), reason=f"benchmark data not present at {DATA_DIR.resolve()}")
def test_quality_end_to_end_on_the_small_model(tmp_path, capsys):
    argv = ["--datasets", "samsum", "--methods", "full,blend@0.15,reuse", "--limit", "1",
            "--samsum-shots", "3", "--model", "smollm2-135m-instruct", "--max-new-tokens", "8", "--out", str(tmp_path),
            "--data-dir", str(DATA_DIR)]  # fmt: skip
    assert quality_script.main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in records] == ["full", "blend@0.15", "reuse"]
    assert all(r["metric"] == "Rouge-L" and 0 <= r["score"] <= 1 and r["ttft_s"] > 0 for r in records)
    assert "### samsum (Rouge-L)" in capsys.readouterr().out
    assert quality_script.main(argv) == 0  # resumed: nothing left to run
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 3


def test_quality_figure_compares_only_methods_measured_on_the_same_cases(tmp_path):
    rows = [_record("musique", m, f"c{i}", 0.1 * i, 1.0) for i in range(6) for m in ("full", "reuse", "blend@0.15")]
    rows += [_record("musique", "prefix", "c0", 0.9, 4.0)]  # one case: its mean is not comparable
    rows += [_record("musique", "blend@0.05", f"c{i}", 0.2, 0.5) for i in range(2, 6)]  # 4 of 6 cases
    rows += [_record("musique", "blend@0.30", f"c{i}", 0.2, 0.5) for i in range(3)]  # half: left out too
    cases, kept, left = comparable_cases(rows)["musique"]
    assert left == ["prefix", "blend@0.30"] and cases == {"c2", "c3", "c4", "c5"} and "blend@0.05" in kept
    full = next(r for r in quality.summarize(rows) if r.method == "full")
    assert full.score_ci[0] < full.score < full.score_ci[1]  # the interval drawn as the error bar
    assert quality.plot_quality_vs_ttft(rows, tmp_path / "fig.png", model="tiny").stat().st_size > 1000


@pytest.mark.parametrize(
    "name, folder",
    [("quality", "quality"), ("report", "quality"), ("fidelity", "fidelity"), ("throughput", "throughput"),
     ("sweep", "sweep"), ("ttft", "ttft"), ("tiers", "tiers"), ("controller", "controller"), ("load", "load"),
     ("decode_batch", "decode-batch"), ("precompute_cost", "precompute-cost"), ("folder_warm", "folder-warm"),
     ("dtype_fidelity", "dtype-fidelity")],
)  # fmt: skip
def test_every_benchmark_writes_under_benchmarks_results_by_default(name, folder, capsys, monkeypatch):
    import importlib

    monkeypatch.setenv("COLUMNS", "400")  # --help on one line per option
    with pytest.raises(SystemExit):
        importlib.import_module(name).main(["--help"])
    root = Path(__file__).resolve().parents[1] / "results"
    assert f"(default: {root / folder})" in capsys.readouterr().out


def test_figures_name_the_real_model_not_an_alias(tmp_path, monkeypatch):
    # The default preset's old name is an alias: a figure must carry the model's own name.
    assert cli.model_name("qwen2.5-0.5b-instruct") == "qwen2.5-coder-0.5b-instruct"
    assert cli.model_name(None) == cli.model_name("qwen2.5-coder-0.5b-instruct")
    assert cli.model_name("/models/my-llama") == "/models/my-llama"
    args = SimpleNamespace(random_weights=False, model="qwen2.5-0.5b-instruct", model_shape="7b")
    assert timing.model_label(args) == "qwen2.5-coder-0.5b-instruct"

    rows = [_record("musique", m, f"c{i}", 0.5, 1.0) for i in range(2) for m in ("full", "reuse")]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run.json").write_text(json.dumps({"model": "qwen2.5-coder-0.5b-instruct"}))
    titles = []
    monkeypatch.setattr(quality, "plot_panels", lambda data, path, **kw: titles.append(kw["title"]) or path)
    quality.write_report(tmp_path)
    assert titles == ["Quality vs TTFT: qwen2.5-coder-0.5b-instruct"]


# Small enough to time in well under a second per point on CPU; a short context so that one point cannot fit.
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=5,  # the default blend checks layers 1..3
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=160,
)


def test_sweep_measures_every_mode_per_point_and_skips_overlong(tmp_path, monkeypatch, capsys):
    """benchmarks/sweep.py end to end on a tiny random-weight model: JSON layout, a TTFT per mode and point, the
    figure. No timing is compared: only that every point was measured with the chunks warm, and that a point beyond
    the model's context is skipped with a message rather than a traceback."""
    monkeypatch.setitem(timing.RANDOM_SHAPES, "tiny", TINY_SHAPE)
    argv = [
        "--random-weights", "--model-shape", "tiny",
        "--counts", "1,2", "--chunk-tokens", "16",
        "--lengths", "8,32,70", "--chunks", "2",  # 2 x 70 tokens + prefix and question > 160: skipped
        "--ratios", "0.15", "0.3", "--repeats", "1", "--out", str(tmp_path),
    ]  # fmt: skip
    assert sweep.main(argv) == 0
    printed = capsys.readouterr().out
    assert "skipped 2 chunks x 70 tokens" in printed and "exceeds the model's limit of 160" in printed

    report = json.loads((tmp_path / "sweep.json").read_text())
    assert report["model"] == "random-tiny"
    modes = ["full", "prefix", "reuse", "blend r=0.15", "blend r=0.30"]
    assert report["modes"] == modes and report["ratios"] == [0.15, 0.3]
    counts, lengths = report["sweeps"]["chunk_count"], report["sweeps"]["chunk_length"]
    assert counts["varies"] == "chunks" and counts["chunk_tokens"] == 16
    assert lengths["varies"] == "chunk_tokens" and lengths["chunks"] == 2
    assert [(p["chunks"], p["chunk_tokens"]) for p in counts["points"]] == [(1, 16), (2, 16)]
    assert [(p["chunks"], p["chunk_tokens"]) for p in lengths["points"]] == [(2, 8), (2, 32)]
    assert counts["skipped"] == [] and [(s["chunks"], s["chunk_tokens"]) for s in lengths["skipped"]] == [(2, 70)]
    for p in counts["points"] + lengths["points"]:
        assert p["prompt_tokens"] >= p["chunks"] * p["chunk_tokens"]
        assert list(p["ttft_s"]) == modes and all(t > 0 for t in p["ttft_s"].values())
        assert set(p["speedup"]) == {"blend r=0.15", "blend r=0.30"} and all(s > 0 for s in p["speedup"].values())
        assert p["chunks_missed"] == 0, "every timed cached run should find its chunks in the store"

    png = tmp_path / "sweep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_interleaved_tier_ttft_times_each_setup_from_its_own_tier(tiny_engine, tmp_path):
    """The tier benchmarks' timing loop (`tiers.py`, `codecs.py`): a median and the last metrics per setup, each
    request's chunks read from the tier the setup names; a setup whose chunks come from elsewhere is an error."""
    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.store import DiskStore, MemoryStore
    from cacheblend_rag.testing import random_words

    texts = [random_words(3, 20), random_words(4, 25)]
    tiny_engine.precompute(texts, random_words(5, 4))
    prompt = tiny_engine.build_prompt(texts, random_words(5, 4))
    engines = {}
    for name, tier in (("memory", MemoryStore(codec="int8")), ("disk", DiskStore(str(tmp_path / "disk")))):
        store = timing.fill_tier(tiny_engine, prompt, tier, name)
        engine = CacheBlendEngine(tiny_engine.model, tiny_engine.tokenizer, config=tiny_engine.config, store=store)
        engines[name] = engine, name
    med, last = timing.interleaved_tier_ttft(engines, prompt, 0.5, repeats=3)
    assert set(med) == set(last) == {"memory", "disk"} and all(t > 0 for t in med.values())
    assert last["disk"].hits_by_tier == {"disk": 2} and last["memory"].hits_by_tier == {"memory": 2}
    assert last["memory"].bytes_loaded > 0

    wrong = {"mislabelled": (engines["disk"][0], "memory")}
    with pytest.raises(AssertionError, match="mislabelled: expected 2 hits in memory"):
        timing.interleaved_tier_ttft(wrong, prompt, 0.5, repeats=1)


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


@pytest.mark.real_model
def test_precompute_cost_and_folder_warm_end_to_end_on_the_small_model(tmp_path, capsys):
    import folder_warm
    import precompute_cost

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"d{i}.txt").write_text(random_words(900 + i, 120))
    small = ["--docs", str(docs), "--model", "smollm2-135m-instruct", "--dtype", "float32"]
    assert precompute_cost.main([*small, "--chunk-tokens", "64", "--out", str(tmp_path / "pc")]) == 0
    report = json.loads((tmp_path / "pc" / "results.json").read_text())
    assert report["chunks"] > 3 and report["counts"]["grouped"]["computed"] == report["chunks"] and report["ratio"] > 0
    assert folder_warm.main([*small, "--question", "what?", "--top-k", "2", "--repeats", "1",
                             "--out", str(tmp_path / "fw")]) == 0  # fmt: skip
    assert "disk / memory" in capsys.readouterr().out


def test_dtype_fidelity_pairs_each_dtypes_blend_against_its_own_reference():
    import torch
    from benchlib.dtype_fidelity import COMPARISONS, case_record, dtype_markdown

    from cacheblend_rag import CacheBlendEngine, EngineConfig
    from cacheblend_rag.engine import PromptTemplate
    from cacheblend_rag.evaluation.datasets import Case, TaskSpec
    from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer

    def engine(dtype):
        config = EngineConfig(dtype=dtype, miss_policy="blend", chunk_separator="", chunk_context="isolated")
        return CacheBlendEngine(make_tiny_model("qwen2"), make_tiny_tokenizer(), config=config)

    fp32, bf16 = engine("float32"), engine("bfloat16")
    assert bf16.dtype == torch.bfloat16
    spec = TaskSpec("tiny", "qa", PromptTemplate(instruction=random_words(1, 3)), max_new_tokens=4)
    cases = [Case(f"c{i}", (random_words(10 + i, 20), random_words(20 + i, 20)), random_words(30 + i, 4), ("a",), "qa")
             for i in range(3)]  # fmt: skip
    records = [case_record(fp32, bf16, spec, case) for case in cases]
    for r in records:
        assert set(COMPARISONS) <= set(r) and r["bf16_full"]["kl_mean"] < 0.05  # bf16 full stays near fp32 full
    text = dtype_markdown(records, machine="tiny")
    assert "3 cases (tiny 3)" in text and "| kl_mean |" in text and "noise floor" in text
