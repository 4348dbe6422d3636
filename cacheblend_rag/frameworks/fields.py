"""The settings of the engine a framework's model object loads, declared once for both frameworks (pydantic).

LangChain's `ChatCacheBlend` / `CacheBlendLLM` and LlamaIndex's `CacheBlendLLM` inherit `EngineFields`, so the same
names, defaults and descriptions reach both. Every field left unset (None) means the engine's own default
(`EngineConfig` / `StoreConfig`), never a copy of it. An engine passed in has its own settings, so these are refused
beside it (`check_no_store_settings`, and each framework's own check for device and dtype).
"""

from __future__ import annotations

from pydantic import BaseModel, Field, SecretStr

from .engines import DEVICE_HELP, DTYPE_HELP, ENGINE_SETTINGS

__all__ = ["EngineFields"]


class EngineFields(BaseModel):
    """Device, precision and store tiers of a loaded engine (`ENGINE_SETTINGS`); None: the engine's default."""

    device: str | None = Field(default=None, description=DEVICE_HELP)
    dtype: str | None = Field(default=None, description=DTYPE_HELP)
    memory_budget_bytes: int | None = Field(default=None, ge=0, description="In-process tier size (None: 2 GiB).")
    disk_dir: str | None = Field(default=None, description="Folder of a local disk tier; None: no disk tier.")
    disk_budget_bytes: int | None = Field(default=None, ge=0, description="Disk tier size (None: 20 GiB).")
    # A secret: a Redis URL may hold a password. repr, model_dump, LangChain's dumpd/dumps and validation errors
    # never show it.
    redis_url: SecretStr | None = Field(
        default=None, description="redis:// URL of a Redis tier shared by workers; None: no Redis tier."
    )
    redis_budget_bytes: int | None = Field(default=None, ge=0, description="Redis tier size (None: 8 GiB).")

    def engine_settings(self) -> dict[str, object]:
        """These fields under `ENGINE_SETTINGS`' names, the Redis URL in clear: what `load_engine` takes."""
        settings: dict[str, object] = {name: getattr(self, name) for name in ENGINE_SETTINGS}
        if self.redis_url is not None:
            settings["redis_url"] = self.redis_url.get_secret_value()
        return settings
