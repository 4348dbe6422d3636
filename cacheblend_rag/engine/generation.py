"""Decoding after the prefill: picking tokens, stop conditions, and text that streams cleanly."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..errors import ConfigError, PromptError


def _check_int(name: str, value: object, low: int, hint: str = "") -> None:
    if type(value) is not int and not (isinstance(value, int) and not isinstance(value, bool)):
        raise ConfigError(f"{name} must be an integer{hint}, got {value!r} ({type(value).__name__})")
    if value < low:  # type: ignore[operator]
        raise ConfigError(f"{name} must be >= {low}{hint}, got {value}")


def _check_real(name: str, value: object, ok: Callable[[float], bool], rule: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or not ok(value):
        raise ConfigError(f"{name} must be {rule}, got {value!r}")


def check_ratio_arg(recompute_ratio: object) -> None:
    """A per-request ratio override: None, or a real number in [0, 1] (a bool is refused, not read as 0 or 1)."""
    if recompute_ratio is not None:
        _check_real("recompute_ratio", recompute_ratio, lambda r: 0 <= r <= 1, "in [0, 1]")


def check_encodable(chunks: Sequence[object] | object, **parts: object) -> None:
    """PromptError for text UTF-8 cannot encode (a lone surrogate such as "\\ud800"), naming where it is.

    Tokenizers fail on such text with an unhelpful TypeError; this says which chunk or part holds it.
    """
    named = [(f"chunk {i}", c) for i, c in enumerate(chunks)] if isinstance(chunks, (list, tuple)) else []
    named += [(f"the {name}", text) for name, text in parts.items()]
    for where, text in named:
        if not isinstance(text, str):
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PromptError(
                f"{where} holds {text[exc.start]!r} at character {exc.start}, which is not valid Unicode text "
                f"({exc.reason}); remove it, or decode the source with errors='replace'"
            ) from None


MAX_SEED = 2**64 - 1  # torch generators take 64-bit seeds


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, checked on creation (before any compute)."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop: tuple[str, ...] | str | None = ()  # None or (): no stop strings; a str: one stop string
    seed: int | None = None

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, 1)
        _check_real("temperature", self.temperature, lambda t: t >= 0, ">= 0 (0 is greedy)")
        _check_real("top_p", self.top_p, lambda p: 0 < p <= 1, "in (0, 1]")
        # an int temperature (1) is a real number: transformers' warpers want a float
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        _check_int("top_k", self.top_k, 0, " (0 turns it off)")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, " (or None)")
            if self.seed > MAX_SEED:
                raise ConfigError(f"seed must be at most 2**64 - 1 (a 64-bit generator seed), got {self.seed}")
        if self.stop is None:
            stops: tuple[object, ...] = ()
        elif isinstance(self.stop, str):
            stops = (self.stop,)
        elif isinstance(self.stop, (list, tuple)):
            stops = tuple(self.stop)
        else:
            raise ConfigError(f"stop must be a string, a list of strings or None, got {type(self.stop).__name__}")
        if any(not isinstance(s, str) or not s for s in stops):
            raise ConfigError(f"stop strings must be non-empty strings, got {list(stops)!r}")
        object.__setattr__(self, "stop", stops)


class TokenPicker:
    """Chooses the next token from logits: argmax when greedy, else warped sampling with its own RNG."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        self.greedy = params.temperature == 0
        self.warpers = LogitsProcessorList()
        if not self.greedy:
            self.warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k > 0:
                self.warpers.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1:
                self.warpers.append(TopPLogitsWarper(params.top_p))
        self.generator = torch.Generator(device=device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, generated: Sequence[int]) -> int:
        """logits: [vocab] float32"""
        if self.greedy:
            return int(torch.argmax(logits))
        ids = torch.tensor([list(generated)], dtype=torch.long, device=logits.device)
        scores = self.warpers(ids, logits.unsqueeze(0))
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator)[0, 0])


class TextAssembler:
    """Turns generated token ids into text deltas, cut at the first stop string.

    Text is held back while it ends in an incomplete UTF-8 sequence or in what could be the start of a stop
    string, so a streamed answer never shows text that the final answer does not contain.
    """

    def __init__(self, tokenizer, stop: Iterable[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # final text so far (without any stop string)
        self.emitted = 0
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Add a token; return the newly safe text (may be empty)."""
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (full.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = full[:cut], True
            return self._emit(len(self.text))
        self.text = full
        safe = len(full)
        if full.endswith("\ufffd"):
            safe = len(full.rstrip("\ufffd"))
        for s in self.stop:  # hold back a tail that may grow into a stop string
            for k in range(min(len(s) - 1, safe), 0, -1):
                if full[:safe].endswith(s[:k]):
                    safe -= k
                    break
        return self._emit(safe)

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        return delta


def eos_token_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else source)
    return ids
