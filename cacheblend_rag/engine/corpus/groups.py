"""Grouped precompute: a corpus's chunk KV from full prefills of groups of similar chunks.

`engine.precompute(chunks)` (under `chunk_context="grouped"`, the default, or with `context="groups"`) lays the
chunks out in groups of similar chunks (`retrieval.groups`) and runs one full prefill per group: each later chunk's
KV from it is stored as its captured entry (the entry a chunk after the first of a prompt reads, as if an earlier
request had held the group), the group's first chunk's as its isolated entry (what the first chunk of a prompt
reads), and the later chunks' isolated entries are prefilled alone, so every chunk has both. Each chunk's KV is thus
computed after text like what precedes it in real prompts, for about twice its own tokens (its isolated entry, its
place in one group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from ...errors import ConfigError
from ..chunks.cache import ChunkCache
from ..chunks.placement import to_capture
from ..prefill.prefiller import Prefiller
from ..request.prompt import TokenizedPrompt

GROUPS = "groups"  # `precompute(context=...)`: full prefills of groups of similar chunks, stored as captured KV
# the precompute bar: tokens done, with the time spent and the time left
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} tokens [{elapsed} spent, {remaining} left, {rate_fmt}{postfix}]"


@dataclass(frozen=True)
class PrecomputePlan:
    """What a precompute is about to compute, known before its first prefill (`precompute(on_plan=...)`)."""

    chunks: int  # distinct chunks of the corpus
    stored: int  # chunks whose entries are all stored already: nothing is computed for them
    # chunks with an entry stored (a request stores the one its prompt computed: alone for its first chunk, in the
    # prompt's context for the others) and another one missing, computed now
    partly_stored: int
    alone: int  # chunks prefilled on their own, for their isolated entry (not grouped: for their own entry)
    alone_tokens: int
    groups: int  # groups prefilled whole, for their chunks' in-group entries (0 when not grouped)
    group_tokens: int  # the tokens of those groups' prompts
    all_groups: int  # the corpus's groups (0 when not grouped)

    @property
    def computed(self) -> int:
        """Chunks with an entry computed now."""
        return self.chunks - self.stored

    @property
    def tokens(self) -> int:
        """Tokens to prefill in all."""
        return self.alone_tokens + self.group_tokens


def group_indexes(texts: Sequence[str], lengths: Sequence[int], group_tokens: int) -> list[list[int]]:
    """The indexes of `texts` (the first of repeated texts only) in groups of similar texts of at most
    `group_tokens` tokens (`lengths` per text), each in prefill order (`retrieval.groups.text_groups`, by the
    packaged embedder)."""
    from ...retrieval.groups import text_groups  # the embedder loads only for grouped precompute

    first = {t: i for i, t in reversed(list(enumerate(texts)))}
    unique = sorted(first.values())
    found = text_groups([texts[i] for i in unique], [lengths[i] for i in unique], group_tokens)
    return [[unique[j] for j in group] for group in found]


def check_groups_policy(capture_policy: str) -> None:
    """Grouped precompute stores captured entries, which requests read only under the capture policy "all"."""
    if capture_policy != "all":
        raise ConfigError(
            "context='groups' stores each chunk's KV as a group's full prefill computes it (a captured entry), "
            "which this engine's requests never read (chunk_context='isolated'); use context=None, or "
            "EngineConfig(chunk_context='grouped'), the default"
        )


def fill_groups(
    chunks: ChunkCache,
    prefiller: Prefiller,
    prefix_ids: Sequence[int],
    groups: Sequence[Sequence[Sequence[int]]],
    *,
    show_progress: bool = False,
    on_plan: Callable[[PrecomputePlan], object] | None = None,
) -> tuple[int, int]:
    """Store each group's chunks from one full prefill of the prefix and the group (one token after it, id 0, closes
    the prompt; causal attention leaves the chunks' KV as it is): the first chunk's isolated entry, the later
    chunks' captured entries; the later chunks' isolated entries are prefilled alone. A group whose entries are
    all stored is not prefilled again; the chunks of one that is are all computed in it (those stored already are
    not stored again). `on_plan` is told what will be computed before the first prefill. -> (chunks whose entries
    were all stored already, chunks with an entry computed now)."""
    groups = [tuple(tuple(ids) for ids in group) for group in groups]
    unique = list(dict.fromkeys(ids for group in groups for ids in group))
    prompts = [TokenizedPrompt(tuple(prefix_ids), group, (0,)) for group in groups]
    # each group's entries not stored yet (its first chunk's is its isolated entry), asked of the store once
    plans = [chunks.place(p.prefix_ids, p.chunk_ids, "all") for p in prompts]
    pending = [to_capture(plan) for plan in plans]
    # a later chunk's isolated entry needs a prefill of its own; a first chunk's comes with its group's
    later = list(dict.fromkeys(ids for group in groups for ids in group[1:]))
    alone = [ids for ids in later if chunks.key(prefix_ids, ids, isolated=True) not in chunks.store]
    full = [(prompt, todo) for prompt, todo in zip(prompts, pending, strict=True) if todo]
    missing = set(alone) | {placed.ids for _, todo in full for placed in todo}
    alone_tokens, group_tokens = sum(map(len, alone)), sum(prompt.num_tokens for prompt, _ in full)
    if on_plan is not None:

        def has_entry(ids: tuple[int, ...]) -> bool:  # stored alone, or captured in a request's prompt
            keys = (chunks.key(prefix_ids, ids, isolated=True), chunks.key(prefix_ids, ids, captured=True))
            return any(k in chunks.store for k in keys)

        partly = sum(map(has_entry, missing))
        on_plan(PrecomputePlan(len(unique), len(unique) - len(missing), partly, len(alone), alone_tokens, len(full),
                               group_tokens, len(groups)))  # fmt: skip
    # one bar over the tokens to prefill: the chunks alone, then the groups (a group's prompt whole)
    with tqdm(total=alone_tokens + group_tokens, desc="precomputing chunk KV", unit="tok", unit_scale=True,
              bar_format=BAR_FORMAT, disable=not show_progress) as bar:  # fmt: skip
        bar.set_postfix_str(f"{len(alone)} chunks alone, then {len(full)} groups")
        chunks.fill(prefix_ids, alone, progress=bar.update)
        for i, (prompt, todo) in enumerate(full):
            bar.set_postfix_str(f"group {i + 1} of {len(full)}")
            for kv in prefiller.capture_full(prompt, todo).values():
                chunks.store.put(kv)
            bar.update(prompt.num_tokens)
    return len(unique) - len(missing), len(missing)
