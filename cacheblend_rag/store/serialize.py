"""Chunk KV to bytes and back, for the tiers that keep it encoded (disk, Redis, and memory with a codec).

The bytes are a safetensors file of two tensors, `keys` and `values`: each layer's K and V as its codec encoded
them (`codec.py`), stacked by layer ([L, Hkv, T, D] in the compute dtype for the `native` codec, [L, bytes] of
uint8 for the quantized ones; for a codec whose payloads vary in length, `pca`, one 1-D uint8 run of every layer's,
with each layer's lengths in the header, format 4; format 5 when its codes are stored against another entry's,
whose key and digest the header records: `layout.py`). The header metadata records a format version, the chunk key,
the codec, the compute dtype, the shape and one sha256 per layer (of that layer's encoded key bytes then value
bytes). Because each tensor is contiguous by layer, layer l is two known byte ranges: a reader can fetch, check and
decode one layer at a time (`EntryLayout`, used by the pipelined loader) or the whole entry at once
(`deserialize_chunk`).
Either way a truncated, garbled, foreign or mislabelled entry, or one written with another codec or by an older
format, raises `CorruptEntryError` (the tier counts a miss) instead of becoming a wrong answer. Nothing here
unpickles: safetensors only ever builds plain tensors.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import struct

import torch
from safetensors.torch import save as _st_save

from ..errors import CacheBlendError, CorruptEntryError, NonFiniteKVError, OrphanedEntryError
from .chunk_kv import ChunkKV
from .codec import NATIVE, CodesCodec, KVCodec, PayloadSpec
from .layout import BaseReader, EntryLayout, all_finite, layer_digest

FORMAT_NAME = "cacheblend-rag/chunk-kv"
# 3: the codec in the header, checksums over the encoded bytes. Older entries are misses and get recomputed
# (2 stored the compute dtype with per-layer checksums; 1 had one checksum over all data).
FORMAT_VERSION = "3"
# 4: a codec whose payloads vary in length (`PayloadSpec.variable`): each tensor is one 1-D run of every layer's
# bytes, and "layer_bytes" records each layer's key and value lengths. Fixed-size codecs still write (and read) 3.
VARIABLE_VERSION = "4"
# 5: as 4, coded against a base entry (`layout.py`): "base" names it and "base_sha256" records its `base_digest`.
DEPENDENT_VERSION = "5"

# safetensors layout: an 8-byte little-endian header length, the JSON header, then the raw tensor data.
_HEADER_LEN = struct.Struct("<Q")
HEADER_LEN_BYTES = _HEADER_LEN.size
# A header for two tensors and our metadata is a few KB (one 64-char digest per layer); far larger is garbage.
_MAX_HEADER_BYTES = 256 * 1024
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8"}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    # A byte view of the tensor's memory, no copy; works for bf16, which numpy cannot represent as such.
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _shape_str(shape: torch.Size | tuple[int, ...]) -> str:
    return ",".join(str(s) for s in shape)


def _dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def stored_name(key: str, codec: KVCodec, hmac_key: bytes | None) -> str:
    """The name a shared tier keeps chunk `key`'s entry under: the key, the codec and, for signed entries, which
    signing key (a digest of it, which tells nothing of the key). Workers that write another codec or sign with
    another key then keep entries of their own beside each other's, where under one name they would each read the
    other's as unreadable and replace it, over and over."""
    name = f"{key}.{codec.name}"
    if hmac_key is not None:
        name += "." + hashlib.sha256(b"cacheblend-rag signing key\0" + hmac_key).hexdigest()[:16]
    return name


def _signature(meta: dict[str, str], hmac_key: bytes) -> str:
    """HMAC-SHA256 of the metadata (every field but the signature itself), which covers each layer's sha256."""
    body = json.dumps({k: v for k, v in meta.items() if k != "hmac"}, sort_keys=True).encode()
    return hmac.new(hmac_key, body, hashlib.sha256).hexdigest()


