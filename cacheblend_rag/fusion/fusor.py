"""The fusion step: a prefill that reuses loaded KV and recomputes only selected tokens, layer by layer.

Every prompt token is one of three kinds (a `FusionPlan`):
- exact:    its loaded KV is what a full prefill would compute (the shared prefix). Never recomputed.
- reused:   its loaded KV was computed without the other chunks (a chunk's tokens). Recomputed if selected.
- computed: no loaded KV (the question, the chat template's tail). Always recomputed.

Layers before the first check layer recompute every non-exact token. On each check layer the fresh K/V of the
remaining candidates are compared with the loaded ones and only the most deviating reused tokens are kept
(gradual filtering). Later layers recompute only the kept tokens. On every layer, the fresh K/V of recomputed
tokens overwrite the loaded ones, and recomputed queries attend to all keys under a causal mask built from true
positions. With every reused token kept this is a full prefill; with none kept it is full KV reuse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import CacheBlendError
from ..models.adapter import LayerwiseModel, causal_mask, rotate_keys
from .selection import select_recompute_tokens, token_deviation

# layer_idx -> (raw keys [Hkv, N, D], values [Hkv, N, D]) of all N prompt tokens, loaded KV where there is
# some (anything, e.g. zeros, for computed tokens). The fusor may write into the returned tensors.
LayerLoader = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class FusionPlan:
    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64, true positions (normally 0..N-1)
    exact: torch.Tensor  # [N] bool
    reused: torch.Tensor  # [N] bool, disjoint from exact
    check_layers: tuple[int, ...] = ()
    keep_counts: tuple[int, ...] = ()  # reused tokens kept after each check layer
    deviation: str = "key"  # on check layers, rank by the deviation of "key" or "value"

    def __post_init__(self) -> None:
        n = self.input_ids.shape[0]
        for name in ("positions", "exact", "reused"):
            if getattr(self, name).shape != (n,):
                raise CacheBlendError(f"plan.{name} must have shape ({n},), got {tuple(getattr(self, name).shape)}")
        if bool((self.exact & self.reused).any()):
            raise CacheBlendError("a token cannot be both exact and reused")
        if self.deviation not in ("key", "value"):
            raise CacheBlendError(f"plan.deviation must be 'key' or 'value', got {self.deviation!r}")
        if len(self.check_layers) != len(self.keep_counts):
            raise CacheBlendError(
                f"one keep count per check layer: {len(self.check_layers)} layers, {len(self.keep_counts)} counts"
            )
        if self.positions.numel() > 1 and bool((self.positions[1:] <= self.positions[:-1]).any()):
            raise CacheBlendError("plan.positions must be strictly increasing (tokens in prompt order)")
        if bool(self.exact[-1]) or bool(self.reused[-1]):
            raise CacheBlendError("the prompt's last token must be computed (its hidden state gives the logits)")


@dataclass
class FusionResult:
    keys: list[torch.Tensor]  # per layer, rotated [Hkv, N, D]: ready for the decode cache
    values: list[torch.Tensor]  # per layer [Hkv, N, D]
    raw_keys: list[torch.Tensor] | None  # per layer, before RoPE, when asked for
    logits: torch.Tensor | None  # [vocab] float32, of the last token, when asked for
    recomputed_per_layer: list[int]  # tokens whose KV was recomputed on each layer
    selected_positions: torch.Tensor  # [R] positions recomputed on the last layer
    attention: torch.Tensor | None = None  # [N] float32: mean attention paid to each token, when asked for


def attention_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The causal mask of scattered queries ([A] positions over [N]) for one masked attention call: additive
    (0 / -inf) in the attention's dtype, so the kernel need not convert a boolean one on every layer. -> [A, N]"""
    allowed = causal_mask(q_positions, k_positions)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def attend_blocks(
    lm: LayerwiseModel,
    layer_idx: int,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    block_size: int,
    *,
    as_tail: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of scattered queries, grouped by position so that no group reads keys it cannot see.

    A single masked call would score every query against every key; selected queries sit all over the
    prompt, so half of that work would be masked away. Grouping the queries into position blocks and cutting
    the keys at each block's last position keeps the waste to about half a block per query.
    With `block_size` 0 (a GPU) the queries attend in one call instead: `as_tail` (the caller knows they are the
    prompt's last tokens, in order) as the tail of the causal square with no mask, the kernel skipping the scores
    above the diagonal; else under `mask` (`attention_mask`, which a caller builds once for a set of queries and
    passes on every layer), built here when none is given.
    query: [H, A, D]; keys, values: [Hkv, N, D]; q_positions: [A] ascending; k_positions: [N] ascending.
    Returns [A, hidden].
    """
    if q_positions.numel() == k_positions.numel():
        return lm.attend(layer_idx, query, keys, values, None)  # every token in order: the causal square
    if block_size <= 0:  # one call: on a GPU the wasted scores cost less than the blocks' host syncs
        if as_tail:
            return lm.attend(layer_idx, query, keys, values, None)
        if mask is None:
            mask = attention_mask(q_positions, k_positions, query.dtype)
        return lm.attend(layer_idx, query, keys, values, mask)
    block_ids = torch.div(q_positions, block_size, rounding_mode="floor")
    _, sizes = torch.unique_consecutive(block_ids, return_counts=True)
    outs, start = [], 0
    for size in sizes.tolist():
        q_pos = q_positions[start : start + size]
        end = int(torch.searchsorted(k_positions, q_pos[-1], right=True))  # keys at positions <= the block's last
        mask = causal_mask(q_pos, k_positions[:end])  # [size, end]
        outs.append(lm.attend(layer_idx, query[:, start : start + size], keys[:, :end], values[:, :end], mask))
        start += size
    return torch.cat(outs, dim=0)


@torch.inference_mode()
def fuse(
    lm: LayerwiseModel,
    plan: FusionPlan,
    load_layer: LayerLoader,
    *,
    want_logits: bool = True,
    keep_raw_keys: bool = False,
    block_size: int | None = None,
    attention_from: torch.Tensor | None = None,
    after_layer: Callable[[int], None] | None = None,
) -> FusionResult:
    """Run the blended prefill of one prompt. See the module docstring for the rule.

    `block_size`: queries are attended in groups of this many positions (see `attend_blocks`); 0 attends them in
    one call (unmasked as the tail of the causal square when they are the prompt's last tokens). By default 512
    on a CPU, where the masked-away half of the scores is real work, and 0 on a GPU, where each block costs a host
    synchronization and a dozen kernel launches.
    `attention_from`: [N] bool, tokens (computed on every layer, e.g. the question) whose attention to every
    token is averaged over heads, these queries and all layers but the last into `FusionResult.attention`. When
    they are all the tokens being recomputed (full KV reuse's question), their attention output is taken from
    those same probabilities, so the keys are read once per layer, not twice.
    `after_layer(layer_idx)` runs when a layer is done (the scheduler decodes other requests there); it must not
    touch this prompt's tensors.
    """
    num_layers = lm.shape.num_layers
    if plan.check_layers and plan.check_layers[-1] >= num_layers:
        raise CacheBlendError(
            f"check layer {plan.check_layers[-1]} does not exist: "
            f"the model has {num_layers} layers (0..{num_layers - 1})"
        )
    device = lm.device
    if block_size is None:
        block_size = 512 if device.type == "cpu" else 0
    positions = plan.positions.to(device)
    cos, sin = lm.rope(positions)  # [N, D]
    exact = plan.exact.to(device)
    reused = plan.reused.to(device)
    checks = dict(zip(plan.check_layers, plan.keep_counts, strict=True))
    attn_rows = None if attention_from is None else attention_from.to(device)
    attn_sum = torch.zeros(positions.shape[0], dtype=torch.float32, device=device)
    attn_layers = 0

    active = (~exact).nonzero().squeeze(1)  # [A] indices of tokens being recomputed
    # Whether the computed tokens are the prompt's last ones (no exact token after them), worked out on the host
    # once: then `active` is that tail whenever no check layer has dropped a token.
    computed = ~plan.exact.cpu()
    n_computed = int(computed.sum())
    tail = bool(computed[computed.numel() - n_computed :].all())
    mask_for: torch.Tensor | None = None  # the `active` whose one-call attention mask (`layer_mask`) is built
    layer_mask: torch.Tensor | None = None
    hidden = lm.embed(plan.input_ids.to(device)[active])  # [A, hidden]
    last = positions.shape[0] - 1

    keys_out: list[torch.Tensor] = []
    values_out: list[torch.Tensor] = []
    raw_out: list[torch.Tensor] | None = [] if keep_raw_keys else None
    counts: list[int] = []
    probe_for: torch.Tensor | None = None  # the `active` whose attention rows (`rows`, `mask`) are computed

    for layer_idx in range(num_layers):
        raw_k, v = load_layer(layer_idx)  # [Hkv, N, D] each
        x = lm.normed_input(layer_idx, hidden)  # [A, hidden]
        fresh_k, fresh_v = lm.project_kv(layer_idx, x)  # [Hkv, A, D]

        if layer_idx in checks:
            is_reused = reused[active]  # [A]
            candidates = is_reused.nonzero().squeeze(1)  # [C] indices into active
            if candidates.numel() > 0:
                cand_tokens = active[candidates]
                if plan.deviation == "key":
                    dev = token_deviation(fresh_k[:, candidates], raw_k[:, cand_tokens])  # [C]
                else:
                    dev = token_deviation(fresh_v[:, candidates], v[:, cand_tokens])  # [C]
                keep = ~is_reused
                keep[candidates[select_recompute_tokens(dev, checks[layer_idx])]] = True
                active, hidden, x = active[keep], hidden[keep], x[keep]
                fresh_k, fresh_v = fresh_k[:, keep], fresh_v[:, keep]

        raw_k[:, active] = fresh_k
        v[:, active] = fresh_v
        keys = rotate_keys(raw_k, cos, sin)  # [Hkv, N, D]
        keys_out.append(keys)
        values_out.append(v)
        if raw_out is not None:
            raw_out.append(raw_k)
        counts.append(int(active.numel()))
        selected = active

        if layer_idx == num_layers - 1 and not want_logits:
            continue  # nothing reads the last layer's output
        if layer_idx == num_layers - 1:
            # Only the last token's output is needed from the last layer; its K/V are already stored above.
            active, hidden, x = active[-1:], hidden[-1:], x[-1:]
        query = lm.project_q(layer_idx, x, cos[active], sin[active])  # [H, A, D]
        attn_out = None
        if attn_rows is not None and layer_idx < num_layers - 1:
            if probe_for is not active:  # the rows change with `active` only (a host sync on a GPU: once each)
                probe_for = active
                rows = attn_rows[active].nonzero().squeeze(1)  # [Q] indices into active
                mask = causal_mask(positions[active[rows]], positions)  # [Q, N]
            if rows.numel() > 0:
                probs = lm.attention_weights(layer_idx, query[:, rows], keys, mask)  # [H, Q, N]
                attn_sum += probs.mean(dim=(0, 1))
                attn_layers += 1
                if rows.numel() == active.numel():  # every query is recorded: their output from the same weights
                    attn_out = lm.attend_from_weights(layer_idx, probs, v)
        if attn_out is None:
            # the prompt's tail, and at least half of it: the causal square's padded rows cost less than a mask's waste
            as_tail = tail and active.numel() == n_computed and 2 * active.numel() > last
            if block_size <= 0 and not as_tail and mask_for is not active:
                mask_for, layer_mask = active, attention_mask(positions[active], positions, query.dtype)
            attn_out = attend_blocks(lm, layer_idx, query, keys, v, positions[active], positions, block_size,
                                     as_tail=as_tail, mask=layer_mask if mask_for is active else None)  # fmt: skip
        hidden = lm.finish_layer(layer_idx, hidden, attn_out)
        if after_layer is not None and layer_idx < num_layers - 1:
            after_layer(layer_idx)

    logits = None
    if want_logits:
        if int(active[-1]) != last:
            raise CacheBlendError("internal: the last prompt token was not recomputed")
        logits = lm.logits(hidden[-1:])[0]
    return FusionResult(
        keys=keys_out,
        values=values_out,
        raw_keys=raw_out,
        logits=logits,
        recomputed_per_layer=counts,
        selected_positions=positions[selected],
        attention=None if attn_rows is None else attn_sum / max(attn_layers, 1),
    )
