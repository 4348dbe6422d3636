"""The fidelity guard is `cacheblend_rag.guard` (its policy, signals and escalation loop). This alias stays only
while `benchmarks/benchlib/fidelity_run.py` imports `kl` from here; delete it once that import names
`cacheblend_rag.guard`."""

from ..guard import agrees, first_token_signals, kl, top2_margin

__all__ = ["agrees", "first_token_signals", "kl", "top2_margin"]
