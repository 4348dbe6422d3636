"""Chunk KV by key: find a chunk's entry in the store, or prefill it after its prefix (and context) and store it.

An entry is keyed by (model fingerprint, dtype, prefix tokens, chunk tokens, context digest) and holds the chunk's
per-layer raw keys and values, prefilled after the shared prefix (so it has the same attention sink as in a
prompt) and, where `contexts` records one, after its context (`context`): only the chunk's own KV is kept. Which
entry each chunk of a prompt reads is the request's plan (`place`; the rules are in `placement`).

Whatever comes back from a store is checked against the shape this model gives that many tokens before a single
layer is read; anything else is dropped and recomputed, never used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from ...config import normalize_dtype_name
from ...errors import ConfigError
from ...fusion import FusionPlan, LayerEvents, LayerLoader, PromptKV, fuse
from ...models.adapter import LayerwiseModel
from ...store import ChunkKV, ChunkReader, ChunkStore, CorruptEntryError, Hit, TieredStore
from .context import ChunkContexts
from .elsewhere import note, other_dtype_keys, stored_otherwise
from .placement import EntryKeys, Placement, place_chunks

logger = logging.getLogger(__name__)


class Loaded(NamedTuple):
    """A chunk's KV as a request gets it, and what getting it cost."""

    kv: ChunkReader
    tier: str | None  # the store tier it came from; None when it was prefilled now
    stored_bytes: int  # bytes read from that tier, as its codec stored them (0 when prefilled now)
    captured: bool = False  # read from one of the chunk's captured entries, not its own


