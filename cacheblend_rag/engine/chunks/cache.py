"""Chunk KV by key: find a chunk in the store, or prefill it after its prefix (and context) and store it.

A chunk's entry is keyed by (model fingerprint, dtype, prefix tokens, chunk tokens, context digest) and holds its
per-layer raw keys and values, prefilled after the shared prefix (so it has the same attention sink as in a
prompt) and, where `contexts` records one, after its context (`chunk_context`): only the chunk's own KV is kept.

A full prefill of a prompt holds every chunk's KV after the prefix and the chunks before it; `capture.capture`
cuts the entries out of it (keys turned back to raw), so a cold request stores what it already computed
(`capture.capturable` says which, under the engine's `capture` policy). Under capture="all" a chunk after the
first of a prompt is read from its captured entry (the KV a full prefill gave it, after the chunks before it
there; a key of its own, naming the near copies of the chunk it was cached after, so that it is read only where
the prompt shows them before the chunk too), else from its own entry. The first chunk of a prompt, whose real
context is the prefix alone, always reads its isolated entry (prefilled after the prefix only): never a captured
one, nor one prefilled after neighbours. So does a later chunk whose recorded context holds a chunk placed after
it in the same prompt (`isolated_at`).

Whatever comes back from a store is checked against the shape this model gives that many tokens before a single
layer is read; anything else is dropped and recomputed, never used.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from ...errors import ConfigError
from ...fusion import FusionPlan, LayerLoader, fuse
from ...models.adapter import LayerwiseModel
from ...store import ChunkKV, ChunkReader, ChunkStore, CorruptEntryError, Hit, TieredStore, chunk_key
from ..request.after_layer import AfterLayer
from .context import ChunkContexts, copies_before, copies_digest, copy_sets

CAPTURED = "captured"  # the context recorded in the keys of capture="all" entries

logger = logging.getLogger(__name__)


class Loaded(NamedTuple):
    """A chunk's KV as a request gets it, and what getting it cost."""

    kv: ChunkReader
    tier: str | None  # the store tier it came from; None when it was prefilled now
    stored_bytes: int  # bytes read from that tier, as its codec stored them (0 when prefilled now)
    captured: bool = False  # read from the chunk's captured entry (capture="all"), not its own


