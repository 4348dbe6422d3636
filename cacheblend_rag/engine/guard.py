"""The fidelity guard: per-request risk signals of a blend, and escalation to a larger recompute budget.

The "attention" rule's first pass reuses every chunk's KV and computes only the question, so it ends with the
first-token distribution of full KV reuse, for free. Comparing the blend's first token with it says how much the
recomputed tokens changed the answer: where they changed it a lot, the tokens left stale may change it too. The
signals (`first_token_signals`):
- `kl_reuse`: KL(blend || reuse) of the first token, in nats;
- `agree_reuse`: whether blend and reuse pick the same first token;
- `margin`: the blend's top-1 minus top-2 probability of the first token;
- `reuse_margin`: the same margin of full KV reuse's first token (known before any token is recomputed);
- `stale_attention`: the share of the question's attention on chunk tokens that were not recomputed.

With a `Guard`, a request whose blend looks risky is blended again at the next ratio of the ladder, over the same
first pass (its KV and the question's attention are reused), until two successive blends agree or the ladder ends;
a ratio of 1.0 recomputes every chunk token, which equals a full prefill. Which signal and threshold keep a chosen
fidelity at the least cost is a measurement (`benchmarks/guard_signals.py`), not a guess built in here.
"""

from __future__ import annotations

from typing import Any

import torch


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) in nats between the softmax distributions of two [vocab] logit vectors."""
    logp = torch.log_softmax(p_logits.float(), dim=-1)
    logq = torch.log_softmax(q_logits.float(), dim=-1)
    return float((logp.exp() * (logp - logq)).sum().clamp_min(0.0))


def top2_margin(logits: torch.Tensor) -> float:
    """The top-1 minus top-2 probability of the softmax of a [vocab] logit vector."""
    top2 = torch.topk(torch.softmax(logits.float(), dim=-1), 2).values
    return float(top2[0] - top2[1])


def first_token_signals(
    blend_logits: torch.Tensor,
    reuse_logits: torch.Tensor,
    attention: torch.Tensor,
    chunk_tokens: torch.Tensor,
    recomputed: torch.Tensor,
) -> dict[str, Any]:
    """The risk signals of one blend. logits: [vocab]; attention: [N], the question's mean attention on each token
    in the first pass; chunk_tokens, recomputed: [N] bool (the chunk tokens; those the blend recomputed)."""
    on_chunks = float(attention[chunk_tokens].sum())
    stale = float(attention[chunk_tokens & ~recomputed].sum())
    return {
        "kl_reuse": kl(blend_logits, reuse_logits),
        "agree_reuse": bool(int(blend_logits.argmax()) == int(reuse_logits.argmax())),
        "margin": top2_margin(blend_logits),
        "reuse_margin": top2_margin(reuse_logits),
        "stale_attention": stale / on_chunks if on_chunks > 0 else 0.0,
    }


def agrees(new_logits: torch.Tensor, old_logits: torch.Tensor, max_kl: float) -> bool:
    """Whether two successive blends agree: the same first token, and KL(new || old) at most `max_kl`."""
    return int(new_logits.argmax()) == int(old_logits.argmax()) and kl(new_logits, old_logits) <= max_kl