def serialize_chunk(
    kv: ChunkKV,
    *,
    codec: KVCodec = NATIVE,
    fingerprint: str | None = None,
    hmac_key: bytes | None = None,
    base: BaseReader | None = None,
) -> bytes:
    """Encode a chunk's KV layer by layer with `codec` as safetensors bytes, with a self-describing header and one
    checksum per layer (of the encoded bytes).

    `fingerprint` (the model's) is recorded for inspection only: the key already hashes it. With `hmac_key` the
    header is signed, so a reader holding the key can tell entries written by someone without it. With `base` (a
    stored entry of the same shape and codec, a `CodesCodec`), each layer is coded as its codes' difference from the
    base's, and the entry can only be read beside that base.
    """
    if not all_finite(kv.keys, kv.values):
        raise NonFiniteKVError(f"chunk {kv.key[:12]}'s KV holds NaN or infinity: not stored (the model overflowed "
                               f"in {_dtype_str(kv.dtype)}; float32 avoids that)")  # fmt: skip
    # keys/values: [L, Hkv, T, D] -> payloads [L, *payload shape] (or, variable, one 1-D run of every layer's);
    # safetensors needs CPU, contiguous memory.
    if base is None:
        encoded = [[p.detach().cpu().reshape(-1) for p in codec.encode(*kv.layer(i), i)] for i in range(kv.num_layers)]
    else:
        if not isinstance(codec, CodesCodec) or base.layout.codec.name != codec.name or base.layout.shape != kv.shape:
            raise ValueError(f"chunk {kv.key[:12]} ({_shape_str(kv.shape)}, codec {codec.name!r}) cannot be coded "
                             f"against entry {base.layout.key[:12]} ({_shape_str(base.layout.shape)}, "
                             f"{base.layout.codec.name!r})")  # fmt: skip
        encoded = [
            [p.reshape(-1) for p in codec.encode_against(*kv.layer(i), i, base.codes([i])[0])]
            for i in range(kv.num_layers)
        ]
    digests = [layer_digest(_tensor_bytes(k), _tensor_bytes(v)) for k, v in encoded]
    spec = codec.payload_spec(kv.shape[1:], kv.dtype)
    variable = spec.variable
    if variable:
        keys, values = (torch.cat([layer[j] for layer in encoded]) for j in (0, 1))
    else:
        keys = torch.stack([k.view(spec.key_shape) for k, _ in encoded]).contiguous()
        values = torch.stack([v.view(spec.value_shape) for _, v in encoded]).contiguous()
    metadata = {
        "format": FORMAT_NAME,
        "version": DEPENDENT_VERSION if base is not None else VARIABLE_VERSION if variable else FORMAT_VERSION,
        "key": kv.key,
        "codec": codec.name,
        "dtype": _dtype_str(kv.dtype),
        "shape": _shape_str(kv.shape),
        "layer_sha256": ",".join(digests),
    }
    if variable:
        metadata["layer_bytes"] = ",".join(f"{k.numel()}:{v.numel()}" for k, v in encoded)
    if base is not None:
        metadata["base"], metadata["base_sha256"] = base.layout.key, base.digest
    if fingerprint is not None:
        metadata["fingerprint"] = fingerprint
    if hmac_key is not None:
        metadata["hmac"] = _signature(metadata, hmac_key)
    return _st_save({"keys": keys, "values": values}, metadata=metadata)


def header_length(head: bytes | memoryview, key: str) -> int:
    """Bytes taken by the length field and the JSON header, from the entry's first 8 bytes."""
    if len(head) < _HEADER_LEN.size:
        raise CorruptEntryError(f"entry {key[:12]} is {len(head)} bytes long, too short for a safetensors header")
    (n,) = _HEADER_LEN.unpack_from(head)
    if n > _MAX_HEADER_BYTES:
        raise CorruptEntryError(f"entry {key[:12]} declares a {n}-byte header: garbled")
    return _HEADER_LEN.size + n


def parse_layout(
    head: bytes | memoryview,
    key: str,
    total_bytes: int,
    *,
    codec: KVCodec = NATIVE,
    hmac_key: bytes | None = None,
) -> EntryLayout:
    """Read the layout of an entry of `total_bytes` from its first bytes (at least `header_length` of them).

    Checks everything the header alone can tell: format, version, key, that the entry was written with `codec`
    (the reader's), dtype, shape, that both tensors' offsets match what the codec makes of that shape, that the
    entry is as long as the header says and, with `hmac_key`, the header's signature. Any malformed header (bad
    JSON, nesting too deep, wrong types) is a CorruptEntryError.
    """
    n = header_length(head, key)
    if len(head) < n or total_bytes < n:
        raise CorruptEntryError(f"entry {key[:12]} declares a {n}-byte header but holds {total_bytes} bytes: truncated")
    try:
        header = json.loads(bytes(head[_HEADER_LEN.size : n]))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." nested too deep
        raise CorruptEntryError(f"entry {key[:12]} has an unreadable header: {type(exc).__name__}") from exc
    try:
        layout = _layout_from_header(header, key, n, total_bytes, codec, hmac_key)
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
        raise CorruptEntryError(f"entry {key[:12]} has a malformed header ({type(exc).__name__}: {exc})") from exc
    return layout


