"""Exceptions raised by cacheblend-rag.

Every error says what was wrong, the value that was given, and what to do about it.
"""

from __future__ import annotations


class CacheBlendError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(CacheBlendError, ValueError):
    """A setting is out of range or inconsistent with another one."""


class UnsupportedModelError(CacheBlendError):
    """The model cannot be blended correctly (sliding-window attention, non-RoPE positions, ...)."""


class ModelNotFoundError(CacheBlendError):
    """A preset's files are missing or corrupt, or a model path does not exist."""


class PromptError(CacheBlendError, ValueError):
    """The request itself is invalid: no chunks, an empty chunk, a prompt longer than the context."""


class NonFiniteKVError(CacheBlendError):
    """A chunk's KV holds NaN or infinity: the disk and Redis tiers refuse to store it (a quantizing codec would
    spread one bad value over a whole channel); the request that computed it goes on with its own copy."""


class CorruptEntryError(CacheBlendError):
    """Stored bytes are not a valid chunk KV entry for the key they were found under.

    Stores catch it, drop the entry and report a miss: the chunk is then recomputed.
    """


class EntryGoneError(CorruptEntryError):
    """A stored entry went away (evicted or replaced by the store) while its layers were read: a miss, not damage.
    The engine recomputes the chunk as for a damaged one; the tier counts it apart (`TierStats.vanished`)."""


class OrphanedEntryError(EntryGoneError):
    """An entry coded against another (a captured entry against its isolated one) whose base is gone or was
    replaced: a miss counted as `vanished`, and the entry is deleted, since it can never be decoded again."""


class EngineClosedError(CacheBlendError, RuntimeError):
    """The engine was stopped (`CacheBlendEngine.close()`, or the interpreter is exiting): it takes no request, and
    the requests it had not answered end with this error. Build a new engine to go on."""
