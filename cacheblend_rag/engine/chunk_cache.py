"""Chunk KV by key: find a chunk in the store, or prefill it after its prefix and store it.

A chunk's entry is keyed by (model fingerprint, dtype, prefix tokens, chunk tokens) and holds its per-layer raw
keys and values. With a lead-in (`EngineConfig.lead_in`), a chunk has two entries: one prefilled right after the
prefix, read when the chunk comes first in a prompt (where that KV is exact), and one prefilled after the prefix
and the lead-in text, read everywhere else: a chunk that has some text before it is cached closer to how it reads
after other chunks than one that opens the prompt.

Whatever comes back from a store is checked against the shape this model gives that many tokens before a single
layer is read; anything else is dropped and recomputed, never used.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from ..errors import ConfigError
from ..fusion import FusionPlan, LayerLoader, fuse
from ..models.adapter import LayerwiseModel
from ..store import ChunkKV, ChunkReader, ChunkStore, CorruptEntryError, Hit, TieredStore, chunk_key

logger = logging.getLogger(__name__)


class ChunkCache:
    """The chunk KV of one model in one dtype, backed by a store (any tier or stack of tiers)."""

    def __init__(
        self,
        lm: LayerwiseModel,
        store: ChunkStore,
        fingerprint: str,
        dtype: torch.dtype,
        lead_in_ids: Sequence[int] = (),
    ) -> None:
        self.lm = lm
        self._store = store
        self.fingerprint = fingerprint
        self.dtype = dtype
        self.lead_in_ids = tuple(lead_in_ids)  # () : no lead-in, one entry per chunk
        # The KV of the last prefix + lead-in prefilled after, kept whole: every missed non-first chunk of a
        # request or a precompute is prefilled after the same context, which is then read once, not per chunk.
        self._context_kv: tuple[tuple[int, ...], ChunkReader] | None = None

    @property
    def store(self) -> ChunkStore:
        """The store the chunk KV is read from and written to."""
        return self._store

    @store.setter
    def store(self, store: ChunkStore) -> None:
        """Read and write another store; the remembered prefix + lead-in KV is dropped with the old one, so the
        new store gets its own entry on the next miss."""
        self._store = store
        self._context_kv = None

    def key(self, prefix_ids: Sequence[int], chunk_ids: Sequence[int]) -> str:
        """The store key of a chunk's KV when it follows `prefix_ids`."""
        return chunk_key(self.fingerprint, self.dtype, prefix_ids, chunk_ids)

    def context(self, prefix_ids: Sequence[int], first: bool) -> tuple[int, ...]:
        """The tokens a chunk's stored KV was prefilled after: the prefix alone for the prompt's first chunk (or
        with no lead-in), else the prefix and the lead-in."""
        return tuple(prefix_ids) if first else (*prefix_ids, *self.lead_in_ids)

    def prompt_keys(
        self, prefix_ids: Sequence[int], chunk_ids: Sequence[Sequence[int]], *, with_prefix: bool = True
    ) -> list[str]:
        """The store keys a prompt's KV is read from: the prefix's (if any, and `with_prefix`), then each
        chunk's, in order."""
        keys = [self.key((), prefix_ids)] if prefix_ids and with_prefix else []
        return keys + [self.key(self.context(prefix_ids, j == 0), ids) for j, ids in enumerate(chunk_ids)]

    def layer_loader(self, parts: Sequence[ChunkReader], total: int) -> LayerLoader:
        """Loads layer l of the given KV parts laid end to end, padded with zeros up to `total` tokens."""
        pad = total - sum(p.num_tokens for p in parts)
        hkv, d, device = self.lm.shape.num_kv_heads, self.lm.shape.head_dim, self.lm.device

        def load(layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
            ks, vs = [], []
            for p in parts:
                k, v = p.layer(layer_idx)  # [Hkv, T_p, D] each; a stored chunk may read (and check) it only now
                ks.append(k.to(device, non_blocking=True))
                vs.append(v.to(device, non_blocking=True))
            if pad:
                z = torch.zeros(hkv, pad, d, dtype=self.dtype, device=device)
                ks.append(z)
                vs.append(z)
            return torch.cat(ks, dim=1), torch.cat(vs, dim=1)  # [Hkv, total, D], fresh tensors

        return load

    def prefill(self, prefix: ChunkReader | None, prefix_ids: Sequence[int], ids: Sequence[int]) -> ChunkKV:
        """Prefill `ids` after the (cached) prefix and keep only their KV."""
        p = len(prefix_ids)
        all_ids = torch.tensor([*prefix_ids, *ids], dtype=torch.long)
        n = all_ids.shape[0]
        exact = torch.zeros(n, dtype=torch.bool)
        exact[:p] = True
        plan = FusionPlan(input_ids=all_ids, positions=torch.arange(n), exact=exact, reused=torch.zeros_like(exact))
        parts = [prefix] if prefix is not None else []
        result = fuse(self.lm, plan, self.layer_loader(parts, n), want_logits=False, keep_raw_keys=True)
        assert result.raw_keys is not None
        keys = torch.stack([k[:, p:] for k in result.raw_keys])  # [L, Hkv, T, D]
        values = torch.stack([v[:, p:] for v in result.values])
        return ChunkKV(self.key(prefix_ids, ids), keys, values)

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
        logger.warning(
            "chunk %s in the %s tier has dtype %s and shape %s, expected %s and %s; recomputing it",
            key[:12],
            hit.tier,
            hit.kv.dtype,
            tuple(hit.kv.shape),
            self.dtype,
            shape,
        )
        self.store.discard(key)
        return None

    def get_or_prefill(
        self,
        prefix: ChunkReader | None,
        prefix_ids: Sequence[int],
        ids: Sequence[int],
        *,
        lazy: bool,
        first: bool = True,
        fallback: bool = False,
    ) -> tuple[ChunkReader, str | None]:
        """-> (KV, the name of the store tier it came from, or None if it was prefilled now)

        `prefix` is the KV of `prefix_ids`. With `first` False and a lead-in, the entry read or made is the one
        prefilled after the prefix and the lead-in (whose KV is read from the store, or made, only on a miss).
        With `fallback`, a chunk whose entry for its place is missing comes from its other entry if that one is
        stored (cached for the other place, so less close to full prefill, but far cheaper than a prefill).
        With `lazy` (pipelined loading), a chunk found on disk or in Redis comes back unread: its layers are
        fetched while the fusor runs. Without it, the chunk is read whole now, and one that turns out damaged
        is recomputed here (its tier has dropped it and counted a miss).
        """
        context = self.context(prefix_ids, first)
        key = self.key(context, ids)
        hit = self.lookup(key, len(ids))
        if hit is None and fallback and self.lead_in_ids:
            hit = self.lookup(self.key(self.context(prefix_ids, not first), ids), len(ids))
        if hit is not None:
            if lazy:
                return hit.kv, hit.tier
            try:
                return hit.kv.materialize(), hit.tier
            except CorruptEntryError as exc:
                logger.warning("chunk %s from the %s tier is damaged (%s); recomputing it", key[:12], hit.tier, exc)
        if len(context) > len(prefix_ids):
            prefix = self.context_kv(context)
        kv = self.prefill(prefix, context, ids)
        self.store.put(kv)
        return kv, None

    def prefix_kv(self, prefix_ids: Sequence[int]) -> ChunkReader | None:
        """The shared prefix's KV, read whole (it is short, and a prefill after it needs every layer at once)."""
        if not prefix_ids:
            return None
        return self.get_or_prefill(None, (), prefix_ids, lazy=False)[0]

    def context_kv(self, context: Sequence[int]) -> ChunkReader | None:
        """`prefix_kv` of a prefix + lead-in, remembered for the next chunk prefilled after the same tokens."""
        memo = self._context_kv
        if memo is not None and memo[0] == tuple(context):
            return memo[1]
        kv = self.prefix_kv(context)
        if kv is not None:
            self._context_kv = (tuple(context), kv)
        return kv

    def fill(
        self, prefix_ids: Sequence[int], chunk_ids: Sequence[Sequence[int]], *, show_progress: bool = False
    ) -> tuple[int, int]:
        """Make sure each chunk's KV (after `prefix_ids`; with a lead-in, both entries) is stored.

        -> (chunks already stored, chunks computed now, in whole or in part)"""
        hits = misses = 0
        prefix = self.prefix_kv(prefix_ids)
        places = (True, False) if self.lead_in_ids else (True,)
        for ids in tqdm(chunk_ids, desc="precomputing chunk KV", unit="chunk", disable=not show_progress):
            tiers = [self.get_or_prefill(prefix, prefix_ids, ids, lazy=True, first=f)[1] for f in places]
            stored = all(t is not None for t in tiers)
            hits, misses = hits + stored, misses + (not stored)
        return hits, misses

    def clear(self, tiers: Sequence[str] | None = None) -> None:
        """Drop stored chunk KV: every tier, or only the named ones of a tier stack."""
        self._context_kv = None
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
