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

The prompt's KV lives in one `PromptKV` per request (stored keys rotated there once); the fusor writes the recomputed
tokens' KV into it in place. Nothing in the layer loop reads a tensor back to the host: a plan's indices and counts
are worked out before it (`FusionPlan`), and a check layer keeps a top-k of a size known in advance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import CacheBlendError
from ..models.adapter import LayerwiseModel, causal_mask, rope_rotate
from .layer_events import LayerEvents
from .layer_rows import EagerLayerSteps, LayerSteps
from .prompt_kv import PromptKV
from .selection import select_recompute_tokens, token_deviation


@dataclass(frozen=True)
class FusionPlan:
    """Which tokens a fused prefill recomputes. The masks live on the host and everything the fusor needs from them
    (indices, counts, whether the recomputed tokens are the prompt's tail) is worked out here once, so the layer
    loop never reads a tensor back from the device; `chosen` may live on the device (a rule's choice made there)."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64, true positions (normally 0..N-1)
    exact: torch.Tensor  # [N] bool
    reused: torch.Tensor  # [N] bool, disjoint from exact
    check_layers: tuple[int, ...] = ()
    keep_counts: tuple[int, ...] = ()  # reused tokens kept after each check layer
    deviation: str = "key"  # on check layers, rank by the deviation of "key" or "value"
    # [K] indices, ascending, of tokens marked exact that are recomputed on every layer all the same: a rule's
    # choice made on the device (from the question's attention), which the host need not read; None: none
    chosen: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.input_ids.shape[0]
        for name in ("positions", "exact", "reused"):
            if getattr(self, name).shape != (n,):
                raise CacheBlendError(f"plan.{name} must have shape ({n},), got {tuple(getattr(self, name).shape)}")
        exact, reused = self.exact.cpu().numpy(), self.reused.cpu().numpy()  # host masks: numpy, not device ops
        positions = self.positions.cpu().numpy()
        if (exact & reused).any():
            raise CacheBlendError("a token cannot be both exact and reused")
        if self.deviation not in ("key", "value"):
            raise CacheBlendError(f"plan.deviation must be 'key' or 'value', got {self.deviation!r}")
        if len(self.check_layers) != len(self.keep_counts):
            raise CacheBlendError(
                f"one keep count per check layer: {len(self.check_layers)} layers, {len(self.keep_counts)} counts"
            )
        if n > 1 and (positions[1:] <= positions[:-1]).any():
            raise CacheBlendError("plan.positions must be strictly increasing (tokens in prompt order)")
        if exact[-1] or reused[-1]:
            raise CacheBlendError("the prompt's last token must be computed (its hidden state gives the logits)")
        if self.chosen is not None and (self.check_layers or self.chosen.dim() != 1):
            raise CacheBlendError("plan.chosen is a [K] index tensor, for a plan without check layers")
        computed = np.flatnonzero(~exact)  # recomputed from the first layer on (besides `chosen`)
        object.__setattr__(self, "computed", computed)
        object.__setattr__(self, "candidates", np.flatnonzero(reused[computed]))  # indices into `computed`
        # the recomputed tokens are the prompt's last ones, in order (then no mask is needed while all are kept)
        object.__setattr__(self, "tail", self.chosen is None and int(computed[0]) == n - computed.size)

    computed: np.ndarray = field(init=False, repr=False, compare=False)
    candidates: np.ndarray = field(init=False, repr=False, compare=False)
    tail: bool = field(init=False, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class FusionResult:
    kv: PromptKV  # the prompt's KV after the prefill, every layer: what the decode cache takes
    logits: torch.Tensor | None  # [vocab] float32, of the last token, when asked for
    recomputed_per_layer: list[int]  # tokens whose KV was recomputed on each layer
    selected_positions: torch.Tensor  # [R] positions recomputed on the last layer
    attention: torch.Tensor | None = None  # [N] float32: mean attention paid to each token, when asked for
    hidden: torch.Tensor | None = None  # [hidden]: the last token's output of the last layer, with `logits_later`

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer, rotated keys [Hkv, N, D] (views of `kv`)."""
        return [self.kv.keys[i] for i in range(self.kv.num_layers)]

    @property
    def values(self) -> list[torch.Tensor]:
        """Per layer, values [Hkv, N, D] (views of `kv`)."""
        return [self.kv.values[i] for i in range(self.kv.num_layers)]

    @property
    def raw_keys(self) -> list[torch.Tensor] | None:
        """Per layer, keys before RoPE [Hkv, N, D], when the prompt's KV keeps them (`PromptKV(keep_raw=True)`)."""
        raw = self.kv.raw_keys
        return None if raw is None else [raw[i] for i in range(raw.shape[0])]


