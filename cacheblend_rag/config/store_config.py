"""`StoreConfig`: the tiers that keep chunk KV (memory, local disk, Redis), their byte budgets and codecs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import ConfigError
from .checks import check_count, check_redis_url, mask_url

# The codecs `kv_codec` and `memory_codec` may name: those of `store.codec.CODECS` and the ones fitted to a model,
# `CALIBRATED_CODECS` (a test keeps them equal), listed here so that the settings import nothing of the store.
CODEC_NAMES = ("native", "fp16", "bf16", "int8", "int4", "pca")
# The memory tier's eviction policies (`store.eviction.EVICTION_POLICIES`, kept equal by a test).
EVICTION_NAMES = ("lru", "lfu")


@dataclass(frozen=True)
class StoreConfig:
    """Where chunk KV is kept: an in-process memory tier, optionally a local disk tier and a shared Redis tier, each
    bounded by bytes (the memory tier evicts by `memory_eviction`, the others least recently used first)."""

    memory_budget_bytes: int = 2 * 1024**3  # in-process chunk KV, evicted by memory_eviction beyond this
    disk_dir: str | None = None  # local disk tier (diskcache) under this folder; None: no disk tier
    disk_budget_bytes: int = 20 * 1024**3
    redis_url: str | None = None  # shared Redis tier, e.g. "redis://127.0.0.1:6379/0"; None: no Redis tier
    redis_budget_bytes: int = 8 * 1024**3
    # How entries are encoded (docs/configuration.md, "Stored KV: codecs and bytes per token"): "native" (the
    # compute dtype, exact), "fp16", "bf16", "int8" (keys per channel, values per token), "int4" (the same in groups
    # of 32), "pca" (each head's principal components, zstd-coded; fitted to the model when the engine starts). An
    # entry written with another codec is a miss and is recomputed.
    kv_codec: str = "int8"  # the disk and Redis tiers (int8 is within noise of exact)
    memory_codec: str = "native"  # the memory tier (encoded entries are decoded layer by layer when read)
    # Which entry the memory tier evicts first when over budget: "lru" (least recently used) or "lfu" (least
    # frequently used, with aging); docs/configuration.md, "Eviction". The disk and Redis tiers evict LRU.
    memory_eviction: str = "lfu"
    # Signs disk/Redis entries and refuses unsigned or forged ones (give every worker the same key); None: off
    hmac_key: bytes | str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("memory_budget_bytes", "disk_budget_bytes", "redis_budget_bytes"):
            check_count(name, getattr(self, name), 0, "a number of bytes, e.g. 2 * 1024**3 for 2 GiB")
        for name in ("disk_dir", "redis_url"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ConfigError(f"{name} must be a path string or None, got {value!r} ({type(value).__name__})")
        if self.disk_dir is not None:
            object.__setattr__(self, "disk_dir", os.fspath(self.disk_dir))
            if not self.disk_dir:
                raise ConfigError("disk_dir must be a folder path or None (no disk tier), got ''")
        if self.redis_url is not None:
            check_redis_url(self.redis_url)  # before a model loads: what the URL's text alone shows
        if self.hmac_key is not None and (not isinstance(self.hmac_key, (bytes, str)) or len(self.hmac_key) < 16):
            raise ConfigError("hmac_key must be None or a secret of at least 16 bytes (str or bytes)")
        for name in ("kv_codec", "memory_codec"):
            if getattr(self, name) not in CODEC_NAMES:
                raise ConfigError(f"{name} must be one of {sorted(CODEC_NAMES)}, got {getattr(self, name)!r}")
        if self.memory_eviction not in EVICTION_NAMES:
            raise ConfigError(f"memory_eviction must be one of {', '.join(EVICTION_NAMES)}, got "
                              f"{self.memory_eviction!r}")  # fmt: skip

    def __repr__(self) -> str:  # the dataclass's, with a password in redis_url masked and the HMAC key left out
        shown = (
            f"{f.name}={mask_url(self.redis_url)!r}" if f.name == "redis_url" and self.redis_url else
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self) if f.repr
        )  # fmt: skip
        return f"{type(self).__name__}({', '.join(shown)})"

    def build_options(self) -> dict[str, Any]:
        """The keyword arguments of `store.build_store` that make these tiers."""
        return dict(
            memory_bytes=self.memory_budget_bytes, disk_dir=self.disk_dir, disk_bytes=self.disk_budget_bytes,
            redis_url=self.redis_url, redis_bytes=self.redis_budget_bytes, hmac_key=self.hmac_key,
            kv_codec=self.kv_codec, memory_codec=self.memory_codec, memory_eviction=self.memory_eviction,
        )  # fmt: skip


STORE_FIELDS = tuple(f.name for f in fields(StoreConfig))
