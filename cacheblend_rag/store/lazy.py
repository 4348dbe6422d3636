"""A stored chunk read one layer at a time, so that fetching from disk or Redis overlaps with compute.

`open(key)` on the disk and Redis tiers reads only the entry's header and returns a `LazyChunkKV`; the engine's
loading pipeline then asks for layer 0, 1, ... while the fusor works on the layer before. Each layer is checked
against its own sha256 before it is handed out, so damage found at layer 17 is still caught before layer 17 is
used (the engine then drops the entry and redoes the request with the chunk recomputed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from .chunk_kv import ChunkKV
from .serialize import CorruptEntryError, EntryLayout

# Reads the given [start, end) byte ranges of the entry; returns one buffer per range (shorter if the entry
# is gone or cut, which `decode_layer` reports as a truncated entry).
RangeReader = Callable[[Sequence[tuple[int, int]]], Sequence[bytes | memoryview]]


class LazyChunkKV:
    """Layers of one stored chunk, fetched on demand and checked one by one.

    `on_complete(kv)` runs once, with the whole chunk, when its last layer has been read (a tiered store uses it
    to promote the chunk into faster tiers without a second read). `on_corrupt(exc)` runs when a layer fails its
    check (the owning tier drops the entry and counts it). Layers must be asked for in any order, each as often
    as wanted; a layer read twice is fetched once. Thread-safe.
    """

    def __init__(
        self,
        layout: EntryLayout,
        read_ranges: RangeReader,
        *,
        close: Callable[[], None] | None = None,
        on_complete: Callable[[ChunkKV], None] | None = None,
        on_corrupt: Callable[[CorruptEntryError], None] | None = None,
    ) -> None:
        self.layout = layout
        self.key = layout.key
        self._read_ranges = read_ranges
        self._close = close
        self.on_complete = on_complete
        self._on_corrupt = on_corrupt
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
        return 2 * self.layout.layer_bytes * self.layout.num_layers

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> raw keys, values of one layer, [Hkv, T, D] each, on the CPU. Raises CorruptEntryError."""
        with self._lock:
            cached = self._layers[layer_idx]
            if cached is not None:
                return cached
            key_range, value_range = self.layout.layer_ranges(layer_idx)
            try:
                try:
                    key_bytes, value_bytes = self._read_ranges([key_range, value_range])
                except Exception as exc:  # the file or server failed mid-read: the entry cannot be used now
                    raise CorruptEntryError(
                        f"entry {self.key[:12]}: layer {layer_idx} could not be read ({type(exc).__name__}: {exc})"
                    ) from exc
                k, v = self.layout.decode_layer(layer_idx, key_bytes, value_bytes)
            except CorruptEntryError as exc:
                self.close()
                if self._on_corrupt is not None:
                    self._on_corrupt(exc)
                raise
            self.bytes_read += 2 * self.layout.layer_bytes
            self._layers[layer_idx] = (k, v)
            self._missing -= 1
            complete = self._missing == 0
        if complete:
            self.close()
            if self.on_complete is not None:
                self.on_complete(self.materialize())
        return k, v

    def materialize(self) -> ChunkKV:
        """The whole chunk as a ChunkKV, reading the layers not read yet."""
        layers = [self.layer(i) for i in range(self.num_layers)]
        keys = torch.stack([k for k, _ in layers])  # [L, Hkv, T, D]
        values = torch.stack([v for _, v in layers])
        return ChunkKV(self.key, keys, values)

    def close(self) -> None:
        """Release the underlying file or connection; later layer reads are an error unless already cached."""
        close, self._close = self._close, None
        if close is not None:
            close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the file object may already be gone
            pass
