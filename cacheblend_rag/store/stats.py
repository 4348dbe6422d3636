"""Counters of the tiers that hold serialized entries (disk, Redis), which can also meet bad data and outages."""

from __future__ import annotations

from dataclasses import dataclass

from .base import StoreStats


@dataclass
class TierStats(StoreStats):
    corrupt: int = 0  # entries that failed to decode, were dropped and counted as misses
    errors: int = 0  # operations the backend failed (I/O error, Redis unreachable); each one is a miss or a lost put
