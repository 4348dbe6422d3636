"""Chunks that miss here but are stored for another setup: another dtype of the same model, or another codec.

An entry's key names the model and the dtype it was computed in, and a shared tier keeps it under the codec it was
encoded with, so entries stored by a float32 run are misses to a bfloat16 engine on the same folder, and entries a
peer wrote in int8 are misses to a worker whose tier reads fp16. That is right (reading them would give other
numbers, or nothing at all), but silent. `stored_otherwise` finds, for a request's missing chunks, which other
setup holds them; the request's metrics carry it and `note` says it in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import torch

from ...config import normalize_dtype_name
from ...store import ChunkStore
from .placement import EntryKeys, Placement

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what an engine computes in (`EngineConfig.dtype`)
CODEC_LABEL = "codec "  # a codec's label starts with it ("codec int8"); a dtype's is its name ("float32")


def other_dtype_keys(keys: EntryKeys, fingerprint_in: Callable[[torch.dtype], str | None]) -> list[EntryKeys]:
    """The entry keys of the same model in each other dtype whose fingerprint can be known
    (`models.fingerprint.fingerprint_in`)."""
    others = []
    for dtype in DTYPES:
        fingerprint = fingerprint_in(dtype) if dtype != keys.dtype else None
        if fingerprint is not None:
            others.append(replace(keys, dtype=dtype, fingerprint=fingerprint))
    return others


def stored_otherwise(
    others: Sequence[EntryKeys], store: ChunkStore, prefix_ids: Sequence[int], plan: Sequence[Placement]
) -> dict[str, int]:
    """For the chunks of `plan` that miss, how many are stored for another setup, by label: "float32" (the same
    model computed in that dtype, keyed by `others`) or "codec int8" (this engine's key, in a codec its tiers do not
    read). Each chunk counts once, under the first label found (other dtypes first); {} when every missing chunk is
    new."""
    found: dict[str, int] = {}
    for p in plan:
        if p.found is not None or not p.first:
            continue
        label = _other_dtype(others, store, prefix_ids, p.ids) or _other_codec(store, p.keys)
        if label is not None:
            found[label] = found.get(label, 0) + 1
    return found


def _other_dtype(others: Sequence[EntryKeys], store: ChunkStore, prefix_ids: Sequence[int], ids) -> str | None:
    for other in others:
        candidates = (other.own(prefix_ids, ids), other.isolated(prefix_ids, ids), other.captured(prefix_ids, ids))
        if any(store.codecs_holding(k) for k in dict.fromkeys(candidates)):
            return normalize_dtype_name(other.dtype)
    return None


def _other_codec(store: ChunkStore, keys: Sequence[str]) -> str | None:
    for key in keys:
        codecs = store.codecs_holding(key)
        if codecs:
            return CODEC_LABEL + sorted(codecs)[0]
    return None


def note(stored: Mapping[str, int], dtype: str) -> str | None:
    """One line on `stored_otherwise`'s counts for an engine computing in `dtype`; None when there are none."""
    parts = []
    for label, n in stored.items():
        chunks = f"{n} chunk{'s' if n != 1 else ''} {'is' if n == 1 else 'are'} stored"
        if label.startswith(CODEC_LABEL):
            codec = label[len(CODEC_LABEL) :]
            parts.append(f"{chunks} in the {codec} codec, which this engine's tiers do not read; it recomputes them")
        else:
            parts.append(f"{chunks} for {label}; this engine runs {dtype} and recomputes them")
    return "; ".join(parts) or None
