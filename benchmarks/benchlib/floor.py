"""What a prefill must cost at least: its FLOPs and the fewest bytes it must move, and the time the device needs for
them at its measured matrix-product rate and copy bandwidth (device/METHOD.md: count the floor first).

The FLOPs are those of the tokens each mode computes on each layer: the projections and the MLP (2 FLOPs per
weight per token), attention of those queries over the keys they see (causal: half the square when all tokens are
computed), and the LM head for the last token. The bytes: the weights, read once per pass over the layers, and the
prompt's KV, written once (computed) or read once (stored). `floor_ms` is the larger of the two times: a prefill
cannot go faster than its arithmetic or its memory traffic allows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    bytes_per_value: int = 2  # bf16

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> Shape:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                   config.num_key_value_heads, head_dim, config.intermediate_size, config.vocab_size,
                   torch.empty(0, dtype=dtype).element_size())  # fmt: skip

    @property
    def layer_weights(self) -> int:
        """Weights of one layer: q, k, v, o and the three MLP matrices."""
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_o + k_v + 3 * self.hidden * self.intermediate

    def kv_bytes(self, tokens: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * tokens * self.bytes_per_value


def prefill_flops(
    shape: Shape, n: int, tail: int, scattered: int = 0, probe: int = 0, probe_share: float = 1.0
) -> float:
    """FLOPs of a prefill of `n` tokens that computes its last `tail` tokens on every layer (all `n` for a full
    prefill, the question for full KV reuse) and `scattered` tokens spread over the prompt (a blend's picks, each
    attending over about half the prompt), plus `probe` last tokens through one more pass over the share
    `probe_share` of the layers (the attention rule's question-only pass)."""

    def layers(tail_tokens: int, spread: int) -> float:
        dense = 2.0 * shape.layer_weights * (tail_tokens + spread)
        # scores and weighted sum: 4 * heads * head_dim FLOPs per (query, key) pair a query sees
        seen = tail_tokens * n - tail_tokens * (tail_tokens - 1) / 2 + spread * n / 2
        return shape.layers * (dense + 4.0 * shape.heads * shape.head_dim * seen)

    flops = layers(tail, scattered) + 2.0 * shape.hidden * shape.vocab
    return flops + (probe_share * layers(probe, 0) if probe else 0.0)


def prefill_bytes(shape: Shape, n: int, stored: int, *, passes: float = 1) -> float:
    """Bytes a prefill must move at least: the weights once per pass (a pass over part of the layers counts as that
    share of one), the LM head once, the stored KV read once and the whole prompt's KV written once (a full prefill
    stores nothing: `stored` 0)."""
    weights = shape.layers * shape.layer_weights * shape.bytes_per_value * passes
    head = shape.hidden * shape.vocab * shape.bytes_per_value
    return weights + head + shape.kv_bytes(stored) + shape.kv_bytes(n)


@dataclass(frozen=True)
class DeviceRates:
    flops_per_s: float  # a large bf16 matrix product, measured
    bytes_per_s: float  # a large device-to-device copy (read + write), measured

    def floor_ms(self, flops: float, nbytes: float) -> float:
        return 1000.0 * max(flops / self.flops_per_s, nbytes / self.bytes_per_s)


def measure_rates(device: str, dtype: torch.dtype, *, size: int = 8192, copy_mb: int = 2048) -> DeviceRates:
    """The device's matrix-product rate and copy bandwidth, best of a few runs (on a CPU: small sizes, a rough
    figure only)."""
    if not device.startswith("cuda"):
        size, copy_mb = 1024, 64
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    src = torch.empty(copy_mb * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def best(fn, repeats: int = 5) -> float:
        fn()
        times = []
        for _ in range(repeats):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return min(times)

    matmul_s = best(lambda: torch.matmul(a, b))
    copy_s = best(lambda: dst.copy_(src))
    return DeviceRates(2.0 * size**3 / matmul_s, 2.0 * src.numel() / copy_s)
