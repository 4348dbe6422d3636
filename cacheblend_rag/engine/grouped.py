"""Grouped precompute: a corpus's chunk KV from full prefills of groups of similar chunks.

`engine.precompute(chunks, context="groups")` lays the chunks out in groups of similar chunks
(`retrieval.groups`), stores every chunk's isolated entry (what the first chunk of a prompt reads), then runs one
full prefill per group and stores each later chunk's KV from it as its captured entry: the entry a chunk after the
first of a prompt reads under `capture="all"` (the default), as if an earlier request had held the group. Each
chunk's KV is thus computed after text like what precedes it in real prompts for about twice its own tokens (its
isolated entry, its place in one group), where neighbour context (`context="neighbours"`) prefills each chunk's
neighbours again for every chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from ..errors import ConfigError
from .capture import capturable
from .chunk_cache import ChunkCache
from .prefill import Prefiller
from .prompt import TokenizedPrompt

GROUPS = "groups"  # `precompute(context=...)`: full prefills of groups of similar chunks, stored as captured KV
DEFAULT_GROUP_TOKENS = 3072  # about a RAG prompt's chunks (6 of 512 tokens): each group's prefill is one such


def group_texts(texts: Sequence[str], lengths: Sequence[int], group_tokens: int) -> list[list[str]]:
    """`texts` (each once) in groups of similar texts of at most `group_tokens` tokens (`lengths` per text), each in
    prefill order (`retrieval.groups.text_groups`, by the packaged embedder)."""
    from ..retrieval.groups import text_groups  # the embedder loads only for grouped precompute

    first = {t: i for i, t in reversed(list(enumerate(texts)))}
    unique = sorted(first.values())
    found = text_groups([texts[i] for i in unique], [lengths[i] for i in unique], group_tokens)
    return [[texts[unique[j]] for j in group] for group in found]


def check_groups_policy(capture_policy: str) -> None:
    """Grouped precompute stores captured entries, which requests read only under capture="all"."""
    if capture_policy != "all":
        raise ConfigError(
            f"context='groups' stores each chunk's KV as a group's full prefill computes it (a captured entry), "
            f"which requests read only under capture='all' (the default); this engine's capture policy is "
            f"{capture_policy!r}. Use context='neighbours' or None, or capture='all' without context_neighbours"
        )


def fill_groups(
    chunks: ChunkCache,
    prefiller: Prefiller,
    prefix_ids: Sequence[int],
    groups: Sequence[Sequence[Sequence[int]]],
    *,
    show_progress: bool = False,
) -> tuple[int, int]:
    """Store every chunk's isolated entry, then each group's later chunks' KV from one full prefill of the prefix
    and the group (one token after it, id 0, closes the prompt; causal attention leaves the chunks' KV as it is). A
    group whose entries are all stored is not prefilled again. -> (chunks whose entries were all stored already,
    chunks with an entry computed now)."""
    groups = [tuple(tuple(ids) for ids in group) for group in groups]
    unique = list(dict.fromkeys(ids for group in groups for ids in group))
    prompts = [TokenizedPrompt(tuple(prefix_ids), group, (0,)) for group in groups]
    # what is missing before anything runs: an isolated entry, or a captured entry at a group's later place
    missing = {ids for ids in unique if chunks.key(prefix_ids, ids, isolated=True) not in chunks.store}
    missing |= {p.chunk_ids[j] for p in prompts for j in capturable(chunks, p, "all")}
    chunks.fill(prefix_ids, unique, show_progress=show_progress)
    bar = tqdm(total=len(prompts), desc="prefilling chunk groups", unit="group", disable=not show_progress)
    for prompt in prompts:
        for kv in prefiller.capture_full(prompt, capturable(chunks, prompt, "all"), "all").values():
            chunks.store.put(kv)
        bar.update()
    bar.close()
    return len(unique) - len(missing), len(missing)
