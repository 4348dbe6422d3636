"""Sizing a chunk store from a corpus and sample questions alone: bytes per chunk, and per budget the hit rate and
the expected speed-up of time to first token over full prefill. No model runs: retrieval is real, the store is
simulated (`simulate.StoreSimulator`), time comes from a `CostModel` measured once on the serving machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .costs import CostModel
from .simulate import StoreSimulator, run_stream
from .streams import StreamSummary, stream_order, summarize

if TYPE_CHECKING:
    from ..retrieval import ChunkIndex

DEFAULT_SHARES = (0.05, 0.10, 0.25, 0.50, 1.00)
UNBOUNDED = None  # a budget share of None: a store that never evicts


@dataclass(frozen=True)
class KVShape:
    """What sizes a token's stored KV: the model's layers, KV heads, head size and dtype, and the tier's codec."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    codec: str = "native"  # the memory tier's default

    @classmethod
    def of_config(cls, config: Any, dtype: str = "float32", codec: str = "native") -> KVShape:
        """From a Hugging Face model config (Llama / Mistral / Qwen2 / Qwen3)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim,
                   dtype, codec)  # fmt: skip

    @property
    def bytes_per_token(self) -> float:
        from ..config import torch_dtype
        from ..store.codec import get_codec, stored_bytes_per_token

        return stored_bytes_per_token(get_codec(self.codec), self.num_layers, self.num_kv_heads, self.head_dim,
                                      torch_dtype(self.dtype))  # fmt: skip


@dataclass(frozen=True)
class PromptLengths:
    """Token counts of the parts of each request's prompt, as the engine tokenizes them."""

    prefix: int  # the shared prefix (system message and instruction)
    chunks: tuple[int, ...]  # each chunk with its separator
    suffixes: tuple[int, ...]  # each question with the chat template's tail


def prompt_lengths(tokenizer: Any, chunks: Sequence[str], questions: Sequence[str], *, template: Any = None,
                   separator: str = "\n\n") -> PromptLengths:  # fmt: skip
    """`PromptLengths` of a corpus and its questions under the engine's default template (or `template`)."""
    from ..engine.request.prompt import PromptTemplate, tokenize_chunks, tokenize_request

    template = template or PromptTemplate()
    chunk_ids = tokenize_chunks(tokenizer, list(chunks), separator)
    prefix, suffixes = 0, []
    for q in questions:
        prompt = tokenize_request(tokenizer, template, [], q, None, None, separator)
        prefix = len(prompt.prefix_ids)
        suffixes.append(len(prompt.suffix_ids))
    return PromptLengths(prefix, tuple(map(len, chunk_ids)), tuple(suffixes))


def retrieve(index: ChunkIndex, questions: Sequence[str], k: int) -> list[list[int]]:
    """Each question's top-k chunks, as indexes into `index.chunks`, best first."""
    position = {id(c): i for i, c in enumerate(index.chunks)}
    return [[position[id(h.chunk)] for h in hits] for hits in index.search_many(questions, k)]


@dataclass(frozen=True)
class BudgetRow:
    share: float | None  # of the corpus's KV (one entry per chunk); None: unbounded
    budget_bytes: int
    summary: StreamSummary


@dataclass(frozen=True)
class StorePlan:
    """What `plan_store` found: entry sizes, and the simulated stream's hit rate and speed-up per budget."""

    chunks: int
    questions: int
    bytes_per_token: float
    chunk_bytes: tuple[int, ...]  # each chunk's entry
    rows: tuple[BudgetRow, ...]
    costs: CostModel
    eviction: str
    stream: str
    seconds: dict[str, float] = field(default_factory=dict)  # time each step took

    @property
    def corpus_bytes(self) -> int:
        return sum(self.chunk_bytes)


