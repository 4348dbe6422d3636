"""What a precompute tells before its first prefill (`precompute(on_plan=...)`), and what `ask --precompute-all` prints
from it: the chunks reused and computed, the tokens to prefill, and an estimate of the time with what it rests on."""

from __future__ import annotations

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.cli import main
from cacheblend_rag.cli.precompute_all import describe_plan, prefill_speed
from cacheblend_rag.engine import PrecomputePlan, RequestMetrics
from cacheblend_rag.testing import make_tiny_model, random_words

PREFIX = random_words(60, 5)


def test_the_plan_counts_the_tokens_the_bar_will_count_and_nothing_once_all_is_stored(tiny_tokenizer, capsys):
    engine = CacheBlendEngine(make_tiny_model("llama"), tiny_tokenizer, config=EngineConfig(chunk_separator=""))
    chunks = [random_words(90 + i, 15) for i in range(5)]
    plans: list[PrecomputePlan] = []
    assert engine.precompute(chunks, prefix=PREFIX, group_tokens=40, show_progress=True, on_plan=plans.append) == (0, 5)
    first = plans[0]
    assert (first.chunks, first.stored, first.computed, first.partly_stored) == (5, 0, 5, 0)
    assert first.all_groups >= 2 and first.groups == first.all_groups
    assert f"{first.tokens}/{first.tokens} tokens [" in capsys.readouterr().err.replace("\r", "\n")
    engine.precompute(chunks, prefix=PREFIX, group_tokens=40, on_plan=plans.append)
    assert (plans[1].stored, plans[1].computed, plans[1].tokens) == (5, 0, 0)

    alone: list[PrecomputePlan] = []
    others = [random_words(120 + i, 15) for i in range(3)]
    engine.precompute(others[:1], prefix=PREFIX, context=None)
    engine.precompute(others, prefix=PREFIX, context=None, on_plan=alone.append)
    assert (alone[0].stored, alone[0].alone, alone[0].groups, alone[0].all_groups) == (1, 2, 0, 0)


def test_the_estimate_rests_on_this_runs_prefills_else_says_none_is_known():
    full = RequestMetrics(mode="full", prompt_tokens=3000, compute_s=10.0)
    warm = RequestMetrics(mode="blend", prompt_tokens=3000, compute_s=1.0)  # a blend is no prefill speed
    rate, basis = prefill_speed([full, warm], None, 3000)
    assert rate == 300 and "this run's 1 prefill: 3,000 tokens in 10.0 s" in basis
    assert prefill_speed([warm], None, 3000) is None
    plan = PrecomputePlan(203, 4, 52, 150, 76_800, 40, 123_000, 41)
    text = describe_plan(plan, (rate, basis))
    assert "203 chunks in 41 groups" in text and "4 have every entry stored (reused), 199 need one computed" in text
    assert "52 of those have an entry stored by earlier answers" in text
    assert "199,800 tokens, 11 min at 300 tokens/s" in text
    assert "no prefill speed is known yet" in describe_plan(plan, None)


def test_precompute_all_prints_its_plan_and_estimate_before_the_bar(tmp_path, capsys, tiny_model_dir):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"{i}.txt").write_text(random_words(i, 12))
    argv = ["ask", "--model", str(tiny_model_dir), "--chunk-tokens", "16", "--max-new-tokens", "2", "--docs",
            str(docs), "--top-k", "2", "--kv-dir", str(tmp_path / "kv"), "--precompute-all",
            random_words(9, 3)]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    plan = err.index("--precompute-all: 4 chunks in")
    assert "estimate:" in err and "tokens/s (this run's 1 prefill:" in err  # the cold answer's full prefill
    assert "have an entry stored by earlier answers" in err  # the answer stored its chunks' entries
    assert plan < err.index("precomputing chunk KV") < err.index("precomputed the KV of 4 chunks")
