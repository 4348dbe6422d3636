"""The throughput benchmark (Fig. 14): queue math on hand-made costs, Poisson arrivals, the extended workload, the
live queue with a fake server, and a run end to end on a tiny random model (library and CLI).

Retrieval uses a bag-of-words stand-in for all-MiniLM-L6-v2, so nothing here loads a real model. No assert
depends on how fast the machine is.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from benchlib.queueing import Served, max_rate_within_slo, poisson_arrivals, queue_stats, replay_queue, run_live
from benchlib.throughput import run_throughput
from benchlib.throughput_report import ThroughputResult, write_throughput_report
from benchlib.throughput_settings import ThroughputSettings, parse_rates, parse_throughput_methods
from benchlib.workload import build_workload
from throughput import main

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.errors import ConfigError, PromptError
from cacheblend_rag.evaluation import Dataset, DatasetError, load_dataset
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

# Tiny models: one torch thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


class BagOfWordsEmbedder:
    """Words hashed into 64 dimensions: texts sharing words get close vectors. Stands in for MiniLM."""

    dim = 64

    def encode(self, sentences, **kwargs):
        out = np.zeros((len(sentences), self.dim), dtype=np.float32)
        for row, text in enumerate(sentences):
            for word in text.replace("?", " ").split():
                out[row, zlib.crc32(word.encode()) % self.dim] += 1.0
        return out + 1e-3  # never an all-zero row

    def get_sentence_embedding_dimension(self) -> int:
        return self.dim


def write_qa_data(root: Path, cases: int = 3, passages: int = 3) -> Path:
    """MuSiQue and 2WikiMQA files in their real layouts: `passages` passages of 12 words per case."""
    records = []
    for i in range(cases):
        ctxs = [{"title": "", "text": random_words(100 * i + j, 12)} for j in range(passages)]
        question = " ".join(ctxs[0]["text"].split()[:4])  # shares words with its own first passage
        records.append({"question": question, "answers": ["w5"], "ctxs": ctxs})
    (root / "musique").mkdir(parents=True, exist_ok=True)
    (root / "musique" / "musique_s.json").write_text(json.dumps(records))
    wiki = [{**r, "answers": [["w5", "w6"]], "question": r["question"] + " w7"} for r in records]
    (root / "wikimqa").mkdir(parents=True, exist_ok=True)
    (root / "wikimqa" / "wikimqa_s_clean.json").write_text(json.dumps(wiki))
    return root


def served(ttft: float, service: float, chunks: int = 2, hit: int = 0) -> Served:
    return Served(ttft_s=ttft, service_s=service, chunks=chunks, chunks_hit=hit)


# -- queue math ------------------------------------------------------------------------------------------------


def test_lindley_replay_matches_a_hand_computed_fifo_queue():
    arrivals = [0.0, 1.0, 2.0, 10.0]
    costs = [served(0.5, 3.0, hit=0), served(0.2, 1.0, hit=1), served(0.1, 0.5, hit=2), served(0.3, 2.0, hit=2)]
    timings = replay_queue(arrivals, costs)
    # r0 starts at once; r1 waits for r0 (finish 3); r2 waits for r1 (finish 4); r3 arrives to an idle server.
    assert [t.start_s for t in timings] == [0.0, 3.0, 4.0, 10.0]
    assert [t.finish_s for t in timings] == [3.0, 4.0, 4.5, 12.0]
    assert [t.ttft_s for t in timings] == pytest.approx([0.5, 2.2, 2.1, 0.3])

    stats = queue_stats(timings, costs, warmup=1)  # r0 only fills the store
    assert stats.n == 3
    assert stats.throughput_rps == pytest.approx(3 / (12.0 - 1.0))  # measured: first arrival 1, last finish 12
    assert stats.ttft_p50_s == pytest.approx(2.1)
    assert stats.ttft_mean_s == pytest.approx((2.2 + 2.1 + 0.3) / 3)
    assert stats.ttft_p99_s <= 2.2 and stats.ttft_p90_s >= stats.ttft_p50_s
    assert stats.hit_rate == pytest.approx(5 / 6)
    with pytest.raises(ConfigError, match="leaves none"):
        queue_stats(timings, costs, warmup=4)


def test_poisson_arrivals_are_seeded_and_average_one_over_the_rate():
    a = poisson_arrivals(20_000, rate=4.0, seed=3)
    assert a == poisson_arrivals(20_000, rate=4.0, seed=3)
    assert a != poisson_arrivals(20_000, rate=4.0, seed=4)
    assert a[0] == 0.0 and all(y > x for x, y in zip(a, a[1:], strict=False))
    gaps = np.diff(a)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    assert np.std(gaps) == pytest.approx(0.25, rel=0.1)  # exponential: std = mean
    # One draw for every rate, scaled: the same arrival pattern at each point of a curve.
    assert poisson_arrivals(50, 2.0, seed=3) == pytest.approx([t / 2 for t in poisson_arrivals(50, 1.0, seed=3)])
    with pytest.raises(ConfigError, match="rate must be > 0"):
        poisson_arrivals(5, 0.0)


def test_max_rate_within_slo_is_the_edge_where_p90_crosses_the_target():
    costs = [served(0.2 + 0.01 * (i % 7), 1.0 + 0.1 * (i % 5)) for i in range(200)]

    def p90(rate: float) -> float:
        timings = replay_queue(poisson_arrivals(len(costs), rate, seed=1), costs)[10:]
        return float(np.percentile([t.ttft_s for t in timings], 90))

    best = max_rate_within_slo(costs, 2.0, warmup=10, seed=1)
    assert best is not None and 0 < best < 1 / 1.0  # below the server's capacity
    assert p90(best) <= 2.0 < p90(best * 1.01)
    assert max_rate_within_slo(costs, 0.1, warmup=10) is None  # requests alone take longer than the target
    assert max_rate_within_slo(costs, 1e6, warmup=10) == float("inf")  # even all at once meets it


# -- workload --------------------------------------------------------------------------------------------------


def test_workload_repeats_questions_in_new_orders_and_shuffles_them(tmp_path):
    ds = load_dataset("musique", write_qa_data(tmp_path), limit=3)
    kw = dict(chunk_tokens=16, top_k=4, repeats=3, embedder=BagOfWordsEmbedder(), show_progress=False)
    w = build_workload(ds, make_tiny_tokenizer(), seed=0, **kw)
    assert len(w.chunks) == 9  # each 12-word passage is one chunk: two would exceed 16 tokens
    assert len(w.requests) == 9 and w.warmup == 9 // 6
    assert [r.index for r in w.requests] == list(range(9))
    by_case: dict[str, list] = {}
    for r in w.requests:
        by_case.setdefault(r.case_id, []).append(r)
    for reqs in by_case.values():
        assert [r.repeat for r in reqs] == [0, 1, 2]  # numbered in the order they are asked
        assert len({frozenset(r.chunks) for r in reqs}) == 1  # the same retrieved chunks every time ...
        assert len({r.chunks for r in reqs}) == 3  # ... in a different order each time
    # 3 questions x 4 chunks from a database of 9: questions share chunks
    users = [{r.case_id for r in w.requests if c in r.chunks} for c in range(len(w.chunks))]
    assert max(len(u) for u in users) >= 2
    sequence = [r.case_id for r in w.requests]
    assert sequence != sorted(sequence)  # repeats spread out, not asked back to back
    assert build_workload(ds, make_tiny_tokenizer(), seed=0, **kw).requests == w.requests
    assert build_workload(ds, make_tiny_tokenizer(), seed=1, **kw).requests != w.requests
    assert build_workload(ds, make_tiny_tokenizer(), warmup=4, **kw).warmup == 4


def test_bad_settings_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="rate must be > 0"):
        parse_rates("0.5,0")
    with pytest.raises(ConfigError, match="number of requests per second, got 'fast'"):
        parse_rates("fast")
    assert parse_rates("1, 0.5,1") == (0.5, 1.0)
    with pytest.raises(ConfigError, match="repeats must be an integer >= 1, got 0"):
        ThroughputSettings(repeats=0)
    with pytest.raises(ConfigError, match="mode must be one of replay, live"):
        ThroughputSettings(mode="batch")
    with pytest.raises(ConfigError, match="unknown method 'fastest'"):
        parse_throughput_methods("full,fastest")
    with pytest.raises(ConfigError, match="several requests per question"):
        parse_throughput_methods("blend,mapreduce")
    ds = load_dataset("musique", write_qa_data(tmp_path), limit=1)
    kw = dict(chunk_tokens=16, top_k=2, embedder=BagOfWordsEmbedder(), show_progress=False)
    with pytest.raises(ConfigError, match="leaves none of the 2 to measure"):
        build_workload(ds, make_tiny_tokenizer(), repeats=2, warmup=2, **kw)
    with pytest.raises(DatasetError, match="no cases"):
        build_workload(Dataset(ds.spec, ()), make_tiny_tokenizer(), **kw)


# -- live queue ------------------------------------------------------------------------------------------------


def test_live_queue_serves_everything_first_come_first_served():
    busy, overlaps, calls = threading.Lock(), [], []

    def serve(i: int) -> Served:
        if not busy.acquire(blocking=False):
            overlaps.append(i)
        calls.append(i)
        time.sleep(0.01)
        busy.release()
        return served(0.004, 0.01)

    arrivals = poisson_arrivals(12, rate=200.0, seed=0)  # faster than the server: a queue builds up
    run = run_live(serve, arrivals)
    assert calls == list(range(12)) and not overlaps  # FIFO, one at a time
    assert [t.index for t in run.timings] == list(range(12)) and len(run.served) == 12
    for prev, t in zip(run.timings, run.timings[1:], strict=False):
        assert t.start_s >= prev.finish_s  # the server holds one request at a time
    for t in run.timings:
        assert t.start_s >= t.arrival_s and t.ttft_s >= 0.004  # a request's TTFT includes its wait
    assert statistics.fmean(t.ttft_s for t in run.timings) >= 0.004


def test_live_queue_stops_the_arrivals_when_serving_fails():
    def serve(i: int) -> Served:
        raise RuntimeError("engine down")

    with pytest.raises(RuntimeError, match="engine down"):
        run_live(serve, poisson_arrivals(5, rate=0.01))  # would take minutes if the arrival thread kept going


# -- end to end ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> CacheBlendEngine:
    return CacheBlendEngine(
        make_tiny_model("qwen2"), make_tiny_tokenizer(), config=EngineConfig(miss_policy="blend", chunk_separator="")
    )


def test_end_to_end_blend_reuses_chunks_that_prefix_caching_cannot(engine, tmp_path):
    data = write_qa_data(tmp_path / "data")
    datasets = [load_dataset(n, data, limit=3) for n in ("musique", "wikimqa")]
    settings = ThroughputSettings(rates=(0.5, 2.0, 50.0), chunk_tokens=16, top_k=3, repeats=3, warmup=2,
                                  max_new_tokens=2, ttft_slo_s=5.0)  # fmt: skip
    store = engine.store
    out = tmp_path / "out"
    result = run_throughput(
        engine, datasets, "full,prefix,blend@0.15", out, settings, embedder=BagOfWordsEmbedder(), show_progress=False
    )
    assert engine.store is store  # put back after the benchmark
    assert len(result.rows) == 2 * 3 * 3 and len(result.methods) == 2 * 3
    passes = {(p.dataset, p.method): p.records for p in result.passes}
    for name in ("musique", "wikimqa"):
        blend = passes[name, "blend@0.15"]
        assert sum(r.served.chunks_hit for r in blend if r.repeat > 0) > 0
        assert blend[0].served.chunks_hit == 0  # every method starts from an empty store
        assert all(r.served.chunks_hit == 0 for r in passes[name, "full"])
        hit = {m.method: m.hit_rate for m in result.methods if m.dataset == name}
        assert hit["full"] == 0.0 and hit["prefix"] <= 1 / 3 < hit["blend@0.15"]
        for row in (r for r in result.rows if r.dataset == name):
            assert row.stats.n == 9 - 2 and row.stats.ttft_p50_s <= row.stats.ttft_p90_s <= row.stats.ttft_p99_s
    saved = json.loads((out / "results.json").read_text())
    assert saved["settings"]["repeats"] == 3 and "paraphrase" in saved["note"]
    assert len(saved["workloads"][0]["sequence"]) == 9
    summary = (out / "summary.md").read_text()
    assert "| blend@0.15 | 50 |" in summary
    assert (out / "ttft_vs_rate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # results.json reads back into the same typed result, and the report redrawn from it is the same
    assert ThroughputResult.from_dict(saved).to_dict() == saved
    (out / "summary.md").unlink()
    write_throughput_report(out)
    # the same tables, but for one known loss: JSON has no infinity, so a TTFT target met at any rate ("any")
    # is null in the file and reads back as not known ("-")
    assert (out / "summary.md").read_text() == summary.replace("| any |", "| - |")


def test_live_mode_end_to_end(engine, tmp_path):
    ds = load_dataset("musique", write_qa_data(tmp_path / "data"), limit=2)
    settings = ThroughputSettings(rates=(100.0,), chunk_tokens=16, top_k=2, repeats=2, warmup=1, max_new_tokens=2,
                                  mode="live")  # fmt: skip
    result = run_throughput(engine, [ds], "blend", tmp_path / "out", settings, embedder=BagOfWordsEmbedder(),
                            show_progress=False)  # fmt: skip
    (p,) = result.passes
    assert p.rate == 100.0 and len(p.records) == 4
    assert all(r.timing.ttft_s >= r.served.ttft_s for r in p.records)  # the queue's wait comes on top
    assert result.rows[0].stats.n == 3
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert ThroughputResult.from_dict(saved).to_dict() == saved  # live records keep their queue timings


def test_cli_bench_throughput_runs(tmp_path, capsys, monkeypatch):
    model_dir = tmp_path / "tiny"
    make_tiny_model("llama").save_pretrained(model_dir)
    make_tiny_tokenizer().save_pretrained(model_dir)
    monkeypatch.setattr("cacheblend_rag.retrieval.load_embedder", lambda: BagOfWordsEmbedder())
    data = write_qa_data(tmp_path / "data", cases=2)
    argv = ["--model", str(model_dir), "--data-dir", str(data), "--datasets", "musique",
            "--methods", "full,blend@0.15", "--limit", "2", "--repeats", "2", "--rates", "1,4", "--top-k", "2",
            "--chunk-tokens", "16", "--max-new-tokens", "2", "--warmup", "1", "--ttft-slo", "30",
            "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "### musique extended (2 questions, 6 chunks, 4 requests, first 1 not measured)" in out
    assert "| full | 4 |" in out and "max tested rate, p90 <= 30 s" in out
    assert json.loads((tmp_path / "out" / "results.json").read_text())["settings"]["model"] == str(model_dir)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--methods", "full,maprerank"], "several requests per question"),
        (["--rates", "0.1,-1"], "rate must be > 0"),
        (["--repeats", "0"], "repeats must be an integer >= 1"),
        (["--datasets", "samsum"], "not a QA data set"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--data-dir", "/nonexistent/data"], "--data-dir '/nonexistent/data' is not a folder"),
    ],
)
def test_cli_checks_its_arguments_before_loading_a_model(args, message, tmp_path, capsys):
    assert main(["--out", str(tmp_path / "out"), "--model", "no-such-model", *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_request_beyond_the_models_context_is_refused_before_any_timing(tmp_path, engine):
    ds = load_dataset("musique", write_qa_data(tmp_path / "data"), limit=2)
    settings = ThroughputSettings(rates=(1.0,), chunk_tokens=16, top_k=2, repeats=2, max_new_tokens=600)
    with pytest.raises(PromptError, match="600 new tokens exceeds the model's limit of 512"):
        run_throughput(engine, [ds], "full", tmp_path / "out", settings, embedder=BagOfWordsEmbedder(),
                       show_progress=False)  # fmt: skip
    assert not (tmp_path / "out" / "results.json").exists()


def test_an_empty_data_file_is_a_clear_error(tmp_path, engine):
    (tmp_path / "musique").mkdir()
    (tmp_path / "musique" / "musique_s.json").write_text("[]")
    with pytest.raises(DatasetError, match="has no cases"):
        run_throughput(engine, [load_dataset("musique", tmp_path)], "full", tmp_path / "out",
                       ThroughputSettings(), embedder=BagOfWordsEmbedder(), show_progress=False)  # fmt: skip
