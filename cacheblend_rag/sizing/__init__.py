"""Sizing a chunk store for real traffic without running the model: a simulated store fed by real retrieval, and a
cost model of time to first token measured once on the serving machine.

- `costs`: `CostModel` (full prefill, warm blend and one chunk's prefill as functions of tokens), `measure_costs`;
- `simulate`: `StoreSimulator`, the engine's store traffic per request on a real `MemoryStore` of size-only entries;
- `streams`: the orders questions arrive in (clustered, uniform, zipf) and what a stream adds up to;
- `plan`: `plan_store`, the sizing report `cacheblend-rag plan` prints.
"""

from .costs import REFERENCE_COSTS, CostModel, Curve, machine_name, measure_costs
from .plan import (
    DEFAULT_SHARES,
    BudgetRow,
    KVShape,
    PromptLengths,
    StorePlan,
    format_plan,
    plan_store,
    prompt_lengths,
    retrieve,
    simulate_budgets,
)
from .simulate import SimRequest, StoreSimulator, run_stream
from .streams import STREAMS, StreamSummary, stream_order, summarize

__all__ = [
    "DEFAULT_SHARES",
    "REFERENCE_COSTS",
    "STREAMS",
    "BudgetRow",
    "CostModel",
    "Curve",
    "KVShape",
    "PromptLengths",
    "SimRequest",
    "StorePlan",
    "StoreSimulator",
    "StreamSummary",
    "format_plan",
    "machine_name",
    "measure_costs",
    "plan_store",
    "prompt_lengths",
    "retrieve",
    "run_stream",
    "simulate_budgets",
    "stream_order",
    "summarize",
]
