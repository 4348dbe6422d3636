"""Fixtures of the LangChain integration's tests: a tiny seeded random model, and the fast real test model.

The repository's root `tests/conftest.py` does not apply here, so the tiny model is built here too: a 2-layer
Llama with a word-level tokenizer whose words are "w3".."w98" (others map to <unk>) and a minimal chat
template, so chat rendering runs as on a real model.
"""

from __future__ import annotations

import inspect
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from cacheblend_rag import CacheBlendEngine, EngineConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

FAST_MODEL = "smollm2-135m-instruct"
WORDS = [f"w{i}" for i in range(3, 99)]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} w3 {{ m['content'] }} w4 {% endfor %}"
    "{% if add_generation_prompt %}assistant w3 {% endif %}"
)


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_pycollect_makeitem(collector, name, obj):
    """Run this folder's async tests (langchain-tests has many) on asyncio without changing the root's mode.

    pytest-asyncio only takes unmarked coroutines in "auto" mode, which the repository does not set; marking
    them here, before pytest-asyncio looks, keeps the setting local to this folder.
    """
    outcome = yield
    result = outcome.get_result()
    for node in result if isinstance(result, list) else [result]:
        if isinstance(node, pytest.Function) and inspect.iscoroutinefunction(node.obj):
            node.add_marker(pytest.mark.asyncio)


def make_tiny_tokenizer(chat_template: bool = True) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<unk>", unk_token="<unk>"
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(WORDS) + 3,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init, so chunks really attend to one another
        for pname, p in model.named_parameters():
            if "embed" in pname:
                p.normal_(0, 1.0)
            elif p.dim() == 2:
                p.mul_(6.0)
            if "lm_head" in pname:
                p[2].zero_()  # EOS scores 0 among large random logits: answers run to max_tokens or a stop
    return model.eval()


def tiny_engine(chat_template: bool = True) -> CacheBlendEngine:
    """A fresh engine (its own empty chunk store) on the tiny model."""
    return CacheBlendEngine(make_tiny_model(), make_tiny_tokenizer(chat_template), config=EngineConfig())


@pytest.fixture
def engine() -> CacheBlendEngine:
    return tiny_engine()


@pytest.fixture
def engine_without_chat_template() -> CacheBlendEngine:
    return tiny_engine(chat_template=False)


@pytest.fixture(scope="session")
def fast_engine() -> CacheBlendEngine:
    """The real fast test model, shared by the session (the same object `load_engine` hands out)."""
    from langchain_cacheblend import load_engine

    return load_engine(FAST_MODEL)