def attention_mask(
    q_positions: torch.Tensor, k_positions: torch.Tensor, dtype: torch.dtype, window: int | None = None
) -> torch.Tensor:
    """The causal mask of scattered queries ([A] positions over [N]) for one masked attention call, within a layer's
    sliding `window` if it has one: additive (0 / -inf) in the attention's dtype, so the kernel need not convert a
    boolean one on every layer. -> [A, N]"""
    allowed = causal_mask(q_positions, k_positions, window)
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
    passes on every layer of the same window), built here when none is given. A windowed layer's masks hold its
    window (`LayerwiseModel.window`); unmasked calls get it from the adapter.
    query: [H, A, D]; keys, values: [Hkv, N, D], or [1, Hkv, N, D] (`PromptKV.batched`, views made once);
    q_positions: [A] ascending; k_positions: [N] ascending. Returns [A, hidden].
    """
    if q_positions.numel() == k_positions.numel():
        return lm.attend(layer_idx, query, keys, values, None)  # every token in order: the causal square
    if block_size <= 0:  # one call: on a GPU the wasted scores cost less than the blocks' host syncs
        if as_tail:
            return lm.attend(layer_idx, query, keys, values, None)
        if mask is None:
            mask = attention_mask(q_positions, k_positions, query.dtype, lm.window(layer_idx))
        return lm.attend(layer_idx, query, keys, values, mask)
    block_ids = torch.div(q_positions, block_size, rounding_mode="floor")
    _, sizes = torch.unique_consecutive(block_ids, return_counts=True)
    outs, start = [], 0
    for size in sizes.tolist():
        q_pos = q_positions[start : start + size]
        end = int(torch.searchsorted(k_positions, q_pos[-1], right=True))  # keys at positions <= the block's last
        mask = causal_mask(q_pos, k_positions[:end], lm.window(layer_idx))  # [size, end]
        q, k, v = query[:, start : start + size], keys[..., :end, :], values[..., :end, :]
        outs.append(lm.attend(layer_idx, q, k, v, mask))
        start += size
    return torch.cat(outs, dim=0)


@torch.inference_mode()
def logits_of(lm: LayerwiseModel, results: Sequence[FusionResult]) -> None:
    """Set the logits of results fused with `logits_later` from their `hidden`, in one LM head product."""
    hidden = [r.hidden for r in results if r.hidden is not None]
    if len(hidden) != len(results):
        raise CacheBlendError("logits_of takes results fused with logits_later=True that ran their last layer")
    for r, logits in zip(results, lm.logits(torch.stack(hidden)), strict=True):
        r.logits, r.hidden = logits, None


@torch.inference_mode()
def fuse(
    lm: LayerwiseModel,
    plan: FusionPlan,
    kv: PromptKV,
    *,
    want_logits: bool = True,
    logits_later: bool = False,
    block_size: int | None = None,
    attention_from: torch.Tensor | None = None,
    layers: int | None = None,
    events: LayerEvents | None = None,
    steps: LayerSteps | None = None,
) -> FusionResult:
    """Run the blended prefill of one prompt over its KV `kv` (`PromptKV`, built for the plan's positions), writing
    the recomputed tokens' KV into it. See the module docstring for the rule.

    `logits_later`: with `want_logits`, leave the LM head to the caller: `FusionResult.hidden` holds the last token's
    output of the last layer and `logits` is None, so that `logits_of` can give several results' logits from one
    read of the LM head's weights (on a CPU as long as the last layer of the default model).
    `block_size`: queries are attended in groups of this many positions (see `attend_blocks`); 0 attends them in
    one call (unmasked as the tail of the causal square when they are the prompt's last tokens). By default 512
    on a CPU, where the masked-away half of the scores is real work, and 0 on a GPU, where each block costs a host
    synchronization and a dozen kernel launches.
    `attention_from`: [N] bool (host), tokens (computed on every layer, e.g. the question) whose attention to every
    token is averaged over heads, these queries and all layers but the last into `FusionResult.attention`. When
    they are all the tokens being recomputed (full KV reuse's question), their attention output is taken from
    those same probabilities, so the keys are read once per layer, not twice.
    `layers`: run only the first this many layers (a shallow attention probe), leaving the later layers' KV as
    loaded; there are no logits then. None: every layer.
    `events`: told when each layer but the last is done (`LayerEvents`: a cancelled request stops there, the
    scheduler decodes other requests there); its watchers must not touch this prompt's tensors.
    `steps`: how each layer's row-wise work (norm, q/k/v, RoPE; residual, norm, MLP) runs (`layer_rows`): eagerly
    by default, or padded and replayed as CUDA graphs (`GraphedLayerSteps`).

    Nothing in the layer loop reads a tensor back to the host: the plan's indices and counts are worked out on the
    host before it, and a check layer keeps its most deviating tokens with a top-k of a known size.
    """
    num_layers, n = lm.shape.num_layers, plan.num_tokens
    if plan.check_layers and plan.check_layers[-1] >= num_layers:
        raise CacheBlendError(
            f"check layer {plan.check_layers[-1]} does not exist: "
            f"the model has {num_layers} layers (0..{num_layers - 1})"
        )
    if kv.num_tokens != n or kv.num_layers != num_layers:
        raise CacheBlendError(f"the prompt KV holds {kv.num_layers} layers of {kv.num_tokens} tokens; the plan needs "
                              f"{num_layers} of {n}")  # fmt: skip
    depth = num_layers if layers is None else layers
    if not 1 <= depth <= num_layers:
        raise CacheBlendError(f"layers must be in [1, {num_layers}] (the model's layers), got {layers}")
    if depth < num_layers:
        want_logits = False  # nothing past the last layer run
    device = lm.device
    if block_size is None:
        block_size = 512 if device.type == "cpu" else 0
    positions = plan.positions.to(device)
    checks = dict(zip(plan.check_layers, plan.keep_counts, strict=True))
    computed = torch.from_numpy(plan.computed).to(device)
    count = plan.computed.size  # tokens recomputed on this layer, known on the host
    if plan.chosen is not None:
        active = torch.sort(torch.cat((plan.chosen.to(device), computed))).values  # [A] indices being recomputed
        count += int(plan.chosen.shape[0])
    else:
        active = computed
    n_computed, tail = count, plan.tail
    # on check layers: the reused tokens among `active` (candidates) and the others (kept whatever the check says)
    cand = torch.from_numpy(plan.candidates).to(device) if checks else None
    fixed = torch.from_numpy(np.setdiff1d(np.arange(count), plan.candidates)).to(device) if checks else None
    n_cand = plan.candidates.size
    cos_a, sin_a = kv.cos[active].unsqueeze(1), kv.sin_signed[active].unsqueeze(1)  # [A, 1, D]
    steps = EagerLayerSteps(lm) if steps is None else steps
    work = steps.rows(lm.embed(plan.input_ids.to(device)[active]), cos_a, sin_a)  # the rows' hidden states [A, hidden]
    rows = probe_masks = None
    if attention_from is not None:  # indices of the recorded queries among `active`, from the host masks
        if plan.chosen is not None or checks:
            raise CacheBlendError("attention_from is recorded on a plan whose recomputed tokens are known on the host")
        recorded = np.flatnonzero(attention_from.cpu().numpy()[plan.computed])
        rows = None if recorded.size == count else torch.from_numpy(recorded).to(device)
        n_rows = recorded.size
        probe_q = positions[active if rows is None else active[rows]]
        probe_masks = {w: causal_mask(probe_q, positions, w) for w in {lm.window(i) for i in range(depth)}}  # [Q, N]
    attn_sum = torch.zeros(n, dtype=torch.float32, device=device)
    attn_layers = 0
    layer_masks: dict[int | None, torch.Tensor] = {}  # the one-call attention masks of `active` by window, once per set
    counts: list[int] = []

    q_pos = positions[active]  # [A]: the recomputed tokens' positions, made again when `active` changes
    for layer_idx in range(depth):
        keys, values = kv.layer(layer_idx)  # [Hkv, N, D] each, keys rotated
        key_rows, value_rows = kv.rows(layer_idx)  # the same [N, Hkv, D]: written in place below
        raw_k = None  # [A, Hkv, D], the keys before RoPE, where the prompt's KV keeps them
        if kv.raw_keys is None:
            q_rows, k_rows, v_rows = work.qkv(layer_idx)  # [A, H | Hkv, D]
        else:
            x = lm.normed_input(layer_idx, work.hidden)  # [A, hidden]
            q_rows, raw_k, v_rows = (t.transpose(0, 1) for t in lm.project_raw_qkv(layer_idx, x))
            cos_l, sin_l = lm.layer_rope(layer_idx, cos_a, sin_a)
            q_rows, k_rows = rope_rotate(q_rows, cos_l, sin_l), rope_rotate(raw_k, cos_l, sin_l)

        if layer_idx in checks and n_cand > 0:
            assert cand is not None and fixed is not None
            # a rotation keeps distances, so rotated keys rank tokens as raw ones would
            fresh, stored = (k_rows, key_rows) if plan.deviation == "key" else (v_rows, value_rows)
            dev = token_deviation(fresh[cand].transpose(0, 1), stored[active[cand]].transpose(0, 1))  # [C]
            kept = cand[select_recompute_tokens(dev, checks[layer_idx])]  # ascending, into `active`
            keep = torch.sort(torch.cat((fixed, kept))).values  # into `active`, ascending
            cand, fixed = torch.searchsorted(keep, kept), torch.searchsorted(keep, fixed)
            kept_n = min(checks[layer_idx], n_cand)
            count, n_cand = count - n_cand + kept_n, kept_n
            active, hidden, q_rows = active[keep], work.hidden[keep], q_rows[keep]
            k_rows, v_rows, q_pos = k_rows[keep], v_rows[keep], q_pos[keep]
            if raw_k is not None:
                raw_k = raw_k[keep]
            cos_a, sin_a = cos_a[keep], sin_a[keep]
            work = steps.rows(hidden, cos_a, sin_a)
            layer_masks = {}
            tail = tail and n_cand == plan.candidates.size

        key_rows.index_copy_(0, active, k_rows)
        value_rows.index_copy_(0, active, v_rows)
        if raw_k is not None:  # the raw keys are written only where the prompt's KV keeps them
            assert kv.raw_keys is not None
            kv.raw_keys[layer_idx].index_copy_(1, active, raw_k.transpose(0, 1))
        counts.append(count)
        selected = active

        if layer_idx == num_layers - 1 and not want_logits:
            continue  # nothing reads the last layer's output
        q_active = count
        if layer_idx == num_layers - 1:
            # Only the last token's output is needed from the last layer; its K/V are already stored above.
            active, q_rows, q_pos = active[-1:], q_rows[-1:], q_pos[-1:]
            work = steps.rows(work.hidden[-1:], None, None)
            q_active, layer_masks = 1, {}
        query = q_rows.transpose(0, 1)  # [H, A, D]
        # a shallow probe's last layer: only its attention weights are read, as no later layer is run
        shallow_end = layer_idx == depth - 1 < num_layers - 1
        attn_out = None
        if probe_masks is not None and layer_idx < num_layers - 1 and n_rows > 0:
            q_probe = query if rows is None else query[:, rows]
            probs = lm.attention_weights(layer_idx, q_probe, keys, probe_masks[lm.window(layer_idx)])  # [H, Q, N]
            attn_sum += probs.mean(dim=(0, 1))
            attn_layers += 1
            if rows is None and not shallow_end:  # every query is recorded: their output from the same weights
                attn_out = lm.attend_from_weights(layer_idx, probs, values)
        if shallow_end:
            continue
        if attn_out is None:
            # the prompt's tail, and at least half of it: the causal square's padded rows cost less than a mask's waste
            as_tail = tail and q_active == n_computed and 2 * q_active > n - 1
            window = lm.window(layer_idx)
            if block_size <= 0 and not as_tail and window not in layer_masks:
                layer_masks[window] = attention_mask(q_pos, positions, query.dtype, window)[None, None]  # [1, 1, A, N]
            attn_out = attend_blocks(lm, layer_idx, query, *kv.batched(layer_idx), q_pos, positions, block_size,
                                     as_tail=as_tail, mask=layer_masks.get(window))  # fmt: skip
        work.finish(layer_idx, attn_out)
        if events is not None and layer_idx < num_layers - 1:
            events.layer_done(layer_idx)

    last = work.hidden[-1:] if want_logits else None
    return FusionResult(
        kv=kv,
        logits=None if last is None or logits_later else lm.logits(last)[0],
        hidden=last[0].clone() if last is not None and logits_later else None,  # the rows' buffers may be reused
        recomputed_per_layer=counts + [0] * (num_layers - depth),  # a shallow probe recomputes nothing past its layers
        selected_positions=positions[selected],
        attention=None if attention_from is None else attn_sum / max(attn_layers, 1),
    )