class ChunkCache:
    """The chunk KV of one model in one dtype, backed by a store (any tier or stack of tiers)."""

    def __init__(
        self,
        lm: LayerwiseModel,
        store: ChunkStore,
        fingerprint: str,
        dtype: torch.dtype,
        capture: str = "exact",
    ) -> None:
        self.lm = lm
        self.capture_policy = capture  # EngineConfig.capture
        self._store = store
        self.fingerprint = fingerprint
        self.dtype = dtype
        self.contexts = ChunkContexts()  # per chunk, the text its entry is prefilled after (none: isolated)

    @property
    def store(self) -> ChunkStore:
        """The store the chunk KV is read from and written to."""
        return self._store

    @store.setter
    def store(self, store: ChunkStore) -> None:
        self._store = store

    def key(
        self,
        prefix_ids: Sequence[int],
        chunk_ids: Sequence[int],
        *,
        captured: bool = False,
        isolated: bool = False,
        copies: Sequence[Sequence[int]] = (),
    ) -> str:
        """The store key of a chunk's KV when it follows `prefix_ids` (and its recorded context, if any); with
        `captured`, of its captured entry (capture="all") cached after the near copies `copies` of it (none: the
        plain captured entry); with `isolated`, of the entry prefilled after the prefix alone, whatever context is
        recorded (what the first chunk of a prompt reads)."""
        if captured:
            digest = f"{CAPTURED}:{copies_digest(copies)}" if copies else CAPTURED
        else:
            digest = "" if isolated else self.contexts.digest(chunk_ids)
        return chunk_key(self.fingerprint, self.dtype, prefix_ids, chunk_ids, digest)

    def isolated_at(self, chunk_ids: Sequence[Sequence[int]]) -> list[bool]:
        """Per position of a prompt's chunks, whether the chunk there reads its isolated entry: the first chunk
        (its real context is the prefix alone), and a chunk whose recorded context holds a chunk placed after it
        in this prompt. Such an entry has read text this prompt shows only later; recomputing that later chunk
        then makes it a repeat, which took a MuSiQue answer far from full recompute (research.md section 19)."""
        return [j == 0 or later for j, later in enumerate(self.contexts.holds_later(chunk_ids))]

    def read_keys(
        self,
        prefix_ids: Sequence[int],
        chunk_ids: Sequence[int],
        position: int | None,
        policy: str | None = None,
        *,
        isolated: bool = False,
        copies: Sequence[Sequence[int]] = (),
    ) -> tuple[str, ...]:
        """The keys a chunk at `position` of a prompt is read from, best first: the first chunk, or one that
        `isolated_at` names (`isolated`), reads its isolated entry; under capture="all", a later chunk reads its
        captured entry, else its own; every other chunk reads its own entry, and so does a chunk at no position
        (None: precompute and fills). `policy` replaces the engine's capture policy. A chunk shown after near copies
        `copies` reads first a captured entry cached after them (`copy_sets`), then the plain one (research.md,
        section 21)."""
        if position == 0 or isolated:  # research.md, sections 13, 17 and 19
            return (self.key(prefix_ids, chunk_ids, isolated=True),)
        own = self.key(prefix_ids, chunk_ids)
        if position is not None and (policy or self.capture_policy) == "all":
            after = [self.key(prefix_ids, chunk_ids, captured=True, copies=c) for c in copy_sets(copies)]
            return (*after, self.key(prefix_ids, chunk_ids, captured=True), own)
        return (own,)

    def reading(self, chunk_ids: Sequence[Sequence[int]], policy: str | None = None) -> list[tuple[bool, tuple]]:
        """Per position of a prompt's chunks, what `read_keys` needs besides the chunk: whether it reads its
        isolated entry (`isolated_at`) and the near copies of it shown before it (`copies_before`; only under
        capture="all", whose keys name them; `policy` replaces the engine's)."""
        all_ = (policy or self.capture_policy) == "all"
        copies = copies_before(chunk_ids) if all_ else [()] * len(chunk_ids)
        return list(zip(self.isolated_at(chunk_ids), copies, strict=True))

    def prompt_keys(
        self, prefix_ids: Sequence[int], chunk_ids: Sequence[Sequence[int]], *, with_prefix: bool = True
    ) -> list[str]:
        """The store keys a prompt's KV is read from now: the prefix's (if any, and `with_prefix`), then for each
        chunk in order the first of its `read_keys` that is stored, or its own key when none is (what a miss
        stores)."""
        keys = [self.key((), prefix_ids)] if prefix_ids and with_prefix else []
        for j, (ids, (isolated, copies)) in enumerate(zip(chunk_ids, self.reading(chunk_ids), strict=True)):
            # the store is asked only when there is a choice
            *preferred, own = self.read_keys(prefix_ids, ids, j, isolated=isolated, copies=copies)
            keys.append(next((k for k in preferred if k in self.store), own))
        return keys

    def layer_loader(
        self, parts: Sequence[ChunkReader], total: int, key_scales: Sequence[float] | None = None
    ) -> LayerLoader:
        """Loads layer l of the given KV parts laid end to end, padded with zeros up to `total` tokens.

        `key_scales`, one factor per part, multiplies that part's keys on layers 1.. (an attention temperature on
        KV computed out of context, `EngineConfig.stale_key_temperature`; layer 0's keys depend on the tokens
        alone, so they are exact wherever a chunk was prefilled). The stored entries are never changed."""
        pad = total - sum(p.num_tokens for p in parts)
        hkv, d, device = self.lm.shape.num_kv_heads, self.lm.shape.head_dim, self.lm.device
        scales = [1.0] * len(parts) if key_scales is None else list(key_scales)
        if len(scales) != len(parts):
            raise ValueError(f"one key scale per part: {len(scales)} scales for {len(parts)} parts")

        def load(layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
            ks, vs = [], []
            for p, scale in zip(parts, scales, strict=True):
                k, v = p.layer(layer_idx)  # [Hkv, T_p, D] each; a stored chunk may read (and check) it only now
                k = k.to(device, non_blocking=True)
                ks.append(k * scale if layer_idx > 0 and scale != 1.0 else k)
                vs.append(v.to(device, non_blocking=True))
            if pad:
                z = torch.zeros(hkv, pad, d, dtype=self.dtype, device=device)
                ks.append(z)
                vs.append(z)
            return torch.cat(ks, dim=1), torch.cat(vs, dim=1)  # [Hkv, total, D], fresh tensors

        return load

    def prefill(
        self,
        prefix: ChunkReader | None,
        prefix_ids: Sequence[int],
        ids: Sequence[int],
        after_layer: AfterLayer | None = None,
        *,
        isolated: bool = False,
    ) -> ChunkKV:
        """Prefill `ids` after the (cached) prefix and the chunk's recorded context (none with `isolated`), and keep
        only their KV (`after_layer` runs between its layers: `interleave`).

        A context that would not fit the model's positions with the prefix and the chunk is cut from its start
        (the nearest neighbour, placed last, is kept)."""
        p = len(prefix_ids)
        context = () if isolated else self.context_of(prefix_ids, ids)
        all_ids = torch.tensor([*prefix_ids, *context, *ids], dtype=torch.long)
        keep = p + len(context)
        n = all_ids.shape[0]
        exact = torch.zeros(n, dtype=torch.bool)
        exact[:p] = True
        plan = FusionPlan(input_ids=all_ids, positions=torch.arange(n), exact=exact, reused=torch.zeros_like(exact))
        parts = [prefix] if prefix is not None else []
        result = fuse(self.lm, plan, self.layer_loader(parts, n), want_logits=False, keep_raw_keys=True,
                      after_layer=after_layer)  # fmt: skip
        assert result.raw_keys is not None
        keys = torch.stack([k[:, keep:] for k in result.raw_keys])  # [L, Hkv, T, D]
        values = torch.stack([v[:, keep:] for v in result.values])
        return ChunkKV(self.key(prefix_ids, ids, isolated=isolated), keys, values)

    def exact_at(self, prefix_ids: Sequence[int], ids: Sequence[int], key: str, before: Sequence[int]) -> bool:
        """Whether entry `key` of chunk `ids` holds what a full prefill computes for the chunk after `prefix_ids`
        and the tokens `before` it in a prompt: an entry prefilled after exactly those tokens (the isolated one
        with nothing before it, else its own)."""
        if not before and key == self.key(prefix_ids, ids, isolated=True):
            return True
        return key == self.key(prefix_ids, ids) and self.context_of(prefix_ids, ids) == tuple(before)

    def context_of(self, prefix_ids: Sequence[int], ids: Sequence[int]) -> tuple[int, ...]:
        """The tokens chunk `ids`'s entry is prefilled after, between the prefix and the chunk: its recorded
        context, cut from its start to what fits the model's positions (the nearest neighbour, placed last, stays)."""
        context = self.contexts.tokens(ids)
        room = max(self.lm.shape.max_positions - len(prefix_ids) - len(ids), 0)
        return context[len(context) - room :] if len(context) > room else context

    def store_or_fill(
        self, prefix_ids: Sequence[int], ids: Sequence[int], kv: ChunkKV | None, after_layer: AfterLayer | None = None
    ) -> None:
        """Store chunk `ids`'s entry: `kv` when a full prefill captured it, else prefilled now (if not stored),
        with `after_layer` between the layers of that prefill; a chunk with a recorded context gets its isolated
        entry too (what the head of a prompt, and `isolated_at`, read)."""
        if kv is None:
            self.fill(prefix_ids, [ids], after_layer=after_layer, heads=True)
        elif kv.key not in self.store:
            self.store.put(kv)

    def lookup(self, key: str, num_tokens: int) -> Hit | None:
        """The store's hit for `key` if it has this model's dtype and the shape of `num_tokens` tokens.

        The key hashes model, dtype and tokens, so any other shape is a damaged or forged entry: it is dropped
        (and recomputed by the caller) before a single layer of it is read.
        """
        hit = self.store.open(key)
        if hit is None:
            return None
        shape = (self.lm.shape.num_layers, self.lm.shape.num_kv_heads, num_tokens, self.lm.shape.head_dim)
        if hit.kv.dtype == self.dtype and tuple(hit.kv.shape) == shape:
            return hit
        logger.warning("chunk %s in the %s tier has dtype %s and shape %s, expected %s and %s; recomputing it",
                       key[:12], hit.tier, hit.kv.dtype, tuple(hit.kv.shape), self.dtype, shape)  # fmt: skip
        self.store.discard(key)
        return None

    def get_or_prefill(
        self,
        prefix: ChunkReader | None,
        prefix_ids: Sequence[int],
        ids: Sequence[int],
        *,
        lazy: bool,
        position: int | None = None,
        isolated: bool = False,
        copies: Sequence[Sequence[int]] = (),
        after_layer: AfterLayer | None = None,
    ) -> Loaded:
        """The chunk's KV, the tier it came from (None if it was prefilled now) and the bytes read from that tier.

        `prefix` is the KV of `prefix_ids`; `position` the chunk's place in the prompt and `isolated` whether it
        reads its isolated entry there, `copies` the near copies of it shown before it (`read_keys`; position None:
        its own entry); a chunk prefilled now gets the entry it is read from. With `lazy` (pipelined loading), a
        chunk found on disk or in Redis comes back unread: its layers are fetched while the fusor runs. Without it,
        the chunk is read whole now, and one that turns out damaged is recomputed here (its tier has dropped it and
        counted a miss).
        """
        found = self.find(prefix_ids, ids, position, isolated, copies)
        if found is not None:
            hit, captured = found
            if lazy:
                return Loaded(hit.kv, hit.tier, hit.kv.nbytes, captured)
            try:  # the stored size, before reading decodes it to the compute dtype
                return Loaded(hit.kv.materialize(), hit.tier, hit.kv.nbytes, captured)
            except CorruptEntryError as exc:
                logger.warning("chunk %s from the %s tier is damaged (%s); recomputing it", hit.kv.key[:12], hit.tier,
                               exc)  # fmt: skip
        kv = self.prefill(prefix, prefix_ids, ids, after_layer, isolated=position == 0 or isolated)
        self.store.put(kv)
        return Loaded(kv, None, 0)

    def find(
        self,
        prefix_ids: Sequence[int],
        ids: Sequence[int],
        position: int | None = None,
        isolated: bool = False,
        copies: Sequence[Sequence[int]] = (),
    ) -> tuple[Hit, bool] | None:
        """The stored entry chunk `ids` after `prefix_ids` is read from at `position` of a prompt (`read_keys`) and
        whether it is a captured entry rather than the chunk's own, or None (a miss; nothing is computed)."""
        *preferred, own = self.read_keys(prefix_ids, ids, position, isolated=isolated, copies=copies)
        for key in (*preferred, own):
            hit = self.lookup(key, len(ids))
            if hit is not None:
                return hit, key != own
        return None

    def missing(self, prefix_ids: Sequence[int], chunk_ids: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """The distinct chunks (in prompt order) with no entry they can be read from at their place after
        `prefix_ids`. Reads no KV."""
        out: list[tuple[int, ...]] = []
        for j, (ids, (isolated, copies)) in enumerate(zip(chunk_ids, self.reading(chunk_ids), strict=True)):
            ids = tuple(ids)
            keys = self.read_keys(prefix_ids, ids, j, isolated=isolated, copies=copies)
            if ids not in out and not any(key in self.store for key in keys):
                out.append(ids)
        return out

    def load_prefix(self, prefix_ids: Sequence[int]) -> Loaded | None:
        """The shared prefix's KV, read whole (it is short, and a prefill after it needs every layer at once)."""
        if not prefix_ids:
            return None
        return self.get_or_prefill(None, (), prefix_ids, lazy=False)

    def fill(
        self,
        prefix_ids: Sequence[int],
        chunk_ids: Sequence[Sequence[int]],
        *,
        show_progress: bool = False,
        after_layer: AfterLayer | None = None,
        heads: bool = False,
    ) -> tuple[int, int]:
        """Make sure each chunk's KV (after `prefix_ids`) is stored, running `after_layer` between the layers of
        each prefill; with `heads`, a chunk with a context gets its isolated entry too (what it is read from at
        the head of a prompt). -> (chunks already stored, chunks with an entry computed now)"""
        hits = misses = 0
        loaded = self.load_prefix(prefix_ids)
        prefix = None if loaded is None else loaded.kv
        for ids in tqdm(chunk_ids, desc="precomputing chunk KV", unit="chunk", disable=not show_progress):
            stored = self.get_or_prefill(prefix, prefix_ids, ids, lazy=True, after_layer=after_layer).tier is not None
            if heads and self.contexts.digest(ids):
                head = self.get_or_prefill(prefix, prefix_ids, ids, lazy=True, position=0, after_layer=after_layer)
                stored = stored and head.tier is not None
            hits, misses = hits + stored, misses + (not stored)
        return hits, misses

    def clear(self, tiers: Sequence[str] | None = None) -> None:
        """Drop stored chunk KV: every tier, or only the named ones of a tier stack."""
        if tiers is None:
            self.store.clear()
        elif isinstance(self.store, TieredStore):
            self.store.clear(tiers)
        elif list(tiers) == [self.store.name]:
            self.store.clear()
        else:
            raise ConfigError(
                f"this engine's store is the single tier {self.store.name!r}, not {list(tiers)}; call "
                f"clear_store() without `tiers`"
            )
