"""A stream of requests through a byte-bounded chunk store, without a model: which chunks hit, and what each costs.

`StoreSimulator` replays what the engine does to its store for each request, on a real `MemoryStore` whose entries
are size-only stand-ins (tensors on PyTorch's "meta" device: their bytes are counted, none are allocated), so the
store's own accounting and eviction order decide what stays. Per request, as `CacheBlendEngine` does by default
(`EngineConfig(chunk_context="grouped")`, no precompute, the miss policy "auto"):
- each chunk's entry is looked up where the request's plan places it (`engine.chunks.placement`): the first chunk
  reads its isolated entry; a later chunk its captured entry (what an earlier full prefill computed for it), else
  its isolated one;
- when chunks are missing and prefilling them would cost more compute than the whole prompt
  (`engine.prefill.planning.cold_cost_share`), the request is answered by a full prefill, which reads nothing and
  stores afterwards the best entry of every chunk whose best entry is not stored (the first chunk's isolated entry,
  the later chunks' captured ones);
- otherwise the shared prefix and the chunks are read in prompt order; a chunk not found is prefilled alone and
  stored under its isolated entry, then the prompt is blended.
Time to first token comes from a `CostModel`. tests/test_sizing.py checks the hits and misses against a real engine
(on a tiny random model) request by request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..config import BlendConfig
from ..config.engine_config import CHUNK_CONTEXTS, MISS_POLICIES
from ..errors import ConfigError
from ..store import ChunkKV, MemoryStore
from ..store.eviction import EvictionOrder
from .costs import CostModel

PREFIX_KEY = "prefix"


@dataclass(frozen=True)
class SimRequest:
    """What one request did in the simulation."""

    hits: int  # chunks read from the store
    misses: int  # chunks not found (prefilled in the request, or answered by a full prefill)
    mode: str  # "blend" or "full" (a cold request the miss policy answered in full)
    prompt_tokens: int
    ttft_s: float  # the cost model's time to first token
    full_s: float  # the cost model's full prefill of the same prompt
    compute_share: float  # the prefill's compute over a full prefill's (1 for a full prefill)


def _half_entry(nbytes: int) -> torch.Tensor:
    """Keys (or values) of a stand-in entry of `nbytes` bytes in all: a meta tensor, counted, never allocated."""
    return torch.empty((1, 1, 1, max(1, (nbytes + 1) // 2)), dtype=torch.uint8, device="meta")


class StoreSimulator:
    """One store, fed one request at a time (`request`), as an engine with that store would feed it.

    `chunk_tokens[c]`: tokens of chunk c as the engine tokenizes it (its text and the chunk separator);
    `bytes_per_token`: stored bytes per token of an entry (`store.codec.stored_bytes_per_token`);
    `eviction`: the memory tier's policy ("lru", "lfu" or an `EvictionOrder`).
    """

    def __init__(
        self,
        chunk_tokens: Sequence[int],
        *,
        prefix_tokens: int,
        bytes_per_token: float,
        budget_bytes: int,
        num_layers: int,
        costs: CostModel,
        eviction: str | EvictionOrder = "lru",
        miss_policy: str = "auto",
        chunk_context: str = "grouped",
        blend: BlendConfig | None = None,
    ) -> None:
        if miss_policy not in MISS_POLICIES:
            raise ConfigError(f"miss_policy must be one of {', '.join(MISS_POLICIES)}, got {miss_policy!r}")
        if chunk_context not in CHUNK_CONTEXTS:
            raise ConfigError(f"chunk_context must be one of {', '.join(CHUNK_CONTEXTS)}, got {chunk_context!r}")
        if bytes_per_token <= 0 or num_layers < 1:
            raise ConfigError(f"bytes_per_token and num_layers must be positive, got {bytes_per_token}, {num_layers}")
        self.chunk_tokens = tuple(int(t) for t in chunk_tokens)
        self.prefix_tokens = int(prefix_tokens)
        self.bytes_per_token = float(bytes_per_token)
        self.num_layers = num_layers
        self.costs = costs
        self.miss_policy = miss_policy
        self.captures = chunk_context != "isolated"  # the capture policy "all": later chunks read captured entries
        self.blend = blend or BlendConfig()
        self.store = MemoryStore(budget_bytes, eviction=eviction, name="simulated")

    def entry_bytes(self, tokens: int) -> int:
        return round(self.bytes_per_token * tokens)

    def _put(self, key: str, tokens: int) -> None:
        half = _half_entry(self.entry_bytes(tokens))
        self.store.put(ChunkKV(key, half, half))

    def _keys(self, position: int, chunk: int) -> tuple[str, ...]:
        """The entries a chunk at `position` may read, best first; a miss is prefilled into the last."""
        if position == 0 or not self.captures:
            return (f"i{chunk}",)
        return (f"c{chunk}", f"i{chunk}")

    def request(self, chunks: Sequence[int], suffix_tokens: int) -> SimRequest:
        """One request retrieving `chunks` (indexes into `chunk_tokens`, in prompt order) with a question part of
        `suffix_tokens` tokens (the question and the chat template's tail)."""
        from ..engine.prefill.planning import cold_cost_share
        from ..engine.request.prompt import TokenizedPrompt

        chunks = list(dict.fromkeys(chunks))
        lengths = [self.chunk_tokens[c] for c in chunks]
        n = self.prefix_tokens + sum(lengths) + suffix_tokens
        full_s = self.costs.full(n)
        plan = [(j, c, self._keys(j, c)) for j, c in enumerate(chunks)]
        found = [next((k for k in keys if k in self.store), None) for _, _, keys in plan]
        missing = [self.chunk_tokens[c] for (_, c, _), f in zip(plan, found, strict=True) if f is None]
        prompt = TokenizedPrompt((0,) * self.prefix_tokens, tuple((0,) * t for t in lengths), (0,) * suffix_tokens)
        if missing and self.miss_policy != "blend":
            share = cold_cost_share(prompt, [(0,) * t for t in missing], self.blend, self.num_layers)
            if self.miss_policy == "full" or share >= 1.0:
                for (_, c, keys), f in zip(plan, found, strict=True):  # stored from the prefill, after the answer
                    if f != keys[0] and keys[0] not in self.store:
                        self._put(keys[0], self.chunk_tokens[c])
                return SimRequest(len(chunks) - len(missing), len(missing), "full", n, full_s, full_s, 1.0)
        ttft = self.costs.blend(n)
        if self.prefix_tokens:
            if self.store.open(PREFIX_KEY) is None:
                self._put(PREFIX_KEY, self.prefix_tokens)
                ttft += self.costs.chunk(self.prefix_tokens)
        hits = 0
        for _, c, keys in plan:
            if any(self.store.open(k) is not None for k in keys):  # opened in order, the first found is read
                hits += 1
                continue
            self._put(keys[-1], self.chunk_tokens[c])
            ttft += self.costs.chunk(self.chunk_tokens[c])
        share = cold_cost_share(prompt, [], self.blend, self.num_layers)
        return SimRequest(hits, len(chunks) - hits, "blend", n, ttft, full_s, share)


def run_stream(
    simulator: StoreSimulator,
    requests: Sequence[Sequence[int]],
    suffix_tokens: Sequence[int],
    on_request: Callable[[int, SimRequest], None] | None = None,
) -> list[SimRequest]:
    """Every request of a stream, in order, through one simulator."""
    if len(requests) != len(suffix_tokens):
        raise ConfigError(f"got {len(requests)} requests and {len(suffix_tokens)} question lengths")
    out = []
    for i, (chunks, suffix) in enumerate(zip(requests, suffix_tokens, strict=True)):
        result = simulator.request(chunks, suffix)
        out.append(result)
        if on_request is not None:
            on_request(i, result)
    return out
