"""Chunk KV to bytes and back, for the tiers that live outside the process (disk, Redis).

The bytes are a safetensors file (two tensors, `keys` and `values`) whose header metadata records a format
version, the chunk key, the dtype, the shape and a sha256 of the tensor data. Loading checks all of them, so a
truncated, garbled, foreign or mislabelled entry raises `CorruptEntryError` instead of becoming a wrong answer.
Nothing here unpickles: safetensors only ever builds plain tensors.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from ..errors import CacheBlendError
from .chunk_kv import ChunkKV

FORMAT_NAME = "cacheblend-rag/chunk-kv"
FORMAT_VERSION = "1"

# safetensors layout: an 8-byte little-endian header length, the JSON header, then the raw tensor data.
_HEADER_LEN = struct.Struct("<Q")
# A header for two tensors and our metadata is a few hundred bytes; anything far larger is garbage.
_MAX_HEADER_BYTES = 1 << 20


class CorruptEntryError(CacheBlendError):
    """Stored bytes are not a valid chunk KV entry for the key they were found under.

    Stores catch it, drop the entry and report a miss: the chunk is then recomputed.
    """


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    # A byte view of the tensor's memory, no copy; works for bf16, which numpy cannot represent as such.
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _shape_str(shape: torch.Size | tuple[int, ...]) -> str:
    return ",".join(str(s) for s in shape)


def _dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def serialize_chunk(kv: ChunkKV, *, fingerprint: str | None = None) -> bytes:
    """Encode a chunk's KV as safetensors bytes with a self-describing, checksummed header.

    `fingerprint` (the model's) is recorded for inspection only: the key already hashes it.
    """
    # keys/values: [L, Hkv, T, D]; safetensors needs CPU, contiguous memory (no-ops when already so).
    keys = kv.keys.detach().to("cpu").contiguous()
    values = kv.values.detach().to("cpu").contiguous()
    digest = hashlib.sha256()
    digest.update(_tensor_bytes(keys))
    digest.update(_tensor_bytes(values))
    metadata = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "key": kv.key,
        "dtype": _dtype_str(keys.dtype),
        "shape": _shape_str(keys.shape),
        "sha256": digest.hexdigest(),
    }
    if fingerprint is not None:
        metadata["fingerprint"] = fingerprint
    return _st_save({"keys": keys, "values": values}, metadata=metadata)


def _read_header(data: bytes, key: str) -> dict:
    if len(data) < _HEADER_LEN.size:
        raise CorruptEntryError(f"entry {key[:12]} is {len(data)} bytes long, too short for a safetensors header")
    (n,) = _HEADER_LEN.unpack_from(data)
    if n > _MAX_HEADER_BYTES or _HEADER_LEN.size + n > len(data):
        raise CorruptEntryError(
            f"entry {key[:12]} declares a {n}-byte header but holds {len(data)} bytes: truncated or garbled"
        )
    try:
        header = json.loads(data[_HEADER_LEN.size : _HEADER_LEN.size + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptEntryError(f"entry {key[:12]} has an unreadable header: {exc}") from exc
    if not isinstance(header, dict):
        raise CorruptEntryError(f"entry {key[:12]} has a header that is not a JSON object")
    return header


def deserialize_chunk(data: bytes, key: str) -> ChunkKV:
    """Decode bytes written by `serialize_chunk`, checking that they are whole and belong to `key`.

    Raises `CorruptEntryError` naming what is wrong; never returns a partly valid entry.
    """
    header = _read_header(data, key)
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CorruptEntryError(f"entry {key[:12]} is not a {FORMAT_NAME} entry (header metadata {meta!r})")
    if meta.get("version") != FORMAT_VERSION:
        raise CorruptEntryError(
            f"entry {key[:12]} has format version {meta.get('version')!r}, this build reads {FORMAT_VERSION!r}"
        )
    if meta.get("key") != key:
        raise CorruptEntryError(f"entry stored under {key[:12]} belongs to chunk {str(meta.get('key'))[:12]}")

    # Checksum the data section straight from the buffer (memoryview slices, no copy) before building tensors:
    # safetensors checks offsets and lengths but not the bytes themselves.
    base = _HEADER_LEN.size + _HEADER_LEN.unpack_from(data)[0]
    view = memoryview(data)
    digest = hashlib.sha256()
    for name in ("keys", "values"):
        info = header.get(name)
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= len(data) - base
        ):
            raise CorruptEntryError(f"entry {key[:12]} lacks a valid '{name}' tensor (header entry {info!r})")
        digest.update(view[base + offsets[0] : base + offsets[1]])
    if digest.hexdigest() != meta.get("sha256"):
        raise CorruptEntryError(f"entry {key[:12]} fails its sha256 check: the tensor data was altered or cut")

    try:
        tensors = _st_load(data)
    except Exception as exc:  # safetensors raises its own error types (and ValueError) for malformed files
        raise CorruptEntryError(f"entry {key[:12]} is not a readable safetensors file: {exc}") from exc
    keys, values = tensors.get("keys"), tensors.get("values")
    if keys is None or values is None or len(tensors) != 2:
        raise CorruptEntryError(f"entry {key[:12]} must hold exactly 'keys' and 'values', got {sorted(tensors)}")
    for name, t in (("keys", keys), ("values", values)):
        if _dtype_str(t.dtype) != meta.get("dtype") or _shape_str(t.shape) != meta.get("shape"):
            raise CorruptEntryError(
                f"entry {key[:12]}: '{name}' is {_dtype_str(t.dtype)} {tuple(t.shape)}, "
                f"the header says {meta.get('dtype')} ({meta.get('shape')})"
            )
    try:
        return ChunkKV(key, keys, values)  # [L, Hkv, T, D] each
    except CacheBlendError as exc:
        raise CorruptEntryError(f"entry {key[:12]} does not describe a chunk: {exc}") from exc
