"""Request planning: from a tokenized prompt and the blend settings to the `FusionPlan` the fusor runs.

Pure functions of token counts and (for the "attention" rule) attention scores, so every rule's choice of
tokens can be checked without a model. The three token kinds are the fusor's (see `fusion.fusor`):
- exact: loaded KV used as is (the shared prefix; in static plans also the chunk tokens not chosen);
- reused: loaded KV that check layers may replace (deviation rules only);
- computed: recomputed on every layer (the question, and the chunk tokens a rule chose before the prefill).
A `RatioPolicy` (the loading controller) may choose a request's ratio before its plan is made.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from ...config import BlendConfig
from ...errors import ConfigError
from ...fusion import FusionPlan, anchor_counts, budget, keep_counts, top_scored
from ..request.prompt import TokenizedPrompt


def check_blend(blend: BlendConfig, num_layers: int, name: str = "blend") -> None:
    """ConfigError when a rule's check layers do not exist in a model of `num_layers` layers."""
    if blend.uses_check_layers and blend.check_layers[-1] >= num_layers:
        raise ConfigError(
            f"{name} has layer {blend.check_layers[-1]}, but the model has {num_layers} layers "
            f"(0..{num_layers - 1}); use a rule without check layers, e.g. blend_rule('attention')"
        )


def cold_cost_share(
    prompt: TokenizedPrompt, missing: Sequence[Sequence[int]], blend: BlendConfig | None, num_layers: int
) -> float:
    """The compute of a request whose `missing` chunks are prefilled first, over that of a full prefill, in
    token-layers: each missing chunk prefilled on its own, then the cached prefill (`blend`, or full KV reuse when
    None) as the rule computes it. Above 1, the full prefill is cheaper (the miss policy "auto" runs it then)."""
    n = prompt.num_tokens
    chunk_tokens = sum(len(ids) for ids in prompt.chunk_ids)
    question = len(prompt.suffix_ids)
    cost = sum(len(ids) for ids in missing) * num_layers  # the missing chunks, prefilled on their own
    if blend is None:
        cost += question * num_layers
    else:
        cost += (budget(chunk_tokens, blend.recompute_ratio) + question) * num_layers
        if blend.uses_attention_pass:
            cost += question * blend.probe_layers(num_layers)  # the full-reuse pass reading the question's attention
        if blend.uses_check_layers:
            cost += chunk_tokens * (blend.check_layers[0] + 1)  # every chunk token, up to the first check layer
    return cost / (n * num_layers)


