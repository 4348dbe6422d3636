"""A lead-in (`EngineConfig.lead_in`): every chunk but a prompt's first is cached after the prefix and a fixed text.

On tiny random models: which entries are stored and read, that each entry holds what a prefill after its context
gives, and that the cached modes stay exact where they were (the first chunk, r = 1, r = 0 against reuse)."""

from __future__ import annotations

import pytest
import torch
from conftest import reference_logits_with_cache

from cacheblend_rag import DEFAULT_LEAD_IN, CacheBlendEngine, ConfigError, EngineConfig
from cacheblend_rag.engine.prompt import encode
from cacheblend_rag.store import MemoryStore
from cacheblend_rag.testing import make_tiny_model, random_words

LEAD_IN = random_words(7, 9)
PREFIX = random_words(1, 5)


@pytest.fixture
def lead_engine(family, tiny_tokenizer) -> CacheBlendEngine:
    config = EngineConfig(chunk_separator="", lead_in=LEAD_IN)
    return CacheBlendEngine(make_tiny_model(family), tiny_tokenizer, config=config)


def chunks_and_prompt(engine):
    chunks = [random_words(s, 14) for s in (31, 32, 33)]
    return chunks, engine.build_prompt(chunks, prefix=PREFIX, suffix=random_words(2, 6))


def test_the_first_chunk_reads_its_entry_after_the_prefix_and_the_others_after_the_lead_in(lead_engine):
    chunks, prompt = chunks_and_prompt(lead_engine)
    lead_ids = encode(lead_engine.tokenizer, LEAD_IN)
    c0, c1, c2 = prompt.chunk_ids
    after_lead_in = (*prompt.prefix_ids, *lead_ids)
    assert lead_engine.prompt_keys(prompt) == [
        lead_engine.chunk_key((), prompt.prefix_ids),
        lead_engine.chunk_key(prompt.prefix_ids, c0),
        lead_engine.chunk_key(after_lead_in, c1),
        lead_engine.chunk_key(after_lead_in, c2),
    ]
    assert lead_engine.prompt_keys(prompt, with_prefix=False) == lead_engine.prompt_keys(prompt)[1:]
    assert lead_engine.precompute(chunks, prefix=PREFIX) == (0, 3)
    assert lead_engine.precompute(chunks, prefix=PREFIX) == (3, 0)
    for ids in (c0, c1, c2):  # both entries of every chunk: any of them may come first in another prompt
        for context in (prompt.prefix_ids, after_lead_in):
            assert lead_engine.store.get(lead_engine.chunk_key(context, ids)) is not None


def test_the_prefix_and_lead_in_kv_is_read_once_for_all_the_chunks_prefilled_after_it(lead_engine, monkeypatch):
    chunks, prompt = chunks_and_prompt(lead_engine)
    context_key = lead_engine.chunk_key((), (*prompt.prefix_ids, *encode(lead_engine.tokenizer, LEAD_IN)))
    opened: list[str] = []
    store_open = lead_engine.store.open
    monkeypatch.setattr(lead_engine.store, "open", lambda key: opened.append(key) or store_open(key))
    lead_engine.precompute(chunks, prefix=PREFIX)
    lead_engine.precompute([random_words(s, 14) for s in (41, 42)], prefix=PREFIX)
    assert opened.count(context_key) == 1  # made on the first miss, then kept for every later one
    lead_engine.clear_store()
    lead_engine.precompute(chunks, prefix=PREFIX)
    assert opened.count(context_key) == 2  # a cleared store forgets it: the next miss reads (here: makes) it again
    assert lead_engine.store.get(context_key) is not None


def test_a_new_store_gets_its_own_prefix_and_lead_in_entry(lead_engine):
    chunks, prompt = chunks_and_prompt(lead_engine)
    context_key = lead_engine.chunk_key((), (*prompt.prefix_ids, *encode(lead_engine.tokenizer, LEAD_IN)))
    lead_engine.precompute(chunks, prefix=PREFIX)
    lead_engine.store = MemoryStore(1 << 26)
    lead_engine.precompute(chunks, prefix=PREFIX)
    assert lead_engine.store.get(context_key) is not None  # not served from what the old store's miss made


def test_an_entry_after_the_lead_in_holds_what_the_model_computes_there(lead_engine):
    chunks, prompt = chunks_and_prompt(lead_engine)
    lead_engine.precompute(chunks, prefix=PREFIX)
    ids = (*prompt.prefix_ids, *encode(lead_engine.tokenizer, LEAD_IN), *prompt.chunk_ids[1])
    with torch.no_grad():
        out = lead_engine.model(input_ids=torch.tensor([ids]), use_cache=True)
    n = len(prompt.chunk_ids[1])
    entry = lead_engine.store.get(lead_engine.prompt_keys(prompt)[2])
    for layer in range(lead_engine.lm.shape.num_layers):
        values = out.past_key_values.layers[layer].values[0, :, -n:]
        torch.testing.assert_close(entry.values[layer], values, atol=1e-4, rtol=0)


