"""Shared fixtures: tiny seeded random-weight models of each supported family, and a word-level tokenizer."""

from __future__ import annotations

import os
import uuid

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from redis_helpers import RedisServer
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from cacheblend_rag import CacheBlendEngine, EngineConfig

VOCAB = 99
WORDS = [f"w{i}" for i in range(VOCAB - 3)]  # ids 3..98; 0..2 are specials


def tiny_config(family: str, num_layers: int = 6):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if family == "llama":
        return LlamaConfig(**common, rope_theta=10000.0)
    if family == "qwen2":
        return Qwen2Config(**common, rope_theta=10000.0, use_sliding_window=False)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=16, rope_theta=10000.0, use_sliding_window=False)
    raise ValueError(family)


_CLASSES = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}


def make_tiny_model(family: str, seed: int = 0, num_layers: int = 6) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny_config(family, num_layers)
    config._attn_implementation = "sdpa"
    model = _CLASSES[family](config)
    # Default init is tiny (std 0.02): scale weights up so attention is far from uniform and chunks really
    # influence one another, which makes the difference between reuse and recompute visible.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(6.0)
            elif "embed" in name:
                p.normal_(0, 1.0)
    return model.eval()


def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>"
    )


def words(seed: int, n: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g))


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread, and do not stall when other processes hold the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def family(request) -> str:
    return request.param


@pytest.fixture
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return make_tiny_tokenizer()


@pytest.fixture
def tiny_engine(family, tiny_tokenizer) -> CacheBlendEngine:
    return CacheBlendEngine(make_tiny_model(family), tiny_tokenizer, config=EngineConfig(chunk_separator=""))


def reference_logits_with_cache(engine: CacheBlendEngine, prompt, num_chunks: int) -> torch.Tensor:
    """Last-token logits from the model's own forward over the prompt's tail, after a DynamicCache filled with
    the stored KV of the prefix and the first `num_chunks` chunks, each rotated to its real offset.

    An implementation independent of the fusor: prefix caching is num_chunks=1, full KV reuse all chunks.
    """
    from transformers import DynamicCache

    from cacheblend_rag.models import rotate_keys

    parts = [engine.store.get(engine._key((), prompt.prefix_ids))] if prompt.prefix_ids else []
    parts += [engine.store.get(engine._key(prompt.prefix_ids, ids)) for ids in prompt.chunk_ids[:num_chunks]]
    assert all(p is not None for p in parts), "run a cached mode first so the store holds the chunks"
    cached = sum(p.num_tokens for p in parts)
    cos, sin = engine.lm.rope(torch.arange(cached))
    cache = DynamicCache(config=engine.model.config)
    for layer_idx in range(engine.lm.shape.num_layers):
        k = torch.cat([p.keys[layer_idx] for p in parts], dim=1)
        v = torch.cat([p.values[layer_idx] for p in parts], dim=1)
        cache.update(rotate_keys(k, cos, sin)[None], v[None], layer_idx)
    tail = prompt.input_ids()[cached:]
    with torch.no_grad():
        out = engine.model(
            input_ids=tail[None],
            position_ids=torch.arange(cached, cached + tail.numel())[None],
            past_key_values=cache,
            use_cache=True,
        )
    return out.logits[0, -1].float()


@pytest.fixture(scope="module")
def redis_server():
    """A private redis-server on loopback for the module (skips the tests where none can start)."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_store(redis_server):
    from cacheblend_rag.store.redis_store import RedisStore

    store = RedisStore(redis_server.url, budget_bytes=10 * 1024**2, namespace=f"test-{uuid.uuid4().hex[:8]}")
    yield store
    store.clear()
    store.close()
