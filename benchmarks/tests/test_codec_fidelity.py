"""The fidelity benchmark with stored-KV codecs (`fidelity.py --kv-codec`): every method measured again with its chunk
KV read through a codec, named after method and codec, and paired per case against the uncompressed store
(`benchlib.fidelity_codecs`). Tiny random models."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from benchlib.fidelity_codecs import (
    NOISE_NATS,
    POOLED,
    CodecDifference,
    baseline_of,
    codec_differences,
    codec_markdown,
)
from benchlib.fidelity_report import write_fidelity_report
from benchlib.fidelity_run import (
    codec_engines,
    codec_method_name,
    fidelity_methods,
    parse_codecs,
    run_fidelity,
    split_codec,
)
from fidelity import main
from test_fidelity import tiny_dataset

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.errors import CacheBlendError, ConfigError
from cacheblend_rag.store.codec import CODECS, NATIVE, PayloadSpec
from cacheblend_rag.store.memory import MemoryStore
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = EngineConfig(miss_policy="blend", chunk_separator="")


@pytest.fixture
def engine() -> CacheBlendEngine:
    return CacheBlendEngine(make_tiny_model("qwen2", mute_eos=True), make_tiny_tokenizer(), config=CONFIG)


def on_store(engine: CacheBlendEngine, store: MemoryStore) -> CacheBlendEngine:
    """Another engine on `engine`'s model whose chunk KV goes through `store`."""
    return CacheBlendEngine(engine.model, engine.tokenizer, config=CONFIG, store=store)


class ValuesNegated:
    """Broken on purpose: keys exact, values read back negated (a sign slip in a decoder)."""

    name = "values-negated"

    def payload_spec(self, shape, dtype) -> PayloadSpec:
        return PayloadSpec(dtype, tuple(shape), tuple(shape))

    def encode(self, k, v, layer):
        return k, v

    def decode(self, key_payload, value_payload, shape, dtype, layer):
        return key_payload.view(shape), -value_payload.view(shape)


def test_codec_methods_carry_the_codec_in_their_name_and_native_keeps_the_plain_name():
    assert codec_method_name("attention@0.15", "int8") == "attention@0.15+int8"
    assert codec_method_name("reuse", "native") == "reuse"
    assert split_codec("attention@0.15+int4") == ("attention@0.15", "int4")
    assert split_codec("attention@0.15") == ("attention@0.15", "native")
    assert split_codec("attention@0.15+grp+int4") == ("attention@0.15", "grp+int4")  # a codec over a variant
    assert (baseline_of("int4"), baseline_of("grp"), baseline_of("grp+int4")) == ("native", "native", "grp")
    assert parse_codecs("int4, int8,int4") == ["native", "int4", "int8"]  # uncompressed first, once each
    with pytest.raises(ConfigError, match="unknown codec 'int3'"):
        parse_codecs("int3")


def test_every_method_is_measured_per_codec_and_paired_with_itself_uncompressed(engine, tmp_path):
    engines = codec_engines(engine, ["native", "int8"])
    assert engines["native"] is engine and engines["int8"].model is engine.model  # one model, not a copy
    records = run_fidelity(engine, [tiny_dataset(2)], fidelity_methods(["attention"], [0.15]), tmp_path,
                           codecs=engines, show_progress=False)  # fmt: skip
    names = [r["method"] for r in records if r["case_id"] == "c0"]
    assert names == ["full", "reuse", "attention@0.15", "reuse+int8", "attention@0.15+int8"]
    assert {r["codec"] for r in records if r["method"].endswith("+int8")} == {"int8"}

    rows = codec_differences(records)
    assert [(r.dataset, r.codec, r.method, r.n) for r in rows] == [
        ("tinyqa", "int8", "reuse", 2),
        ("tinyqa", "int8", "attention@0.15", 2),
    ]
    kl = {(r["case_id"], r["method"]): r["kl_mean"] for r in records}
    want = sum(kl[(c, "reuse+int8")] - kl[(c, "reuse")] for c in ("c0", "c1")) / 2
    assert rows[0].kl_diff == pytest.approx(want, abs=1e-12)
    # Resuming measures nothing again; the summary ends with the codec table.
    assert len(run_fidelity(engine, [tiny_dataset(2)], fidelity_methods(["attention"], [0.15]), tmp_path,
                            codecs=engines, show_progress=False)) == len(records)  # fmt: skip
    files = write_fidelity_report(tmp_path, records)
    assert "| int8 | reuse | 2 |" in files["summary"].read_text()
    assert json.loads(files["codecs"].read_text())[0]["codec"] == "int8"


