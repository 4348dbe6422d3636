"""Which entry a byte-bounded tier evicts next: least recently used, or least frequently used with aging.

An `EvictionOrder` only orders keys; the tier keeps the entries and their bytes, and asks `victim()` while it is over
its budget. Two orders ship:
- "lru": the entry read or written longest ago goes first. Right when reuse is recent: a topic asked about now is
  asked about again soon.
- "lfu": least frequently used with dynamic aging (LFU-DA). Each entry's priority is its use count plus the
  priority of the last entry evicted when it was last used; the lowest priority goes first, the least recently
  used among equals. A chunk many questions retrieve outlives one retrieved once, and the aging term lets an entry
  that was popular long ago fall out once newer entries have been used as often since. The entry just written is
  never its own write's victim (plain LFU-DA would refuse a new chunk whenever every resident was used twice).
The traffic benchmark compares them (docs/benchmarks.md, "Traffic: a store smaller than the corpus").
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Protocol, runtime_checkable

from ..errors import ConfigError

EVICTION_POLICIES: dict[str, str] = {
    "lru": "least recently used first",
    "lfu": "least frequently used first, with aging (LFU-DA)",
}


@runtime_checkable
class EvictionOrder(Protocol):
    """The order in which a tier's keys are evicted. Not thread-safe: the tier calls it under its own lock."""

    name: str

    def add(self, key: str, nbytes: int) -> None:
        """`key` was stored (new, or written again): counts as one use."""
        ...

    def touch(self, key: str) -> None:
        """`key` was read."""
        ...

    def remove(self, key: str) -> None:
        """`key` left the tier (deleted); unknown keys are ignored."""
        ...

    def victim(self, keep: str | None = None) -> str:
        """The key to evict now, other than `keep` (the entry just written), removed from the order. KeyError when
        no other key is left."""
        ...

    def clear(self) -> None: ...

    def __len__(self) -> int: ...


class LRUOrder:
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._keys: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str, nbytes: int) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)

    def touch(self, key: str) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)

    def remove(self, key: str) -> None:
        self._keys.pop(key, None)

    def victim(self, keep: str | None = None) -> str:
        for key in self._keys:
            if key != keep:
                del self._keys[key]
                return key
        raise KeyError("nothing to evict")

    def clear(self) -> None:
        self._keys.clear()

    def __len__(self) -> int:
        return len(self._keys)


class LFUOrder:
    """Least frequently used first, with dynamic aging (LFU-DA); ties go least recently used first.

    A heap of (priority, last use, key) with stale items skipped when popped: O(log n) per use.
    """

    name = "lfu"

    def __init__(self) -> None:
        self._age = 0  # the priority of the last victim: what an entry used now starts above
        self._live: dict[str, tuple[int, int, int]] = {}  # key -> (priority, last use, uses)
        self._heap: list[tuple[int, int, str]] = []
        self._clock = itertools.count()

    def _use(self, key: str, uses: int) -> None:
        item = (self._age + uses, next(self._clock), uses)
        self._live[key] = item
        heapq.heappush(self._heap, (item[0], item[1], key))
        if len(self._heap) > 4 * len(self._live) + 64:  # stale items outnumber live ones: rebuild
            self._heap = [(p, t, k) for k, (p, t, _) in self._live.items()]
            heapq.heapify(self._heap)

    def add(self, key: str, nbytes: int) -> None:
        old = self._live.get(key)
        self._use(key, 1 if old is None else old[2] + 1)

    def touch(self, key: str) -> None:
        old = self._live.get(key)
        if old is not None:
            self._use(key, old[2] + 1)

    def remove(self, key: str) -> None:
        self._live.pop(key, None)

    def victim(self, keep: str | None = None) -> str:
        kept = None
        try:
            while self._heap:
                item = heapq.heappop(self._heap)
                priority, used, key = item
                live = self._live.get(key)
                if live is None or live[0] != priority or live[1] != used:
                    continue  # stale: the key was used again since, or left
                if key == keep:
                    kept = item
                    continue
                del self._live[key]
                self._age = priority
                return key
            raise KeyError("nothing to evict")
        finally:
            if kept is not None:
                heapq.heappush(self._heap, kept)

    def clear(self) -> None:
        self._live.clear()
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._live)


def eviction_order(policy: str | EvictionOrder, field: str = "eviction") -> EvictionOrder:
    """A fresh order for a policy name (one of `EVICTION_POLICIES`), or the order object itself."""
    if isinstance(policy, str):
        if policy == "lru":
            return LRUOrder()
        if policy == "lfu":
            return LFUOrder()
        raise ConfigError(f"{field} must be one of {', '.join(EVICTION_POLICIES)}, got {policy!r}")
    if not isinstance(policy, EvictionOrder):
        raise ConfigError(f"{field} must be a policy name ({', '.join(EVICTION_POLICIES)}) or an EvictionOrder, "
                          f"got {type(policy).__name__}")  # fmt: skip
    return policy
