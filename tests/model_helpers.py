"""A tiny Llama's settings and a word-level tokenizer of the same vocabulary, for the model loading tests."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 99}  # fmt: skip


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    words = ["<unk>", "</s>"] + [f"w{i}" for i in range(97)]  # 99 entries, matching vocab_size
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