def test_the_uncompressed_store_read_through_another_engine_differs_by_exactly_zero(engine, tmp_path):
    engines = {"native": engine, "native-copy": on_store(engine, MemoryStore(codec=NATIVE))}
    records = run_fidelity(engine, [tiny_dataset(3)], fidelity_methods(["attention"], [0.15]), tmp_path,
                           codecs=engines, show_progress=False)  # fmt: skip
    rows = codec_differences(records)
    assert len(rows) == 2
    for r in rows:
        assert (r.kl_diff, r.kl_diff_ci, r.top1_diff, r.first_token_diff) == (0.0, (0.0, 0.0), 0.0, 0.0)
        assert r.within_noise


def test_a_broken_codec_is_flagged_not_within_noise(engine, tmp_path):
    engines = {"native": engine, "broken": on_store(engine, MemoryStore(codec=ValuesNegated()))}
    records = run_fidelity(engine, [tiny_dataset(3)], fidelity_methods([], [], reuse=True), tmp_path,
                           codecs=engines, show_progress=False)  # fmt: skip
    (row,) = codec_differences(records)
    assert row.method == "reuse" and row.n == 3
    assert row.kl_diff > NOISE_NATS and row.kl_diff_ci[0] > 0, row
    assert not row.within_noise and "NOT within noise" in codec_markdown([row])


def test_a_real_codec_of_this_package_stays_close_on_the_tiny_model(engine, tmp_path):
    engines = {"native": engine, "int8": on_store(engine, MemoryStore(codec=CODECS["int8"]))}
    records = run_fidelity(engine, [tiny_dataset(2)], fidelity_methods([], [], reuse=True), tmp_path,
                           codecs=engines, show_progress=False)  # fmt: skip
    (row,) = codec_differences(records)
    assert abs(row.kl_diff) < NOISE_NATS and row.within_noise, row


def _rec(dataset: str, method: str, case: str, kl: float, top1: float = 1.0, first: float = 1.0) -> dict:
    return {"dataset": dataset, "case_id": case, "method": method, "kl_mean": kl, "top1": top1, "first_token": first}


def test_within_noise_means_an_interval_through_zero_or_a_small_increase():
    def row(diff: float, ci: tuple[float, float]) -> CodecDifference:
        return CodecDifference("d", "int4", "reuse", 5, 0.1, 0.1 + diff, diff, ci, 0.0, 0.0)

    assert row(0.02, (-0.01, 0.05)).within_noise  # interval through 0
    assert row(0.004, (0.003, 0.005)).within_noise  # small, if certain
    assert not row(0.02, (0.01, 0.03)).within_noise


def test_pooled_rows_pair_cases_of_every_data_set():
    recs = []
    for ds, extra in (("a", 0.01), ("b", 0.03)):
        for i in range(2):
            recs += [_rec(ds, "reuse", f"c{i}", 0.1), _rec(ds, "reuse+int4", f"c{i}", 0.1 + extra, first=0.0)]
    rows = {r.dataset: r for r in codec_differences(recs)}
    assert list(rows) == ["a", "b", POOLED]
    assert rows[POOLED].n == 4 and rows[POOLED].kl_diff == pytest.approx(0.02)
    assert rows["b"].first_token_diff == -1.0 and not rows["b"].within_noise


def test_records_measured_against_different_reference_answers_are_not_paired():
    """A run resumed on another machine computes full recompute's answer again; where it came out differently, the
    codec's record and the uncompressed one are not comparable. Records without a digest (older runs) still pair."""
    recs = [
        {**_rec("a", "reuse", "c0", 0.1), "reference_digest": "x"},
        {**_rec("a", "reuse+int4", "c0", 0.5), "reference_digest": "y"},  # another answer: left out
        {**_rec("a", "reuse", "c1", 0.1), "reference_digest": "z"},
        {**_rec("a", "reuse+int4", "c1", 0.12), "reference_digest": "z"},
        _rec("a", "reuse", "c2", 0.2),
        {**_rec("a", "reuse+int4", "c2", 0.24), "reference_digest": "w"},
    ]
    (row,) = codec_differences(recs)
    assert row.n == 2 and row.mismatched == 1 and row.kl_diff == pytest.approx(0.03)
    assert "Left out: up to 1 case(s)" in codec_markdown([row])
    assert "Left out" not in codec_markdown(codec_differences(recs[2:]))


