"""Bytes a warm request writes with copy operations, counted on a CPU (a dispatch mode; deterministic).

The tiny random 6-layer llama of the shared op counter, 6 chunks of 70 words stored, one request answering with two
tokens (so that it starts decoding): every `copy_`, `index_copy_` and `cat` is summed by the bytes of its output,
per mode. Used to check that a request's prompt KV reaches its decode slot without a copy:

    python research/copied_bytes.py
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cacheblend_rag import BlendConfig, CacheBlendEngine, EngineConfig
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

COPIES = {"copy_", "index_copy_", "cat", "clone"}


class Bytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bytes: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in COPIES and isinstance(out, torch.Tensor):
            # what is written: the source of a copy (`copy_(dst, src)`, `index_copy_(dst, dim, index, src)`), else
            # the whole output
            written = {"copy_": 1, "index_copy_": 3}.get(name)
            source = args[written] if written is not None else out
            self.bytes[name] += source.numel() * out.element_size()
        return out


def main() -> None:
    torch.set_num_threads(1)
    engine = CacheBlendEngine(make_tiny_model("llama", 0, num_layers=6, mute_eos=True), make_tiny_tokenizer(),
                              config=EngineConfig(miss_policy="blend", dtype="float32"))  # fmt: skip
    chunks = [random_words(i, 70) for i in range(6)]
    question = "w1 w2 w3 w4 w5"
    engine.precompute(chunks, question)
    prompt = engine.build_prompt(chunks, question)
    s = engine.lm.shape
    kv_bytes = 2 * s.num_layers * s.num_kv_heads * prompt.num_tokens * s.head_dim * 4
    print(f"prompt {prompt.num_tokens} tokens: its KV is {kv_bytes / 1e6:.2f} MB")
    modes = {"reuse": dict(mode="reuse"), "blend (default)": {},
             "paper": dict(blend=BlendConfig(rule="paper", recompute_ratio=0.15))}  # fmt: skip
    for name, options in modes.items():
        engine.generate(prompt, max_new_tokens=2, stop=[], **options)
        mode = Bytes()
        with mode:
            engine.generate(prompt, max_new_tokens=2, stop=[], **options)
        total = sum(mode.bytes.values())
        print(
            f"{name:16s} copied {total / 1e6:6.2f} MB = {total / kv_bytes:4.2f} x the prompt's KV  {dict(mode.bytes)}"
        )
    engine.close()


if __name__ == "__main__":
    main()
