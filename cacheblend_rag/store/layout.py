"""Where each layer of a stored entry lies, and how one layer's bytes are checked and decoded (`EntryLayout`, read
from the entry's header by `serialize.parse_layout`).

An entry may be coded against another: a chunk's captured entry (KV cut from a prompt, after other chunks) shares
most of its codes with the chunk's isolated entry, so a tier that holds the isolated entry stores the captured one
as the difference of their codes (`CodesCodec`; about 3.2 bits a value where the entry alone takes 5). Such a
*dependent* entry names its *base*: the base's key and a digest of the base's layer checksums (`base_digest`). A
reader opens both; a base that is gone or was replaced makes the dependent a miss, never wrong KV, and layer l
decodes from both entries' layer-l bytes (`BaseReader`), so loading still goes one layer at a time.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import CorruptEntryError
from .codec import CodesCodec, KVCodec, PayloadSpec

Codes = tuple[torch.Tensor, torch.Tensor]  # one layer's key codes and value codes
# Reads the given [start, end) byte ranges of an entry; returns one buffer per range (shorter if the entry is gone
# or cut, which `EntryLayout.payloads` reports as a truncated entry).
RangeReader = Callable[[Sequence[tuple[int, int]]], Sequence[bytes | memoryview]]


def layer_digest(key_bytes: memoryview | bytes, value_bytes: memoryview | bytes) -> str:
    h = hashlib.sha256()
    h.update(key_bytes)
    h.update(value_bytes)
    return h.hexdigest()


@dataclass(frozen=True)
class EntryLayout:
    """Where each layer of a stored entry lies, the checksum it must have and how to decode it. Offsets are from
    the entry start. A dependent entry (`base` not empty) decodes only with its base's codes."""

    key: str
    codec: KVCodec
    dtype: torch.dtype  # the compute dtype the layers decode to
    shape: tuple[int, int, int, int]  # [L, Hkv, T, D]
    keys_start: int
    values_start: int
    layer_sha256: tuple[str, ...]
    total_bytes: int  # the whole entry: header and data
    # where each layer's payloads start, from keys_start and values_start, and the end ([L + 1] each)
    key_offsets: tuple[int, ...]
    value_offsets: tuple[int, ...]
    base: str = ""  # the key of the entry this one is coded against ("": coded alone)
    base_digest: str = ""  # that entry's `base_digest` when this one was written

    @property
    def num_layers(self) -> int:
        return self.shape[0]

    @functools.cached_property
    def payload(self) -> PayloadSpec:
        """The dtype and shapes of one layer's encoded keys and values (a typical length, for a variable codec)."""
        return self.codec.payload_spec(self.shape[1:], self.dtype)

    @property
    def payload_nbytes(self) -> int:
        """Stored bytes of every layer's encoded keys and values."""
        return self.key_offsets[-1] + self.value_offsets[-1]

    def layer_nbytes(self, layer_idx: int) -> int:
        """Stored bytes of one layer: encoded keys and values together."""
        (k0, k1), (v0, v1) = self.layer_ranges(layer_idx)
        return k1 - k0 + v1 - v0

    def layer_ranges(self, layer_idx: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """[start, end) of layer `layer_idx`'s encoded keys and of its encoded values."""
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"layer {layer_idx} out of range for an entry of {self.num_layers} layers")
        k, v = self.keys_start, self.values_start
        ko, vo = self.key_offsets, self.value_offsets
        return (k + ko[layer_idx], k + ko[layer_idx + 1]), (v + vo[layer_idx], v + vo[layer_idx + 1])

    def payloads(
        self, layer_idx: int, key_bytes: bytes | memoryview, value_bytes: bytes | memoryview, *, verify: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Check one layer's bytes (length, and with `verify` its checksum): -> its key and value payloads."""
        spec = self.payload
        (k0, k1), (v0, v1) = self.layer_ranges(layer_idx)
        want_k, want_v = k1 - k0, v1 - v0
        if len(key_bytes) != want_k or len(value_bytes) != want_v:
            raise CorruptEntryError(
                f"entry {self.key[:12]}: layer {layer_idx} read {len(key_bytes)}+{len(value_bytes)} bytes, "
                f"expected {want_k}+{want_v}: truncated, or evicted while being read"
            )
        if verify and layer_digest(key_bytes, value_bytes) != self.layer_sha256[layer_idx]:
            raise CorruptEntryError(f"entry {self.key[:12]}: layer {layer_idx} fails its sha256 check")
        key_shape, value_shape = ((want_k,), (want_v,)) if spec.variable else (spec.key_shape, spec.value_shape)
        return _from_bytes(key_bytes, spec.dtype, key_shape), _from_bytes(value_bytes, spec.dtype, value_shape)

    def decode_layer(
        self,
        layer_idx: int,
        key_bytes: bytes | memoryview,
        value_bytes: bytes | memoryview,
        *,
        verify: bool = True,
        base: Codes | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Check one layer's bytes and decode them: -> k, v [Hkv, T, D]. A dependent entry needs `base`, its base
        entry's codes of the same layer (`BaseReader.codes`)."""
        key_payload, value_payload = self.payloads(layer_idx, key_bytes, value_bytes, verify=verify)
        shape = self.shape[1:]
        if not self.base:
            k, v = self.codec.decode(key_payload, value_payload, shape, self.dtype, layer_idx)
        elif base is None or not isinstance(self.codec, CodesCodec):
            raise CorruptEntryError(f"entry {self.key[:12]} is coded against entry {self.base[:12]}, which this "
                                    f"reader did not open: a miss")  # fmt: skip
        else:
            k, v = self.codec.decode_against(key_payload, value_payload, shape, self.dtype, layer_idx, base)
        # Checksums catch damage, not forgery: a forged scale (NaN, inf) must not turn into NaN logits.
        if not all_finite(k, v):
            raise CorruptEntryError(f"entry {self.key[:12]}: layer {layer_idx} decodes to NaN or infinity")
        return k, v


@dataclass
class OpenEntry:
    """A stored entry whose header was read: where its layers lie, a reader of its byte ranges, and what closes its
    file (None: nothing to close)."""

    layout: EntryLayout
    read_ranges: RangeReader
    closer: Callable[[], None] | None = None

    def close(self) -> None:
        closer, self.closer = self.closer, None
        if closer is not None:
            closer()


def base_digest(layout: EntryLayout) -> str:
    """What a dependent records of its base: a digest of the base's codec and layer checksums. A base rewritten
    with other bytes (recomputed on another machine, re-signed) no longer matches, and the dependent is a miss."""
    body = "\0".join((layout.key, layout.codec.name, ",".join(layout.layer_sha256)))
    return hashlib.sha256(body.encode()).hexdigest()


class BaseReader:
    """The codes of a base entry, one layer at a time, each layer checked against its checksum (`verify`): what a
    dependent entry decodes against, and what a tier codes a new dependent against."""

    def __init__(
        self, layout: EntryLayout, read_ranges: RangeReader, *, close: Callable[[], None] | None = None,
        verify: bool = True,
    ) -> None:  # fmt: skip
        if not isinstance(layout.codec, CodesCodec) or layout.base:
            why = f"itself coded against {layout.base[:12]}" if layout.base else f"codec {layout.codec.name!r}"
            raise CorruptEntryError(f"entry {layout.key[:12]} cannot be a base: {why}")
        self.layout = layout
        self.digest = base_digest(layout)
        self._codec: CodesCodec = layout.codec
        self._read_ranges = read_ranges
        self._close = close
        self._verify = verify

    def codes(self, layers: Sequence[int]) -> list[Codes]:
        """The codes of `layers`, read in one batch of range reads. Raises CorruptEntryError."""
        layout = self.layout
        ranges = [r for i in layers for r in layout.layer_ranges(i)]
        try:
            buffers = self._read_ranges(ranges)
        except CorruptEntryError:
            raise
        except Exception as exc:  # the file or server failed mid-read: the base cannot be used now
            raise CorruptEntryError(f"base entry {layout.key[:12]}: layers {layers[0]}.. could not be read "
                                    f"({type(exc).__name__}: {exc})") from exc  # fmt: skip
        if len(buffers) != len(ranges):
            raise CorruptEntryError(f"base entry {layout.key[:12]}: {len(buffers)} reads for {len(ranges)} ranges")
        out = []
        for j, i in enumerate(layers):
            payloads = layout.payloads(i, buffers[2 * j], buffers[2 * j + 1], verify=self._verify)
            out.append(self._codec.codes_of(*payloads, layout.shape[1:], i))
        return out

    def close(self) -> None:
        close, self._close = self._close, None
        if close is not None:
            close()


def all_finite(*tensors: torch.Tensor) -> bool:
    """True when no element is NaN or infinite, read from one float32 sum per tensor (a tenth of the time of
    `isfinite().all()` on a 512-token layer: 36 us against 388 us). An infinity or a NaN makes the sum infinite or
    NaN; finite values so large that their sum overflows float32 (above ~1e34 each) count as not finite too, which
    errs on the safe side: the entry is recomputed."""
    return all(math.isfinite(float(t.sum(dtype=torch.float32))) for t in tensors)


def _from_bytes(data: bytes | memoryview, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    # A fresh, aligned tensor (a copy): the codec may view parts of it as wider dtypes.
    out = torch.empty(tuple(shape), dtype=dtype)
    out.view(-1).view(torch.uint8).numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    return out