def _layout_from_header(
    header: object, key: str, n: int, total_bytes: int, codec: KVCodec, hmac_key: bytes | None
) -> EntryLayout:
    if not isinstance(header, dict):
        raise CorruptEntryError(f"entry {key[:12]} has a header that is not a JSON object")
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CorruptEntryError(f"entry {key[:12]} is not a {FORMAT_NAME} entry (header metadata {str(meta)[:200]})")
    if meta.get("version") not in (FORMAT_VERSION, VARIABLE_VERSION, DEPENDENT_VERSION):
        raise CorruptEntryError(
            f"entry {key[:12]} has format version {str(meta.get('version'))[:20]!r}, "
            f"this build reads {FORMAT_VERSION!r} to {DEPENDENT_VERSION!r}"
        )
    if meta.get("key") != key:
        raise CorruptEntryError(f"entry stored under {key[:12]} belongs to chunk {str(meta.get('key'))[:12]}")
    if hmac_key is not None:
        signature = meta.get("hmac")
        if not isinstance(signature, str) or not hmac.compare_digest(signature, _signature(meta, hmac_key)):
            raise CorruptEntryError(f"entry {key[:12]} is not signed with this engine's HMAC key: refused")
    if meta.get("codec") != codec.name:
        raise CorruptEntryError(
            f"entry {key[:12]} was written with codec {str(meta.get('codec'))[:20]!r}, this tier reads {codec.name!r}"
        )
    dtype = _DTYPES.get(str(meta.get("dtype")))
    try:
        shape = tuple(int(s) for s in str(meta.get("shape")).split(","))
    except ValueError:
        shape = ()
    digests = tuple(str(meta.get("layer_sha256", "")).split(","))
    if dtype is None or len(shape) != 4 or min(shape) < 0 or len(digests) != shape[0]:
        raise CorruptEntryError(
            f"entry {key[:12]} has an inconsistent header: dtype {str(meta.get('dtype'))[:20]!r}, "
            f"shape {str(meta.get('shape'))[:40]!r}, {len(digests)} layer checksums"
        )
    if set(header) != {"__metadata__", "keys", "values"}:
        raise CorruptEntryError(f"entry {key[:12]} must hold exactly 'keys' and 'values', got {sorted(header)[:8]}")
    spec = codec.payload_spec(shape[1:], dtype)  # type: ignore[arg-type]
    dependent = meta["version"] == DEPENDENT_VERSION
    base, base_sha = (str(meta.get("base", "")), str(meta.get("base_sha256", ""))) if dependent else ("", "")
    if dependent and not (isinstance(codec, CodesCodec) and len(base) == len(key) and len(base_sha) == 64):
        raise CorruptEntryError(f"entry {key[:12]} is coded against another entry, which codec {codec.name!r} "
                                f"cannot decode, or names its base wrongly ({base[:20]!r})")  # fmt: skip
    if meta["version"] not in ((VARIABLE_VERSION, DEPENDENT_VERSION) if spec.variable else (FORMAT_VERSION,)):
        raise CorruptEntryError(f"entry {key[:12]} has format version {str(meta['version'])!r}, which codec "
                                f"{codec.name!r} does not write")  # fmt: skip
    sizes = _layer_sizes(meta, spec, shape[0]) if spec.variable else None
    starts, ends, offsets_of = {}, [], {}
    for j, (name, payload_shape, layer_bytes) in enumerate(
        zip(("keys", "values"), (spec.key_shape, spec.value_shape), spec.nbytes(), strict=True)
    ):
        lengths = [s[j] for s in sizes] if sizes is not None else [layer_bytes] * shape[0]  # bytes per layer
        want_shape = [sum(lengths)] if sizes is not None else [shape[0], *payload_shape]
        info = header.get(name)
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or any(type(o) is not int or o < 0 for o in offsets)
            or info.get("dtype") != _ST_DTYPES[spec.dtype]
            or info.get("shape") != want_shape
            or offsets[1] - offsets[0] != sum(lengths)
        ):
            raise CorruptEntryError(f"entry {key[:12]} lacks a valid '{name}' tensor (header entry {str(info)[:200]})")
        starts[name] = n + offsets[0]
        ends.append(n + offsets[1])
        offsets_of[name] = tuple(itertools.accumulate(lengths, initial=0))  # bytes (variable payloads are uint8)
    if max(ends) != total_bytes:
        raise CorruptEntryError(
            f"entry {key[:12]} holds {total_bytes} bytes, its header describes {max(ends)}: truncated"
        )
    return EntryLayout(key, codec, dtype, shape, starts["keys"], starts["values"], digests, total_bytes,  # type: ignore[arg-type]
                       offsets_of["keys"], offsets_of["values"], base, base_sha)  # fmt: skip


