"""Request planning: from a tokenized prompt and the blend settings to the `FusionPlan` the fusor runs.

Pure functions of token counts and (for query-aware selection) attention scores, so every rule's choice of
tokens can be checked without a model. The three token kinds are the fusor's (see `fusion.fusor`):
- exact: loaded KV used as is (the shared prefix; in static plans also the chunk tokens not chosen);
- reused: loaded KV that check layers may replace (deviation rules only);
- computed: recomputed on every layer (the question, chunk-start anchors, tokens chosen before the prefill).
"""

from __future__ import annotations

import torch

from ..config import BlendConfig, PrefillMode
from ..errors import ConfigError
from ..fusion import FusionPlan, anchor_counts, budget, keep_counts, top_scored, top_scored_per_group
from .prompt import TokenizedPrompt


def check_blend(blend: BlendConfig, num_layers: int, name: str = "blend") -> None:
    """ConfigError when a rule's check layers do not exist in a model of `num_layers` layers."""
    if blend.uses_check_layers and blend.check_layers[-1] >= num_layers:
        raise ConfigError(
            f"{name} has layer {blend.check_layers[-1]}, but the model has {num_layers} layers "
            f"(0..{num_layers - 1}); use smaller check_layers"
        )


def check_token_scores(scores: object, prompt: TokenizedPrompt, mode: PrefillMode, blend: BlendConfig) -> torch.Tensor:
    """Caller-given token scores as a float32 [N] tensor on the CPU; ConfigError when they cannot rank this
    prompt's chunk tokens under this request (wrong mode, a rule without an attention pass, shape, NaN)."""
    if mode is not PrefillMode.BLEND:
        raise ConfigError(f"token_scores rank the tokens a blend recomputes; mode {mode.value!r} recomputes none")
    if not blend.uses_attention_pass:
        raise ConfigError(
            f"token_scores replace the question's attention pass, which selection {blend.selection!r} does not "
            "have; use a rule with one, e.g. blend_rule('attention', r)"
        )
    if not isinstance(scores, torch.Tensor) or scores.shape != (prompt.num_tokens,):
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ConfigError(f"token_scores must be a tensor of shape ({prompt.num_tokens},), one per token, got {shape}")
    out = scores.detach().float().cpu()
    if not bool(torch.isfinite(out).all()):
        raise ConfigError("token_scores must be finite numbers (no NaN or inf)")
    return out


def prefix_and_chunk_masks(prompt: TokenizedPrompt) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ([N] bool of the shared prefix's tokens, [N] bool of the chunks' tokens)"""
    n = prompt.num_tokens
    prefix = torch.zeros(n, dtype=torch.bool)
    prefix[: len(prompt.prefix_ids)] = True
    chunks = torch.zeros(n, dtype=torch.bool)
    for start, end in prompt.chunk_spans:
        chunks[start:end] = True
    return prefix, chunks


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
    """[N] bool: the leading tokens of every chunk that the rule's anchor share recomputes."""
    spans = prompt.chunk_spans
    counts = anchor_counts([e - s for s, e in spans], blend.recompute_ratio, blend.anchor_share)
    mask = torch.zeros(prompt.num_tokens, dtype=torch.bool)
    for (start, _), c in zip(spans, counts, strict=True):
        mask[start : start + c] = True
    return mask


def attention_picks(
    prompt: TokenizedPrompt, blend: BlendConfig, scores: torch.Tensor, candidates: torch.Tensor, count: int
) -> torch.Tensor:
    """The `count` candidates ([N] bool mask) with the highest attention scores, per chunk with `per_chunk`.
    -> [count] token indices, ascending."""
    idx = candidates.nonzero().squeeze(1)
    scores = scores.float().cpu()
    if not blend.per_chunk:
        return top_scored(scores, idx, count)
    chunk_of = torch.full((prompt.num_tokens,), -1, dtype=torch.long)
    for i, (start, end) in enumerate(prompt.chunk_spans):
        chunk_of[start:end] = i
    return top_scored_per_group(scores, idx, chunk_of[idx], count)


def blend_plan(prompt: TokenizedPrompt, blend: BlendConfig, scores: torch.Tensor | None = None) -> FusionPlan:
    """The plan of one blended prefill under the rule in `blend`.

    `scores` ([N], higher = recompute first) are needed by the rules with an attention pass, which pick (some of)
    their tokens before the prefill; deviation rules pick theirs on the check layers, inside the fusor. Tokens
    chosen before the prefill, like anchors, are computed on every layer.
    """
    prefix, chunks = prefix_and_chunk_masks(prompt)
    anchors = anchor_mask(prompt, blend)
    total = budget(int(chunks.sum()), blend.recompute_ratio)
    free = total - int(anchors.sum())  # budget left after the anchors
    rest = chunks & ~anchors  # chunk tokens the ranking chooses from

    if blend.uses_attention_pass and (scores is None or scores.shape != (prompt.num_tokens,)):
        raise ConfigError(f"the {blend.selection!r} selection needs one score per prompt token ({prompt.num_tokens})")
    if blend.selection == "attention|deviation":  # half of the free budget by attention, now
        picked = torch.zeros_like(chunks)
        picked[attention_picks(prompt, blend, scores, rest, free // 2)] = True  # type: ignore[arg-type]
        anchors, rest = anchors | picked, rest & ~picked
    if blend.uses_check_layers:
        counts = keep_counts(int(chunks.sum()), blend.schedule())
        n_rest = int(rest.sum())
        kept = tuple(min(n_rest, max(0, c - int(anchors.sum()))) for c in counts)
        combine = {"deviation+attention": "sum", "deviation*attention": "product"}.get(blend.selection)
        query = question_mask(prompt) if combine else None
        return _plan(
            prompt, prefix, rest, check_layers=blend.check_layers, keep_counts=kept, deviation=blend.deviation,
            query=query, combine=combine or "sum",
        )  # fmt: skip

    chosen = torch.zeros_like(chunks)
    if blend.selection == "attention":
        chosen[attention_picks(prompt, blend, scores, rest, free)] = True  # type: ignore[arg-type]
    # "none" (and what "attention" did not choose): chunk tokens outside the anchors keep their loaded KV
    exact = prefix | (chunks & ~anchors & ~chosen)
    return _plan(prompt, exact, torch.zeros_like(exact))