def simulate_budgets(
    requests: Sequence[Sequence[int]], lengths: PromptLengths, shape: KVShape, costs: CostModel, *,
    shares: Sequence[float | None] = (*DEFAULT_SHARES, UNBOUNDED), eviction: str = "lru",
    miss_policy: str = "auto", chunk_context: str = "grouped",
) -> list[BudgetRow]:  # fmt: skip
    """One simulated run of `requests` (chunk indexes per request; `lengths.suffixes[i]` is request i's question)
    per budget share of the corpus's KV."""
    bpt = shape.bytes_per_token
    corpus = sum(round(bpt * t) for t in lengths.chunks)
    rows = []
    for share in shares:
        budget = 2**62 if share is None else int(share * corpus)
        sim = StoreSimulator(lengths.chunks, prefix_tokens=lengths.prefix, bytes_per_token=bpt, budget_bytes=budget,
                             num_layers=shape.num_layers, costs=costs, eviction=eviction, miss_policy=miss_policy,
                             chunk_context=chunk_context)  # fmt: skip
        rows.append(BudgetRow(share, budget, summarize(run_stream(sim, requests, lengths.suffixes))))
    return rows


def plan_store(
    index: ChunkIndex, questions: Sequence[str], tokenizer: Any, shape: KVShape, costs: CostModel, *, top_k: int = 5,
    shares: Sequence[float | None] = (*DEFAULT_SHARES, UNBOUNDED), eviction: str = "lru", stream: str = "clustered",
    seed: int = 0,
) -> StorePlan:  # fmt: skip
    """Retrieve every question's top-k chunks from `index`, send them in `stream` order ("clustered": as given,
    "uniform": shuffled with `seed`) through a simulated store at each budget share of the corpus's KV (None: an
    unbounded store), and report hit rates and speed-ups. No model runs."""
    if not questions:
        raise ConfigError("plan_store needs at least one question")
    if stream not in ("clustered", "uniform"):
        raise ConfigError(f"plan_store sends the questions as given ('clustered') or shuffled ('uniform'), got "
                          f"{stream!r}")  # fmt: skip
    t0 = time.perf_counter()
    found = retrieve(index, questions, top_k)
    t1 = time.perf_counter()
    order = stream_order(list(range(len(questions))), stream, seed=seed)
    lengths = prompt_lengths(tokenizer, [c.text for c in index.chunks], questions)
    t2 = time.perf_counter()
    ordered = PromptLengths(lengths.prefix, lengths.chunks, tuple(lengths.suffixes[i] for i in order))
    rows = simulate_budgets([found[i] for i in order], ordered, shape, costs, shares=shares, eviction=eviction)
    t3 = time.perf_counter()
    bpt = shape.bytes_per_token
    took = {"retrieval": t1 - t0, "tokenizing": t2 - t1, "simulation": t3 - t2}
    return StorePlan(len(index), len(questions), bpt, tuple(round(bpt * t) for t in lengths.chunks), tuple(rows),
                     costs, eviction, stream, took)  # fmt: skip


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_plan(plan: StorePlan) -> str:
    """The plan as the `cacheblend-rag plan` command prints it."""
    sizes = plan.chunk_bytes
    lines = [
        f"{plan.chunks} chunks, {plan.questions} questions ({plan.stream} order), eviction {plan.eviction}",
        f"KV per token {plan.bytes_per_token:,.0f} B; per chunk: mean {_size(statistics.mean(sizes))}, median "
        f"{_size(statistics.median(sizes))}, largest {_size(max(sizes))}; whole corpus {_size(plan.corpus_bytes)} "
        "(one entry per chunk)",
        f"cost model: {plan.costs.model or 'unnamed model'} {plan.costs.dtype} on {plan.costs.machine or 'unknown'}",
        "",
        f"{'budget':>16}  {'of corpus':>9}  {'hit rate':>8}  {'mean TTFT':>9}  {'full prefill':>12}  {'speed-up':>8}",
    ]
    for row in plan.rows:
        s = row.summary
        budget = "unbounded" if row.share is None else _size(row.budget_bytes)
        share = "-" if row.share is None else f"{row.share:.0%}"
        lines.append(f"{budget:>16}  {share:>9}  {s.hit_rate:8.1%}  {s.mean_ttft_s * 1000:7.0f}ms  "
                     f"{s.mean_full_s * 1000:10.0f}ms  {s.speedup:7.2f}x")  # fmt: skip
    took = ", ".join(f"{k} {v:.1f}s" for k, v in plan.seconds.items())
    lines.append(f"\n(no model run; {took})")
    return "\n".join(lines)