def whole_prompt_kv(
    lm: LayerwiseModel, kept: Sequence[tuple[torch.Tensor, torch.Tensor]], total: int, *, keep_raw: bool = False,
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PromptKV:  # fmt: skip
    """The KV buffers of a prompt of `total` tokens whose head is the KV `kept` in memory ((keys before RoPE, values)
    per part, laid end to end and rotated at once; none: a prompt computed whole): `PromptKV.whole` for `lm`."""
    s = lm.shape
    cos, sin = lm.rope(torch.arange(total, device=lm.device))
    return PromptKV.whole(kept, total, cos, sin, shape=(s.num_layers, s.num_kv_heads, s.head_dim), keep_raw=keep_raw,
                          buffers=buffers, rope_blocks=lm.rope_blocks)  # fmt: skip


class ChunkCache:
    """The chunk KV of one model in one dtype, backed by a store (any tier or stack of tiers)."""

    def __init__(
        self,
        lm: LayerwiseModel,
        store: ChunkStore,
        fingerprint: str,
        dtype: torch.dtype,
        capture: str = "exact",
        fingerprint_in: Callable[[torch.dtype], str | None] = lambda dtype: None,
    ) -> None:
        self.lm = lm
        self.capture_policy = capture  # "exact" or "all": see `placement`
        self._store = store
        self.dtype = dtype
        self.contexts = ChunkContexts()  # per chunk, the text its entry is prefilled after (none: isolated)
        self.keys = EntryKeys(fingerprint, dtype, self.contexts, lm.shape.max_positions)
        self._told: set[str] = set()  # the labels of `stored_otherwise` logged already
        self._fingerprint_in = fingerprint_in  # the model's fingerprint in another dtype (None: not known)
        self._other_keys: list[EntryKeys] | None = None  # the keys of those dtypes, worked out when first asked

    @property
    def store(self) -> ChunkStore:
        """The store the chunk KV is read from and written to."""
        return self._store

    @store.setter
    def store(self, store: ChunkStore) -> None:
        self._store = store

    @property
    def tiers(self) -> int:
        """How many tiers the store has (1 for a single tier)."""
        return len(self._store.tiers) if isinstance(self._store, TieredStore) else 1

    def key(
        self,
        prefix_ids: Sequence[int],
        chunk_ids: Sequence[int],
        *,
        captured: bool = False,
        isolated: bool = False,
        copies: Sequence[Sequence[int]] = (),
    ) -> str:
        """The store key of a chunk's own entry after `prefix_ids` (and its recorded context, if any); with
        `captured`, of its captured entry cached after the near copies `copies` of it (none: the plain captured
        entry); with `isolated`, of the entry prefilled after the prefix alone (`placement.EntryKeys`)."""
        if captured:
            return self.keys.captured(prefix_ids, chunk_ids, copies)
        return self.keys.isolated(prefix_ids, chunk_ids) if isolated else self.keys.own(prefix_ids, chunk_ids)

    def base_key(self, prefix_ids: Sequence[int], chunk_ids: Sequence[int], key: str) -> str:
        """The entry a tier may code the chunk's entry `key` against (`ChunkKV.base`): the chunk's isolated entry,
        which its other entries share most of their codes with; "" when `key` is that entry."""
        alone = self.key(prefix_ids, chunk_ids, isolated=True)
        return alone if key != alone else ""

    def place(
        self, prefix_ids: Sequence[int], chunk_ids: Sequence[Sequence[int]], policy: str | None = None
    ) -> tuple[Placement, ...]:
        """A request's plan: which entry each chunk of a prompt reads, as the store stands now
        (`placement.place_chunks`; `policy` replaces the engine's capture policy)."""
        return place_chunks(self.keys, prefix_ids, chunk_ids, self.store.__contains__, policy or self.capture_policy)

    def stored_otherwise(self, prefix_ids: Sequence[int], plan: Sequence[Placement]) -> dict[str, int]:
        """How many of the plan's missing chunks are stored for another dtype or codec, by label
        (`elsewhere.stored_otherwise`); the first time a label is found, its line (`elsewhere.note`) is logged."""
        if self._other_keys is None:
            self._other_keys = other_dtype_keys(self.keys, self._fingerprint_in)
        found = stored_otherwise(self._other_keys, self.store, prefix_ids, plan)
        new = {label: n for label, n in found.items() if label not in self._told}
        if new:
            self._told.update(new)
            logger.warning("%s", note(new, normalize_dtype_name(self.dtype)))
        return found

    def prompt_keys(
        self, prefix_ids: Sequence[int], chunk_ids: Sequence[Sequence[int]], *, with_prefix: bool = True
    ) -> list[str]:
        """The store keys a prompt's KV is read from now: the prefix's (if any, and `with_prefix`), then for each
        chunk in order the entry its plan finds, or the one a miss stores."""
        keys = [self.key((), prefix_ids)] if prefix_ids and with_prefix else []
        return keys + [p.found or p.fill_key for p in self.place(prefix_ids, chunk_ids)]

    def prompt_kv(
        self,
        parts: Sequence[ChunkReader],
        total: int,
        *,
        keep_raw: bool = False,
        load: LayerLoader | None = None,
        buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> PromptKV:
        """The KV buffers of a prompt of `total` tokens whose head is the given KV parts laid end to end.

        Parts all in memory are laid in and rotated at once (`PromptKV.whole`); otherwise, or when `load` is given (e.g.
        a prefetcher over `layer_loader(parts)`), each layer is read with it (default `layer_loader(parts)`) when the
        fusor first needs it.
        `keep_raw`: keep the keys before RoPE too (what a chunk's entry stores). `buffers`: where to lay the KV
        (`PromptKV.whole`)."""
        whole = self.in_memory(parts) if load is None else None
        if whole is not None:
            return whole_prompt_kv(self.lm, [(w.keys, w.values) for w in whole], total, keep_raw=keep_raw,
                                   buffers=buffers)  # fmt: skip
        s = self.lm.shape
        cos, sin = self.lm.rope(torch.arange(total, device=self.lm.device))
        return PromptKV.layerwise(load or self.layer_loader(parts), total, cos, sin, keep_raw=keep_raw,
                                  shape=(s.num_layers, s.num_kv_heads, s.head_dim), buffers=buffers,
                                  rope_blocks=self.lm.rope_blocks)  # fmt: skip

    @staticmethod
    def in_memory(parts: Sequence[ChunkReader]) -> list[ChunkKV] | None:
        """Every part as a whole `ChunkKV` when all of them are in memory already (nothing left to read), else None."""
        whole = [p.in_memory() for p in parts]
        return None if any(w is None for w in whole) else whole  # type: ignore[return-value]

    def layer_loader(self, parts: Sequence[ChunkReader]) -> LayerLoader:
        """Loads layer l of the given KV parts laid end to end (a stored chunk may read and check it only now)."""
        device = self.lm.device

        def load(layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
            layers = [p.layer(layer_idx) for p in parts]  # [Hkv, T_p, D] each
            if not layers:
                empty = torch.empty(self.lm.shape.num_kv_heads, 0, self.lm.shape.head_dim, dtype=self.dtype)
                return empty, empty
            ks = [k.to(device, non_blocking=True) for k, _ in layers]
            vs = [v.to(device, non_blocking=True) for _, v in layers]
            return torch.cat(ks, dim=1), torch.cat(vs, dim=1)  # [Hkv, T, D]

        return load

    def prefill(
        self,
        prefix: ChunkReader | None,
        prefix_ids: Sequence[int],
        ids: Sequence[int],
        events: LayerEvents | None = None,
        *,
        isolated: bool = False,
    ) -> ChunkKV:
        """Prefill `ids` after the (cached) prefix and the chunk's recorded context (none with `isolated`), and keep
        only their KV (`events` told of its layers).

        A context that would not fit the model's positions with the prefix and the chunk is cut from its start
        (the nearest neighbour, placed last, is kept)."""
        p = len(prefix_ids)
        context = () if isolated else self.keys.context_of(prefix_ids, ids)
        all_ids = torch.tensor([*prefix_ids, *context, *ids], dtype=torch.long)
        keep = p + len(context)
        n = all_ids.shape[0]
        exact = torch.zeros(n, dtype=torch.bool)
        exact[:p] = True
        plan = FusionPlan(input_ids=all_ids, positions=torch.arange(n), exact=exact, reused=torch.zeros_like(exact))
        parts = [prefix] if prefix is not None else []
        result = fuse(self.lm, plan, self.prompt_kv(parts, n, keep_raw=True), want_logits=False,
                      events=events)  # fmt: skip
        assert result.kv.raw_keys is not None
        keys = result.kv.raw_keys[:, :, keep:].clone()  # [L, Hkv, T, D]: the chunk's own KV, nothing else kept
        values = result.kv.values[:, :, keep:].clone()
        key = self.key(prefix_ids, ids, isolated=isolated)
        return ChunkKV(key, keys, values, base=self.base_key(prefix_ids, ids, key))

    def store_or_fill(
        self, prefix_ids: Sequence[int], ids: Sequence[int], kv: ChunkKV | None, events: LayerEvents | None = None
    ) -> None:
        """Store chunk `ids`'s entry: `kv` when a full prefill captured it, else prefilled now (if not stored),
        `events` told of the layers of that prefill; a chunk with a recorded context gets its isolated
        entry too (what the head of a prompt reads)."""
        if kv is None:
            self.fill(prefix_ids, [ids], events=events, heads=True)
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

    def find(self, keys: Sequence[str], num_tokens: int) -> tuple[Hit, str] | None:
        """The first of `keys` the store has an entry of `num_tokens` tokens for, and that key; None: a miss
        (nothing is computed)."""
        for key in keys:
            hit = self.lookup(key, num_tokens)
            if hit is not None:
                return hit, key
        return None

    def get_or_prefill(
        self,
        prefix: ChunkReader | None,
        prefix_ids: Sequence[int],
        ids: Sequence[int],
        keys: Sequence[str],
        *,
        isolated: bool,
        lazy: bool,
        events: LayerEvents | None = None,
    ) -> Loaded:
        """The chunk's KV from the first of `keys` stored (best first), or prefilled now after `prefix` (the KV of
        `prefix_ids`; after the prefix alone when `isolated`) and stored under the last of them.

        With `lazy` (pipelined loading), a chunk found on disk or in Redis comes back unread: its layers are fetched
        while the fusor runs. Without it, the chunk is read whole now, and one that turns out damaged is recomputed
        here (its tier has dropped it and counted a miss).
        """
        found = self.find(keys, len(ids))
        if found is not None:
            hit, key = found
            captured = key != keys[-1]
            if lazy:
                return Loaded(hit.kv, hit.tier, hit.kv.nbytes, captured)
            try:  # the stored size, before reading decodes it to the compute dtype
                return Loaded(hit.kv.materialize(), hit.tier, hit.kv.nbytes, captured)
            except CorruptEntryError as exc:
                logger.warning("chunk %s from the %s tier is damaged (%s); recomputing it", hit.kv.key[:12], hit.tier,
                               exc)  # fmt: skip
        kv = self.prefill(prefix, prefix_ids, ids, events, isolated=isolated)
        if kv.key != keys[-1]:
            raise AssertionError(f"a miss is prefilled into the last key it reads; got {kv.key[:12]}")
        self.store.put(kv)
        return Loaded(kv, None, 0)

    def read(
        self, prefix: ChunkReader | None, prefix_ids: Sequence[int], placed: Placement, *, lazy: bool,
        events: LayerEvents | None = None,
    ) -> Loaded:  # fmt: skip
        """A chunk of a prompt where its plan places it: `get_or_prefill` with its keys."""
        return self.get_or_prefill(prefix, prefix_ids, placed.ids, placed.keys, isolated=placed.isolated, lazy=lazy,
                                   events=events)  # fmt: skip

    def load_prefix(self, prefix_ids: Sequence[int]) -> Loaded | None:
        """The shared prefix's KV, read whole (it is short, and a prefill after it needs every layer at once)."""
        if not prefix_ids:
            return None
        return self.get_or_prefill(None, (), prefix_ids, (self.keys.own((), prefix_ids),), isolated=False, lazy=False)

    def fill(
        self,
        prefix_ids: Sequence[int],
        chunk_ids: Sequence[Sequence[int]],
        *,
        show_progress: bool = False,
        events: LayerEvents | None = None,
        heads: bool = False,
        progress: Callable[[int], object] | None = None,
    ) -> tuple[int, int]:
        """Make sure each chunk's own entry (after `prefix_ids`) is stored, `events` told of the layers of each
        prefill; with `heads`, a chunk with a context gets its isolated entry too (what it is read from at
        the head of a prompt). `progress(tokens)` is told each chunk's tokens once it is done (for a caller's own
        progress bar). -> (chunks already stored, chunks with an entry computed now)"""
        hits = misses = 0
        loaded = self.load_prefix(prefix_ids)
        prefix = None if loaded is None else loaded.kv
        for ids in tqdm(chunk_ids, desc="precomputing chunk KV", unit="chunk", disable=not show_progress):
            own = self.get_or_prefill(prefix, prefix_ids, ids, (self.keys.own(prefix_ids, ids),), isolated=False,
                                      lazy=True, events=events)  # fmt: skip
            stored = own.tier is not None
            if heads and self.contexts.digest(ids):
                head = self.get_or_prefill(prefix, prefix_ids, ids, (self.keys.isolated(prefix_ids, ids),),
                                           isolated=True, lazy=True, events=events)  # fmt: skip
                stored = stored and head.tier is not None
            hits, misses = hits + stored, misses + (not stored)
            if progress is not None:
                progress(len(ids))
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
