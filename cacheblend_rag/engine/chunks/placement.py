"""Which stored entry each chunk of a prompt reads: one plan per request, made before any KV is read.

A chunk can have several entries in the store, each its KV prefilled after other text:
- its *isolated* entry, prefilled after the shared prefix alone;
- its *own* entry, prefilled after the prefix and the context recorded for it (`context.ChunkContexts`; with no
  context recorded, the own entry is the isolated one);
- its *captured* entries (capture policy "all"), the KV a full prefill gave it after the chunks before it in that
  prompt, or in a group of similar chunks at precompute. One of them names the near copies of the chunk it was
  cached after (`context.copies_before`), so that it is read only where the prompt shows them before it too.

The rules (`place_chunks`), per chunk of the prompt:
1. The first chunk's real context is the prefix alone: it reads its isolated entry, never a captured one.
2. So does a later chunk whose recorded context holds a chunk placed after it in this prompt: that entry has read
   text the prompt shows only later, and recomputing the later chunk then makes it a repeat.
3. Under "all", a later chunk reads a captured entry cached after the near copies shown before it (all of them,
   then smaller sets), then its plain captured entry, then its own.
4. Otherwise it reads its own entry.
A chunk no entry of which is stored is a miss: it is prefilled into the last key of its list (the one it reads
first when nothing else is there). A full prefill of the prompt computes the chunk's first entry exactly when the
chunk is first, when the policy is "all" (the captured entry is by definition what the prompt computed), or when
its recorded context is exactly the chunks before it; the chunk is then *captured* from that prefill, at its first
place in the prompt, unless that entry is stored.

`EntryKeys` makes the store keys; `place_chunks` is pure given a `stored(key)` predicate, so it is tested
without a model (tests/test_placement.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ...store import chunk_key
from .context import ChunkContexts, copies_before, copies_digest, copy_sets

CAPTURED = "captured"  # the context recorded in the keys of captured entries
CAPTURE_POLICIES = ("exact", "all")


@dataclass(frozen=True)
class EntryKeys:
    """The store keys of one model's chunk entries in one dtype, and the contexts the own entries are built after."""

    fingerprint: str
    dtype: torch.dtype
    contexts: ChunkContexts
    max_positions: int  # the model's context length: a recorded context is cut to fit it with the chunk

    def isolated(self, prefix_ids: Sequence[int], ids: Sequence[int]) -> str:
        """The entry prefilled after the prefix alone."""
        return chunk_key(self.fingerprint, self.dtype, prefix_ids, ids, "")

    def own(self, prefix_ids: Sequence[int], ids: Sequence[int]) -> str:
        """The entry prefilled after the prefix and the chunk's recorded context (the isolated one without)."""
        return chunk_key(self.fingerprint, self.dtype, prefix_ids, ids, self.contexts.digest(ids))

    def captured(self, prefix_ids: Sequence[int], ids: Sequence[int], copies: Sequence[Sequence[int]] = ()) -> str:
        """A captured entry, cached after the near copies `copies` of the chunk (none: the plain captured entry)."""
        digest = f"{CAPTURED}:{copies_digest(copies)}" if copies else CAPTURED
        return chunk_key(self.fingerprint, self.dtype, prefix_ids, ids, digest)

    def context_of(self, prefix_ids: Sequence[int], ids: Sequence[int]) -> tuple[int, ...]:
        """The tokens the chunk's own entry is prefilled after, between the prefix and the chunk: its recorded
        context, cut from its start to what fits the model (the nearest neighbour, placed last, stays)."""
        context = self.contexts.tokens(ids)
        room = max(self.max_positions - len(prefix_ids) - len(ids), 0)
        return context[len(context) - room :] if len(context) > room else context


@dataclass(frozen=True)
class Placement:
    """Where one chunk of a prompt reads its KV from."""

    position: int  # the chunk's place among the prompt's chunks
    ids: tuple[int, ...]  # its tokens
    keys: tuple[str, ...]  # the entries it may read, best first; a miss is prefilled into the last one
    found: str | None  # the first of `keys` the store records; None: a miss
    isolated: bool  # it reads its isolated entry (the first chunk, or rule 2)
    exact: bool  # a full prefill of this prompt computes `keys[0]` exactly
    first: bool  # the chunk's first place in the prompt (a repeated chunk is computed and captured once)

    @property
    def fill_key(self) -> str:
        """The entry a miss is prefilled into."""
        return self.keys[-1]

    @property
    def capture(self) -> bool:
        """Whether a full prefill of this prompt stores this chunk's best entry: computed exactly, at the chunk's
        first place, and not stored yet."""
        return self.first and self.exact and self.found != self.keys[0]

    @property
    def reads_captured(self) -> bool:
        """Whether the entry found is a captured one, rather than the chunk's own."""
        return self.found is not None and self.found != self.fill_key


def place_chunks(
    keys: EntryKeys,
    prefix_ids: Sequence[int],
    chunk_ids: Sequence[Sequence[int]],
    stored: Callable[[str], bool],
    policy: str,
) -> tuple[Placement, ...]:
    """One `Placement` per chunk of the prompt, in order, under capture `policy` ("exact" or "all"); `stored(key)`
    says whether the store records an entry (asked for each chunk's keys in order, until one is found)."""
    if policy not in CAPTURE_POLICIES:
        raise ValueError(f"capture policy must be one of {CAPTURE_POLICIES}, got {policy!r}")
    ids = [tuple(c) for c in chunk_ids]
    later = keys.contexts.holds_later(ids)
    copies = copies_before(ids) if policy == "all" else [()] * len(ids)
    out: list[Placement] = []
    seen: set[tuple[int, ...]] = set()
    before: list[int] = []  # the chunk tokens before the current chunk
    for j, c in enumerate(ids):
        isolated = j == 0 or later[j]
        if isolated:
            read: tuple[str, ...] = (keys.isolated(prefix_ids, c),)
        elif policy == "all":
            after = [keys.captured(prefix_ids, c, s) for s in copy_sets(copies[j])]
            read = (*after, keys.captured(prefix_ids, c), keys.own(prefix_ids, c))
        else:
            read = (keys.own(prefix_ids, c),)
        exact = j == 0 or (not isolated and (policy == "all" or keys.context_of(prefix_ids, c) == tuple(before)))
        found = next((k for k in read if stored(k)), None)
        out.append(Placement(j, c, read, found, isolated, exact, c not in seen))
        seen.add(c)
        before.extend(c)
    return tuple(out)


def missing_chunks(plan: Sequence[Placement]) -> list[tuple[int, ...]]:
    """The distinct chunks of a plan with no stored entry to read, in prompt order."""
    return list(dict.fromkeys(p.ids for p in plan if p.found is None))


def to_capture(plan: Sequence[Placement]) -> list[Placement]:
    """The chunks whose entries a full prefill of the prompt stores (`Placement.capture`), in prompt order."""
    return [p for p in plan if p.capture]
