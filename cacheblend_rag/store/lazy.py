"""A stored chunk read one layer at a time, so that fetching from disk or Redis overlaps with compute.

`open(key)` on the disk and Redis tiers reads only the entry's header and returns a `LazyChunkKV`; the engine's
loading pipeline then asks for layer 0, 1, ... while the fusor works on the layer before. Each layer is checked
against its own sha256 before it is handed out, so damage found at layer 17 is still caught before layer 17 is
used (the engine then drops the entry and redoes the request with the chunk recomputed).

A layer is decoded (by the entry's codec) inside the same call that reads it, so on the loading pipeline's thread
layer l+1 is fetched, checked and decoded while the fusor works on layer l; nothing decodes a whole entry up front.
An entry coded against a base (`layout.py`) reads the base's layer beside its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from ..errors import CorruptEntryError
from .chunk_kv import ChunkKV
from .layout import BaseReader, EntryLayout, RangeReader
from .serialize import check_base

__all__ = ["LazyChunkKV", "RangeReader"]


class LazyChunkKV:
    """Layers of one stored chunk, fetched on demand and checked one by one.

    Callbacks given to `when_whole` run once, with the whole chunk, when its last layer has been read (a tiered
    store uses it to promote the chunk into faster tiers without a second read). Callbacks given to
    `when_corrupt` run when a layer fails its check (the owning tier drops the entry and counts it). Layers may be
    asked for in any order, each as often as wanted; a layer read twice is fetched once. Thread-safe.
    `verify=False` skips the checksums (for bytes that never left the process); lengths are still checked. A
    dependent entry takes its `base` (checked against what the entry recorded of it: `OrphanedEntryError` if it is
    not the same), closed with it.
    """

    def __init__(
        self,
        layout: EntryLayout,
        read_ranges: RangeReader,
        *,
        close: Callable[[], None] | None = None,
        verify: bool = True,
        base: BaseReader | None = None,
    ) -> None:
        if layout.base:
            check_base(layout, base)
        self.layout = layout
        self.key = layout.key
        self._read_ranges = read_ranges
        self._close = close
        self._verify = verify
        self._base = base if layout.base else None
        self._on_whole: list[Callable[[ChunkKV], None]] = []
        self._on_corrupt: list[Callable[[CorruptEntryError], None]] = []
        self._layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * layout.num_layers
        self._missing = layout.num_layers
        self._lock = threading.Lock()
        self.bytes_read = 0

    # the read-only surface shared with ChunkKV
    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    @property
    def num_tokens(self) -> int:
        return self.layout.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.layout.dtype

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """[L, Hkv, T, D] of the keys (and of the values)."""
        return self.layout.shape

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values as stored (encoded by the entry's codec, its base's included): what reading the
        chunk costs."""
        return self.layout.payload_nbytes + (0 if self._base is None else self._base.layout.payload_nbytes)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> raw keys, values of one layer, [Hkv, T, D] each, on the CPU. Raises CorruptEntryError."""
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"layer {layer_idx} out of range for a chunk of {self.num_layers} layers")
        return self._read([layer_idx])[0]

    def materialize(self) -> ChunkKV:
        """The whole chunk as a ChunkKV, reading every layer not read yet in one batch of range reads."""
        self._read(range(self.num_layers))
        return self._whole()

    def _read(self, wanted: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Layers `wanted`, fetching the missing ones with a single `read_ranges` call; checks each one."""
        with self._lock:
            missing = [i for i in wanted if self._layers[i] is None]
            if missing:
                ranges = [r for i in missing for r in self.layout.layer_ranges(i)]
                try:
                    try:
                        buffers = self._read_ranges(ranges)
                    except CorruptEntryError:  # the reader's own finding (the entry went away meanwhile)
                        raise
                    except Exception as exc:  # the file or server failed mid-read: the entry cannot be used now
                        raise CorruptEntryError(
                            f"entry {self.key[:12]}: layers {missing[0]}.. could not be read "
                            f"({type(exc).__name__}: {exc})"
                        ) from exc
                    if len(buffers) != len(ranges):
                        raise CorruptEntryError(f"entry {self.key[:12]}: {len(buffers)} reads for {len(ranges)} ranges")
                    bases = [None] * len(missing) if self._base is None else self._base.codes(missing)
                    decoded = [
                        self.layout.decode_layer(
                            i, buffers[2 * j], buffers[2 * j + 1], verify=self._verify, base=bases[j]
                        )
                        for j, i in enumerate(missing)
                    ]
                except CorruptEntryError as exc:
                    self.close()
                    for callback in self._on_corrupt:
                        callback(exc)
                    raise
                for i, kv in zip(missing, decoded, strict=True):
                    self._layers[i] = kv
                read = [self.layout] if self._base is None else [self.layout, self._base.layout]
                self.bytes_read += sum(layout.layer_nbytes(i) for layout in read for i in missing)
                self._missing -= len(missing)
            complete = bool(missing) and self._missing == 0
            out = [self._layers[i] for i in wanted]
        if complete:
            self.close()
            if self._on_whole:
                whole = self._whole()
                for callback in self._on_whole:
                    callback(whole)
        return out  # type: ignore[return-value]

    def in_memory(self) -> ChunkKV | None:
        """The whole chunk once every layer has been read, else None (reading it is left to `layer`)."""
        with self._lock:
            done = self._missing == 0
        return self._whole() if done else None

    def when_whole(self, callback: Callable[[ChunkKV], None]) -> None:
        """Call `callback(chunk)` once every layer has been read (at once if that has happened already)."""
        with self._lock:
            done = self._missing == 0
            if not done:
                self._on_whole.append(callback)
        if done:
            callback(self._whole())

    def when_corrupt(self, callback: Callable[[CorruptEntryError], None]) -> None:
        """Call `callback(error)` if a layer read from now on turns out damaged."""
        with self._lock:
            self._on_corrupt.append(callback)

    def _whole(self) -> ChunkKV:
        layers = self._layers
        keys = torch.stack([layer[0] for layer in layers if layer is not None])  # [L, Hkv, T, D]
        values = torch.stack([layer[1] for layer in layers if layer is not None])
        return ChunkKV(self.key, keys, values, self.layout.base)

    def close(self) -> None:
        """Release the underlying file or connection; later layer reads are an error unless already cached."""
        close, self._close = self._close, None
        if close is not None:
            close()
        if self._base is not None:
            self._base.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the file object may already be gone
            pass
