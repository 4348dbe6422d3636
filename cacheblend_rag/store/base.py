"""The two protocols of the store package: what a stored chunk offers its reader, and what every store offers.

Every store (memory, disk, Redis, a tiered stack of them) implements all of `ChunkStore`; callers never probe a
store for a method. Every chunk a store hands out, read whole (`ChunkKV`) or layer by layer (`LazyChunkKV`),
implements `ChunkReader`, so callers never branch on its class either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import torch

from ..errors import CorruptEntryError

if TYPE_CHECKING:
    from .chunk_kv import ChunkKV


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    bytes_read: int = 0


@runtime_checkable
class ChunkReader(Protocol):
    """Read access to one chunk's KV: its shape up front, then layer by layer, or all of it at once."""

    key: str

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """[L, Hkv, T, D] of the keys (and of the values)."""
        ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values together."""
        ...

    @property
    def num_layers(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> raw (pre-RoPE) keys, values of one layer, [Hkv, T, D] each.

        Raises `CorruptEntryError` when a stored layer turns out damaged (the owning tier has dropped it by then).
        """
        ...

    def materialize(self) -> ChunkKV:
        """Every layer, read now, as an immutable `ChunkKV`. Raises `CorruptEntryError` like `layer`."""
        ...

    def in_memory(self) -> ChunkKV | None:
        """The whole chunk when every layer is in memory already (nothing left to read or decode), else None."""
        ...

    def when_whole(self, callback: Callable[[ChunkKV], None]) -> None:
        """Call `callback(chunk)` once every layer has been read: at once for a chunk already in memory."""
        ...

    def when_corrupt(self, callback: Callable[[CorruptEntryError], None]) -> None:
        """Call `callback(error)` if a layer turns out damaged when it is read (never, for a chunk in memory)."""
        ...


class Hit(NamedTuple):
    """What `ChunkStore.open` finds: the chunk, and the name of the tier that held it."""

    kv: ChunkReader
    tier: str


@runtime_checkable
class ChunkStore(Protocol):
    """A place chunk KV lives. No method raises for a missing, corrupt or unreachable entry: that is a miss.

    `get` returns the whole chunk, read and checked. `open` returns a `Hit` whose chunk tiers that can read by
    layer (disk, Redis) have not read yet beyond its header: its layers are fetched as they are asked for, and
    `materialize()` reads the rest. `put` may return before slower tiers have the entry; `flush` waits for them.
    """

    name: str  # the tier's name in metrics ("memory", "disk", "redis", or the stack's own name)
    stats: StoreStats

    def get(self, key: str) -> ChunkKV | None: ...

    def open(self, key: str) -> Hit | None: ...

    def put(self, kv: ChunkKV) -> None: ...

    def discard(self, key: str) -> None:
        """Delete one entry, wherever this store holds it."""
        ...

    def clear(self) -> None:
        """Delete every entry (of this store's namespace; shared tiers are cleared for every process)."""
        ...

    def flush(self) -> None:
        """Wait until every write accepted so far is stored."""
        ...

    def close(self) -> None:
        """Finish pending writes and release files, connections and threads. The store is unusable afterwards."""
        ...

    def __contains__(self, key: object) -> bool: ...

    def codecs_holding(self, key: str) -> frozenset[str]:
        """The codecs (`codec.CODECS` names) this store holds `key`'s entry in, whichever this store reads: a
        peer's entry written in another codec is a miss here, and this tells that it is there."""
        ...

    def __len__(self) -> int: ...