def prefix_and_chunk_masks(prompt: TokenizedPrompt) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ([N] bool of the shared prefix's tokens, [N] bool of the chunks' tokens)"""
    n = prompt.num_tokens
    prefix = np.zeros(n, dtype=bool)  # made on the host with numpy: a plan's masks never touch a device
    prefix[: len(prompt.prefix_ids)] = True
    chunks = np.zeros(n, dtype=bool)
    for start, end in prompt.chunk_spans:
        chunks[start:end] = True
    return torch.from_numpy(prefix), torch.from_numpy(chunks)


def _plan(prompt: TokenizedPrompt, exact: torch.Tensor, reused: torch.Tensor, **checks: object) -> FusionPlan:
    n = prompt.num_tokens
    return FusionPlan(input_ids=prompt.input_ids(), positions=torch.arange(n), exact=exact, reused=reused, **checks)


def reuse_plan(prompt: TokenizedPrompt, loaded_chunks: int | None = None) -> FusionPlan:
    """Every loaded token used as is: the prefix and the first `loaded_chunks` chunks (all when None).

    All chunks give full KV reuse (PromptCache); the first one only gives prefix caching.
    """
    spans = prompt.chunk_spans
    k = len(spans) if loaded_chunks is None else loaded_chunks
    if not 0 <= k <= len(spans):
        raise ConfigError(f"loaded_chunks must be in [0, {len(spans)}], got {k}")
    exact = torch.zeros(prompt.num_tokens, dtype=torch.bool)
    exact[: spans[k - 1][1] if k else len(prompt.prefix_ids)] = True
    return _plan(prompt, exact, torch.zeros_like(exact))


def question_mask(prompt: TokenizedPrompt) -> torch.Tensor:
    """[N] bool: the tokens after the chunks (the question and the chat template's tail)."""
    mask = torch.zeros(prompt.num_tokens, dtype=torch.bool)
    mask[prompt.num_tokens - len(prompt.suffix_ids) :] = True
    return mask


def anchor_mask(prompt: TokenizedPrompt, blend: BlendConfig) -> torch.Tensor:
    """[N] bool: the leading tokens of every chunk that the "epic" rule recomputes."""
    spans = prompt.chunk_spans
    counts = anchor_counts([e - s for s, e in spans], blend.recompute_ratio)
    mask = torch.zeros(prompt.num_tokens, dtype=torch.bool)
    for (start, _), c in zip(spans, counts, strict=True):
        mask[start : start + c] = True
    return mask


def blend_plan(prompt: TokenizedPrompt, blend: BlendConfig, scores: torch.Tensor | None = None) -> FusionPlan:
    """The plan of one blended prefill under the rule in `blend`.

    - "attention": the chunk tokens with the highest `scores` ([N], the question's attention in a full-reuse
      pass) are recomputed on every layer; the other chunk tokens keep their loaded KV.
    - "paper" / "gradual": every chunk token is a candidate; the fusor keeps the most deviating ones on the
      check layers.
    - "epic": the leading tokens of every chunk are recomputed on every layer.
    """
    prefix, chunks = prefix_and_chunk_masks(prompt)
    n_chunk_tokens = sum(e - s for s, e in prompt.chunk_spans)  # from the spans: no read of a tensor
    total = budget(n_chunk_tokens, blend.recompute_ratio)
    if blend.uses_check_layers:
        counts = keep_counts(n_chunk_tokens, blend.schedule())
        return _plan(prompt, prefix, chunks, check_layers=blend.check_layers, keep_counts=counts,
                     deviation=blend.deviation)  # fmt: skip
    if blend.uses_attention_pass:
        if scores is None or scores.shape != (prompt.num_tokens,):
            raise ConfigError(f"the 'attention' rule needs one score per prompt token ({prompt.num_tokens})")
        # chosen where the scores are (a GPU): a top-k of a size known here, nothing read back to the host
        candidates = torch.from_numpy(np.flatnonzero(chunks.numpy())).to(scores.device)
        chosen = top_scored(scores, candidates, total)
        return _plan(prompt, prefix | chunks, torch.zeros_like(chunks), chosen=chosen)
    return chosen_plan(prompt, anchor_mask(prompt, blend))


def chosen_plan(prompt: TokenizedPrompt, chosen: torch.Tensor) -> FusionPlan:
    """The static plan that recomputes exactly the chunk tokens in `chosen` ([N] bool) on every layer, besides
    the question; every other chunk token keeps its loaded KV (what the "attention" and "epic" rules run)."""
    prefix, chunks = prefix_and_chunk_masks(prompt)
    exact = prefix | (chunks & ~chosen)  # chunk tokens not chosen keep their loaded KV
    return _plan(prompt, exact, torch.zeros_like(exact))


class RatioDecisionLike(Protocol):
    ratio: float

    def to_dict(self) -> dict[str, Any]: ...


class RatioPolicy(Protocol):
    """Chooses a request's recompute ratio from what its chunks cost to load (the loading controller, §5.1)."""

    def check_model(self, fingerprint: str, dtype: str) -> None:
        """Raise ConfigError when the policy was made for another model or dtype."""
        ...

    def choose_ratio(
        self, num_tokens: int, bytes_by_tier: Mapping[str, int], hits_by_tier: Mapping[str, int]
    ) -> RatioDecisionLike: ...
