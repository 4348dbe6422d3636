"""`ServingConfig`: how the engine serves many requests at once: the decode batch, its KV bound, decode steps between a
prefill's layers, and the decode step's weights and CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import ConfigError
from .checks import check_count, check_real

DECODE_WEIGHTS = ("native", "int8")


@dataclass(frozen=True)
class ServingConfig:
    """How requests are served together (docs/configuration.md, "Serving many requests"). The checks that need the
    device (int8 on a CPU, CUDA graphs on a GPU) are `EngineConfig`'s, which knows it."""

    # How many requests decode together: each decode step reads the weights once for all of them. Requests past it
    # wait in arrival order. 1 serves one request at a time.
    max_batch_size: int = 8
    # The most KV positions the requests decoding together may hold (each: its prompt and room for its answer); a
    # request that would pass it waits for room, one that could never fit is refused (PromptError). None: no bound.
    max_batch_tokens: int | None = None
    # While a prompt is prefilled, the requests already decoding get a step between two of its layers once their
    # last step is this many seconds old, so their answers keep streaming through a long prefill. None: off.
    max_token_gap_s: float | None = None
    # The weights decode steps read: "native" (the model's, exact) or "int8" (CPU only: per-channel int8 copies of
    # the linear layers, a quarter of the bytes; the first token stays exact, later tokens may differ).
    decode_weights: str = "native"
    # CUDA only: decode steps of up to 32 requests replayed as CUDA graphs (one captured per batch-size bucket, 1-32),
    # one launch per step instead of hundreds; the same tokens as the eager step. Off until a GPU run shows its gain.
    decode_graphs: bool = False

    def __post_init__(self) -> None:
        check_count("max_batch_size", self.max_batch_size, 1, "a number of requests (1: one at a time)")
        if self.max_batch_tokens is not None:
            check_count("max_batch_tokens", self.max_batch_tokens, 1, "a number of KV positions, or None")
        if self.max_token_gap_s is not None:
            check_real("max_token_gap_s", self.max_token_gap_s, lambda s: s >= 0,
                       "a number of seconds >= 0 (0: a step after every layer) or None (off)")  # fmt: skip
        if self.decode_weights not in DECODE_WEIGHTS:
            raise ConfigError(f"decode_weights must be one of {', '.join(DECODE_WEIGHTS)}, got {self.decode_weights!r}")
        if not isinstance(self.decode_graphs, bool):
            raise ConfigError(f"decode_graphs must be True or False, got {self.decode_graphs!r}")
        if self.decode_graphs and self.decode_weights != "native":
            raise ConfigError("decode_graphs=True replays the native weights' step: it needs decode_weights='native'")


SERVING_FIELDS = tuple(f.name for f in fields(ServingConfig))