def test_cached_modes_stay_exact_where_they_were(lead_engine):
    _, prompt = chunks_and_prompt(lead_engine)
    full = lead_engine.prefill(prompt, "full").logits
    reuse = lead_engine.prefill(prompt, "reuse").logits
    torch.testing.assert_close(reuse, reference_logits_with_cache(lead_engine, prompt, 3), atol=1e-4, rtol=0)
    torch.testing.assert_close(lead_engine.prefill(prompt, "prefix").logits, full, atol=1e-4, rtol=0)
    torch.testing.assert_close(
        lead_engine.prefill(prompt, "blend", recompute_ratio=1.0).logits, full, atol=1e-4, rtol=0
    )
    torch.testing.assert_close(
        lead_engine.prefill(prompt, "blend", recompute_ratio=0.0).logits, reuse, atol=1e-4, rtol=0
    )


def test_the_lead_in_changes_what_reuse_reads(lead_engine, family, tiny_tokenizer):
    _, prompt = chunks_and_prompt(lead_engine)
    plain_config = EngineConfig(chunk_separator="", lead_in=None)
    plain = CacheBlendEngine(make_tiny_model(family), tiny_tokenizer, config=plain_config)
    assert plain.fingerprint == lead_engine.fingerprint  # the same weights: only the stored KV differs
    assert plain.prompt_keys(prompt) == [plain.chunk_key((), prompt.prefix_ids)] + [
        plain.chunk_key(prompt.prefix_ids, ids) for ids in prompt.chunk_ids
    ]
    with_lead_in = lead_engine.prefill(prompt, "reuse").logits
    without = plain.prefill(prompt, "reuse").logits
    assert float((with_lead_in - without).abs().max()) > 1e-4


@pytest.mark.parametrize("bad", ["", "   \n", 3])
def test_a_blank_or_non_text_lead_in_is_refused(bad):
    with pytest.raises(ConfigError, match="lead_in must be None"):
        EngineConfig(lead_in=bad)


def test_the_default_lead_in_is_ordinary_prose():
    assert 500 < len(DEFAULT_LEAD_IN) < 1200 and DEFAULT_LEAD_IN.strip() == DEFAULT_LEAD_IN


def test_command_line_lead_ins(tmp_path):
    from cacheblend_rag.config import resolve_lead_in

    assert resolve_lead_in("none") is None
    assert resolve_lead_in("default") == DEFAULT_LEAD_IN
    passage = tmp_path / "lead_in.txt"
    passage.write_text("  A passage typical of my corpus.\n")
    assert resolve_lead_in(str(passage)) == "A passage typical of my corpus."
    with pytest.raises(ConfigError, match="'none', 'default' or a readable text file"):
        resolve_lead_in(str(tmp_path / "missing.txt"))
    (tmp_path / "blank.txt").write_text("\n \n")
    with pytest.raises(ConfigError, match="is empty"):
        resolve_lead_in(str(tmp_path / "blank.txt"))


def test_a_chunk_stored_for_the_other_place_is_read_not_prefilled_except_as_prefix_cachings_first(lead_engine):
    a, b = random_words(41, 14), random_words(42, 14)
    ab = lead_engine.build_prompt([a, b], prefix=PREFIX, suffix=random_words(2, 6))
    ba = lead_engine.build_prompt([b, a], prefix=PREFIX, suffix=random_words(2, 6))
    cold = lead_engine.prefill(ab, "reuse").metrics  # stores a's entry for the first place, b's for the others
    assert (cold.chunks_hit, cold.chunks_missed) == (0, 2)
    warm = lead_engine.prefill(ba, "blend").metrics  # each chunk's entry for its new place is missing
    assert (warm.chunks_hit, warm.chunks_missed) == (2, 0)
    # Prefix caching uses the first chunk's KV as exact: b must be read from its entry after the prefix alone.
    prefix = lead_engine.prefill(ba, "prefix")
    assert (prefix.metrics.chunks_hit, prefix.metrics.chunks_missed) == (0, 1)
    torch.testing.assert_close(prefix.logits, lead_engine.prefill(ba, "full").logits, atol=1e-4, rtol=0)


def test_a_run_folder_keeps_its_lead_in(tmp_path):
    import json

    from cacheblend_rag.errors import CacheBlendError
    from cacheblend_rag.evaluation.records import check_run_settings

    old = tmp_path / "from_before_lead_ins"  # its run file has no lead_in key: it ran without one
    old.mkdir()
    (old / "run.json").write_text(json.dumps({"model": "default"}))
    with pytest.raises(CacheBlendError, match="lead_in: 'none' there, 'default' now"):
        check_run_settings(old, {"model": "default", "lead_in": "default"})
    check_run_settings(old, {"model": "default", "lead_in": "none"})
    assert json.loads((old / "run.json").read_text())["lead_in"] == "none"

    new = tmp_path / "with_lead_in"
    new.mkdir()
    check_run_settings(new, {"model": "default", "lead_in": "default"})
    with pytest.raises(CacheBlendError, match="lead_in: 'default' there, 'none' now"):
        check_run_settings(new, {"model": "default", "lead_in": "none"})
