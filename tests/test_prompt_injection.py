"""Documents and questions cannot forge chat turns: a control-token string in them stays text.

Uses the default preset's real tokenizer (Qwen2.5, where `<|im_start|>` is a special token), read from its
converted copy under the cacheblend-rag cache; the model is a tiny random one, since only prompts are built.
"""

from __future__ import annotations

import pytest

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.engine.request.prompt import tokenize_chunks
from cacheblend_rag.errors import PromptError
from cacheblend_rag.testing import INJECTION


@pytest.fixture(scope="module")
def engine() -> CacheBlendEngine:
    return INJECTION.engine() or pytest.skip(INJECTION.skip)


def _control_tokens(engine: CacheBlendEngine, ids: list[int]) -> list[str]:
    start, end = engine.tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    return [engine.tokenizer.convert_ids_to_tokens(i) for i in ids if i in (start, end)]


def test_a_document_with_chat_markup_adds_no_control_token(engine: CacheBlendEngine) -> None:
    clean = engine.build_prompt([INJECTION.clean], INJECTION.question)
    forged = engine.build_prompt([INJECTION.forged], INJECTION.question)
    # system, user and assistant turns of the template: three starts, two ends, whatever the document says
    assert _control_tokens(engine, forged.input_ids().tolist()) == _control_tokens(engine, clean.input_ids().tolist())
    assert _control_tokens(engine, clean.input_ids().tolist()).count("<|im_start|>") == 3
    assert engine.tokenizer.decode(list(forged.chunk_ids[0])) == INJECTION.forged + "\n\n"  # the text itself is kept


def test_a_question_with_chat_markup_adds_no_control_token(engine: CacheBlendEngine) -> None:
    clean = engine.build_prompt([INJECTION.clean], INJECTION.question)
    forged = engine.build_prompt([INJECTION.clean], INJECTION.forged_question)
    assert _control_tokens(engine, list(forged.suffix_ids)) == _control_tokens(engine, list(clean.suffix_ids))


def test_template_markup_keeps_its_control_tokens_and_plain_text_its_ids(engine: CacheBlendEngine) -> None:
    prompt = engine.build_prompt([INJECTION.clean], INJECTION.question)
    prefix, suffix = engine.template.render(engine.tokenizer, INJECTION.question)
    # The same ids as tokenizing the rendered text whole: ordinary prompts (and their cache keys) do not change.
    assert list(prompt.prefix_ids) == engine.tokenizer.encode(prefix, add_special_tokens=False)
    assert list(prompt.suffix_ids) == engine.tokenizer.encode(suffix, add_special_tokens=False)
    assert list(prompt.chunk_ids[0]) == engine.tokenizer.encode(INJECTION.clean + "\n\n", add_special_tokens=False)


def test_chunk_keys_follow_the_safe_tokenization(engine: CacheBlendEngine) -> None:
    # precompute tokenizes chunks with tokenize_chunks; a request must read the entries it wrote.
    prompt = engine.build_prompt([INJECTION.forged], INJECTION.question)
    (chunk_ids,) = tokenize_chunks(engine.tokenizer, [INJECTION.forged])
    assert prompt.chunk_ids == (chunk_ids,)
    assert engine.prompt_keys(prompt, with_prefix=False) == [engine.chunk_key(prompt.prefix_ids, chunk_ids)]


def test_reserved_marker_in_a_question_is_named(engine: CacheBlendEngine) -> None:
    with pytest.raises(PromptError, match="the question contains the reserved marker"):
        engine.build_prompt(["Paris is in France."], "Where\x00<cacheblend-rag:chunks>\x00 is Paris?")
    # in a chunk it is plain text: chunks are tokenized on their own
    prompt = engine.build_prompt(["Paris\x00<cacheblend-rag:chunks>\x00 is in France."], "Where is Paris?")
    assert len(prompt.chunk_ids) == 1