def test_every_record_of_a_case_carries_its_reference_digest(engine, tmp_path):
    records = run_fidelity(engine, [tiny_dataset(2)], fidelity_methods([], [], reuse=True), tmp_path,
                           codecs=codec_engines(engine, ["native", "int8"]), show_progress=False)  # fmt: skip
    by_case: dict[str, set] = {}
    for r in records:
        by_case.setdefault(r["case_id"], set()).add(r["reference_digest"])
    assert all(len(d) == 1 and len(next(iter(d))) == 16 for d in by_case.values()), by_case


def test_bench_fidelity_refuses_an_unknown_codec_before_loading_a_model(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--model", "no-such-model", "--kv-codec", "int8,int3"]) == 2
    assert "unknown codec 'int3'" in capsys.readouterr().err


def test_contextual_chunk_kv_is_measured_beside_isolated_and_its_exact_context_gives_exact_reuse(engine, tmp_path):
    # The contextual variant with each chunk's whole real context before it (what a prompt's full prefill holds):
    # full reuse on it must equal full recompute, and the paired table must call it closer.
    from benchlib.fidelity_context import CONTEXT, context_engine, context_verdict, split_context_rows

    def exact_context(ctx_engine, spec, case, prompt):
        chunks = list(case.chunks)
        ctx_engine.clear_store()
        ctx_engine.precompute(chunks, case.question, template=spec.template,
                              context=[chunks[:j] for j in range(len(chunks))])  # fmt: skip
        return {"context_tokens": 1.0, "chunk_tokens": 1.0, "precompute_s": 0.0}

    engines = {"native": engine, CONTEXT: context_engine(engine, 2)}
    records = run_fidelity(engine, [tiny_dataset(3)], fidelity_methods([], [], reuse=True), tmp_path,
                           codecs=engines, prepare={CONTEXT: exact_context}, show_progress=False)  # fmt: skip
    ctx = [r for r in records if r["method"] == "reuse+ctx"]
    assert len(ctx) == 3 and all(r["kl_mean"] < 1e-6 for r in ctx)
    _, rows = split_context_rows(codec_differences(records))
    assert rows and context_verdict(rows[-1]) == "closer"


def test_captured_chunk_kv_is_measured_beside_isolated_and_its_own_prompt_gives_exact_reuse(engine, tmp_path):
    # Captured from a full prefill of the very prompt measured, every chunk's KV is that prefill's: full reuse must
    # equal full recompute. From the earlier request's shuffled order, each chunk is captured once and some differ.
    from benchlib.fidelity_context import CAPTURED, CapturePreparer, capture_engine, earlier_order

    def run(out, preparer):
        engines = {"native": engine, CAPTURED: capture_engine(engine)}
        return run_fidelity(engine, [tiny_dataset(2)], fidelity_methods([], [], reuse=True), tmp_path / out,
                            codecs=engines, prepare={CAPTURED: preparer}, show_progress=False)  # fmt: skip

    records = run("same", CapturePreparer(order=lambda case_id, n: list(range(n))))
    cap = [r for r in records if r["method"] == "reuse+cap"]
    assert len(cap) == 2 and all(r["kl_mean"] < 1e-6 and r["captured_chunks"] == r["same_context"] for r in cap)
    records = run("shuffled", CapturePreparer())
    for r in (r for r in records if r["method"] == "reuse+cap"):
        assert r["capture_order"] == earlier_order(r["case_id"], len(r["capture_order"]))
        assert r["capture_order"] != sorted(r["capture_order"]) and r["captured_chunks"] == len(r["capture_order"])
        assert r["same_context"] < r["captured_chunks"] and r["kl_mean"] > 1e-4


def test_a_variant_read_through_a_codec_reads_the_variants_entries_and_is_paired_with_the_variant(engine, tmp_path):
    # Captured chunk KV copied into a store that keeps it exactly ("cap+copy") must measure exactly as the variant
    # does (it reads the captured entries, not isolated ones), also when resumed after the variant's records were
    # done, so that the variant's store has to be filled again; "cap+int8" is paired against "cap", not isolated.
    from benchlib.fidelity_context import CAPTURED, CapturePreparer, VariantThroughCodec, capture_engine

    cap = capture_engine(engine)
    copy = CacheBlendEngine(
        engine.model,
        engine.tokenizer,
        config=replace(cap.config, store=replace(cap.config.store, memory_codec="native")),
    )
    methods, data = fidelity_methods(["attention"], [0.15]), tiny_dataset(2)
    shuffled = CapturePreparer()
    run_fidelity(engine, [data], methods, tmp_path, codecs={"native": engine, CAPTURED: cap},
                 prepare={CAPTURED: shuffled}, show_progress=False)  # fmt: skip
    through = VariantThroughCodec(cap, shuffled)
    engines = {"native": engine, CAPTURED: cap, "cap+copy": copy, **{
        f"{CAPTURED}+{c}": e for c, e in codec_engines(cap, ["int8"]).items()}}  # fmt: skip
    records = run_fidelity(engine, [data], methods, tmp_path, codecs=engines, show_progress=False, prepare={
        CAPTURED: through.fill_variant, "cap+copy": through, "cap+int8": through})  # fmt: skip
    kl = {(r["case_id"], r["method"]): r["kl_mean"] for r in records}
    for case in ("c0", "c1"):
        for m in ("reuse", "attention@0.15"):
            assert kl[(case, f"{m}+cap+copy")] == kl[(case, f"{m}+cap")] != kl[(case, m)]
    rows = {(r.codec, r.method): r for r in codec_differences(records) if r.dataset == "tinyqa"}
    assert rows[("cap+copy", "reuse")].kl_diff == 0.0
    int8 = rows[("cap+int8", "reuse")]
    assert int8.kl_native == pytest.approx((kl[("c0", "reuse+cap")] + kl[("c1", "reuse+cap")]) / 2)
    assert abs(int8.kl_diff) < NOISE_NATS
    with pytest.raises(ValueError, match="own engine"):
        through.fill_variant(copy, data.spec, data.cases[0], None)


def test_records_of_another_run_are_taken_only_from_the_same_setup(tmp_path):
    from benchlib.records import append_record, check_run_settings, load_records, take_records

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    setup = {"model": "m", "dtype": "float32", "device": "cpu"}
    check_run_settings(src, setup)
    for method in ("full", "reuse", "paper@0.15"):
        append_record(src / "r.jsonl", {"dataset": "d", "case_id": "1", "method": method})
    assert take_records(src, out, setup, "r.jsonl", lambda r: r["method"] != "paper@0.15") == 2
    assert take_records(src, out, setup, "r.jsonl", lambda r: True) == 1  # what `out` has is not taken twice
    assert [r["method"] for r in load_records(out, filename="r.jsonl")] == ["full", "reuse", "paper@0.15"]
    with pytest.raises(CacheBlendError, match="another setup"):
        take_records(src, tmp_path / "other", {**setup, "dtype": "bfloat16"}, "r.jsonl", lambda r: True)


def test_captured_among_other_cases_passages_is_measured_and_each_chunk_is_captured(engine, tmp_path):
    # Two earlier requests of half the case each, among passages of other cases: every chunk of the case gets a
    # stored entry, and the measured prompt reads them (no full prefill: the variant engine blends its misses).
    from benchlib.fidelity_context import CAPTURED_MIXED, MixedCapturePreparer, capture_engine

    data = tiny_dataset(3)
    pools = {data.spec.name: [c for case in data.cases for c in case.chunks]}
    engines = {"native": engine, CAPTURED_MIXED: capture_engine(engine)}
    records = run_fidelity(engine, [data], fidelity_methods([], [], reuse=True), tmp_path, codecs=engines,
                           prepare={CAPTURED_MIXED: MixedCapturePreparer(pools)}, show_progress=False)  # fmt: skip
    mixed = [r for r in records if r["method"] == "reuse+capmix"]
    assert len(mixed) == 3
    for r in mixed:
        halves = r["captured_halves"]
        assert sorted(halves[0] + halves[1]) == [0, 1, 2] and r["captured_chunks"] >= 3
        assert r["kl_mean"] > 1e-4  # captured after other text than the measured prompt's


def test_acyclic_pool_neighbours_never_put_two_passages_in_each_others_context():
    from benchlib.fidelity_context import PoolNeighbours, text_rank

    data = tiny_dataset(4)
    chunks = [c for case in data.cases for c in case.chunks]
    nearest = dict(zip(chunks, PoolNeighbours(data, 2).context(chunks), strict=True))
    acyclic = dict(zip(chunks, PoolNeighbours(data, 2, acyclic=True).context(chunks), strict=True))
    assert all(len(ctx) == 2 for ctx in nearest.values())
    assert any(b in nearest[a] for b in chunks for a in nearest[b])  # the nearest passages make 2-cycles
    for chunk, ctx in acyclic.items():
        assert all(text_rank(c) < text_rank(chunk) for c in ctx) and len(ctx) <= 2
        assert not any(chunk in acyclic[c] for c in ctx)
    first = min(chunks, key=text_rank)
    assert acyclic[first] == [] and sum(len(ctx) for ctx in acyclic.values()) > len(chunks)