def _layer_sizes(meta: dict[str, object], spec: PayloadSpec, num_layers: int) -> list[tuple[int, int]]:
    """A variable entry's "layer_bytes" ("k0:v0,k1:v1,...") -> [(key bytes, value bytes)] per layer."""
    sizes = [tuple(int(x) for x in pair.split(":")) for pair in str(meta.get("layer_bytes", "")).split(",")]
    if len(sizes) != num_layers or any(len(s) != 2 or min(s) < 0 for s in sizes):
        raise CorruptEntryError(f"entry {str(meta.get('key'))[:12]} has an invalid layer_bytes field")
    return sizes  # type: ignore[return-value]


def deserialize_chunk(
    data: bytes,
    key: str,
    *,
    codec: KVCodec = NATIVE,
    hmac_key: bytes | None = None,
    base: BaseReader | None = None,
) -> ChunkKV:
    """Decode bytes written by `serialize_chunk` with `codec`, checking that they are whole and belong to `key`; a
    dependent entry with its `base` (`read_base`).

    Raises `CorruptEntryError` naming what is wrong; never returns a partly valid entry.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CorruptEntryError(f"entry {key[:12]} holds a {type(data).__name__}, not bytes")
    layout = parse_layout(data, key, len(data), codec=codec, hmac_key=hmac_key)
    if layout.base:
        check_base(layout, base)
    # Each layer is checked against its sha256 straight from the buffer (memoryview slices, no copy), then decoded:
    # the layout checked offsets and lengths, the checksums check the bytes themselves.
    view = memoryview(data)
    layers = []
    for i in range(layout.num_layers):
        (k0, k1), (v0, v1) = layout.layer_ranges(i)
        codes = base.codes([i])[0] if layout.base and base is not None else None
        layers.append(layout.decode_layer(i, view[k0:k1], view[v0:v1], base=codes))
    try:
        return ChunkKV(key, torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers]),  # [L, Hkv, T, D]
                       base=layout.base)  # fmt: skip
    except (CacheBlendError, RuntimeError) as exc:
        raise CorruptEntryError(f"entry {key[:12]} does not describe a chunk: {exc}") from exc


def read_base(data: bytes, key: str, *, codec: KVCodec, hmac_key: bytes | None = None) -> BaseReader:
    """The codes of entry `key` held in `data`, as a base that dependents decode against (CorruptEntryError if the
    entry is damaged or cannot be a base)."""
    view = memoryview(data)
    layout = parse_layout(view, key, len(view), codec=codec, hmac_key=hmac_key)
    return BaseReader(layout, lambda ranges: [view[a:b] for a, b in ranges])


def check_base(layout: EntryLayout, base: BaseReader | None) -> None:
    """That `base` is the entry the dependent `layout` was coded against, as it was then; else CorruptEntryError
    (`OrphanedEntryError` when it is missing or was replaced: the dependent is a miss, as if evicted)."""
    if base is None:
        raise OrphanedEntryError(f"entry {layout.key[:12]} is coded against entry {layout.base[:12]}, which is not "
                             f"stored any more")  # fmt: skip
    if base.layout.key != layout.base or base.digest != layout.base_digest or base.layout.shape != layout.shape:
        raise OrphanedEntryError(f"entry {layout.key[:12]} is coded against entry {layout.base[:12]}, which was "
                             f"replaced since")  # fmt: skip
