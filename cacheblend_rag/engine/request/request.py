"""Every check of one request's arguments, made once before any compute: how to prefill, how to decode, and the
prompt's chunks and text.

`Request.from_options(method, options)` reads the keyword arguments of `engine.generate` / `engine.stream` (and the
framework integrations' per-call arguments), with its `SamplingParams`; `check_prompt_parts` checks the chunks, the
question, the prefix and the suffix (or takes a prebuilt prompt); `check_length` says whether it fits the model's
context. A wrong name, type or value is one `ConfigError` / `PromptError` that names the method the caller called
(`calling`). Numbers are checked by `cacheblend_rag.config.checks`, shared with the engine's settings. What the engine
checks against its model (a rule's layers, the context length) is `CacheBlendEngine._check_request`, which calls
these; the prefill and the decoding loop check nothing again.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypedDict

from ...config import BlendConfig, PrefillMode
from ...config.checks import check_count, check_ratio, check_real
from ...errors import CacheBlendError, ConfigError, PromptError
from .marked_text import PromptText
from .prompt import PromptTemplate, TokenizedPrompt

# The keyword arguments a request takes, with their defaults (the engine's names).
REQUEST_DEFAULTS: dict[str, Any] = {
    "mode": PrefillMode.BLEND,
    "recompute_ratio": None,
    "blend": None,
    "max_new_tokens": 128,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "stop": (),
    "seed": None,
    "template": None,
    "prefix": None,
    "suffix": None,
}
# Other names of the same settings that users of the frameworks write.
ALIASES = {"max_tokens": "max_new_tokens"}


class RequestOptions(TypedDict, total=False):
    """The keyword arguments of `generate`, `stream`, `agenerate` and `astream`, as a type checker and an editor see
    them (`**options: Unpack[RequestOptions]`); every one is optional, with its default in `REQUEST_DEFAULTS`."""

    mode: PrefillMode | str  # "blend" (default), "full", "prefix" or "reuse"
    recompute_ratio: float | None  # blend only: overrides the ratio of the engine's (or `blend`'s) rule
    blend: BlendConfig | None  # blend only: another rule for this request, e.g. blend_rule("gradual", 0.15)
    max_new_tokens: int  # the answer's budget (128)
    max_tokens: int  # the same, as the frameworks name it
    temperature: float  # 0: greedy (default); above 0: sampled with top_p / top_k / seed
    top_p: float
    top_k: int
    stop: Sequence[str] | str | None  # strings that end the answer (None or (): none)
    seed: int | None  # a sampled answer's random seed
    template: PromptTemplate | None  # renders the question (None: the engine's template)
    prefix: str | PromptText | None  # explicit text before the chunks, instead of a question
    suffix: str | PromptText | None  # explicit text after the chunks


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
        check_count("max_new_tokens", self.max_new_tokens, 1)
        check_real("temperature", self.temperature, lambda t: t >= 0, ">= 0 (0 is greedy)")
        check_real("top_p", self.top_p, lambda p: 0 < p <= 1, "in (0, 1]")
        # an int temperature (1) is a real number: transformers' warpers want a float
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        check_count("top_k", self.top_k, 0, "0 turns it off")
        if self.seed is not None:
            check_count("seed", self.seed, 0, "or None")
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


@dataclass(frozen=True)
class Request:
    """A request's settings. Build it with `from_options`; the fields are checked on creation."""

    mode: PrefillMode = PrefillMode.BLEND
    recompute_ratio: float | None = None  # blend only: overrides the ratio of the engine's (or `blend`'s) rule
    blend: BlendConfig | None = None  # blend only: another rule for this request
    sampling: SamplingParams = field(default_factory=SamplingParams)
    template: PromptTemplate | None = None  # renders a question (None: the engine's template)
    prefix: str | PromptText | None = None  # explicit text before the chunks (instead of a question)
    suffix: str | PromptText | None = None  # explicit text after the chunks

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", PrefillMode.parse(self.mode))
        if self.recompute_ratio is not None:  # a bool is refused, not read as 0 or 1
            check_ratio("recompute_ratio", self.recompute_ratio)
        if self.blend is not None and not isinstance(self.blend, BlendConfig):
            kind = type(self.blend).__name__
            raise ConfigError(f"blend must be a BlendConfig (e.g. blend_rule('gradual', 0.15)), got {kind}")
        if self.mode is not PrefillMode.BLEND and (self.recompute_ratio is not None or self.blend is not None):
            raise ConfigError(f"recompute_ratio and blend apply to mode 'blend' only, got mode {self.mode.value!r}")
        if self.template is not None and not isinstance(self.template, PromptTemplate):
            raise ConfigError(f"template must be a PromptTemplate, got {type(self.template).__name__}")
        for name in ("prefix", "suffix"):
            check_part(name, getattr(self, name))

    @classmethod
    def from_options(cls, method: str, options: Mapping[str, Any]) -> Request:
        """The request of a call to `method` (e.g. "generate") with these keyword arguments.

        Unknown names are refused with the list of accepted ones; `max_tokens` is read as `max_new_tokens`. Every
        error names `method`, so that it points at the call the user wrote.
        """
        args = dict(REQUEST_DEFAULTS)
        given: dict[str, str] = {}
        for key, value in options.items():
            name = ALIASES.get(key, key)
            if name not in args:
                accepted = ", ".join(sorted({*REQUEST_DEFAULTS, *ALIASES}))
                raise ConfigError(f"{method}() got an unexpected keyword argument {key!r}; it accepts {accepted}")
            if name in given:
                raise ConfigError(f"{method}() got both {given[name]!r} and {key!r}, which set the same thing")
            given[name] = key
            args[name] = value
        with calling(method):
            sampling = SamplingParams(
                args.pop("max_new_tokens"),
                args.pop("temperature"),
                args.pop("top_p"),
                args.pop("top_k"),
                args.pop("stop"),
                args.pop("seed"),
            )
            return cls(sampling=sampling, **args)


@contextmanager
def calling(method: str) -> Iterator[None]:
    """Prefixes an error raised inside with `method(): `, so that it points at the call the user wrote."""
    try:
        yield
    except CacheBlendError as exc:
        raise type(exc)(f"{method}(): {exc}") from None


def check_text(name: str, value: object, *, optional: bool = False) -> None:
    """PromptError unless `value` is a str (or None when `optional`); bytes get a hint to decode them."""
    if value is None and optional:
        return
    if isinstance(value, str):
        return
    hint = " (decode bytes first, e.g. value.decode('utf-8'))" if isinstance(value, (bytes, bytearray)) else ""
    raise PromptError(f"{name} must be a string{' or None' if optional else ''}, got {type(value).__name__}{hint}")


def check_part(name: str, value: object) -> None:
    """An explicit prefix or suffix: a str, the marked-up text a chat template renders (`PromptText`), or None."""
    if not isinstance(value, PromptText):
        check_text(name, value, optional=True)


def check_chunks(chunks: object) -> Sequence[str]:
    """The chunks of a request: a list or tuple of strings (not a single string, a dict, None or a generator)."""
    if isinstance(chunks, (str, bytes)) or not isinstance(chunks, (list, tuple)):
        kind = type(chunks).__name__
        hint = "; wrap a single text in a list: [text]" if isinstance(chunks, str) else ""
        raise PromptError(f"chunks must be a list of strings, got {kind}{hint}")
    for i, chunk in enumerate(chunks):
        check_text(f"chunk {i}", chunk)
    return chunks


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


def check_length(prompt: TokenizedPrompt, max_new_tokens: int, limit: int) -> None:
    """PromptError when the prompt and its answer budget do not fit a model's context of `limit` tokens."""
    total = prompt.num_tokens + max_new_tokens
    if total > limit:
        raise PromptError(
            f"prompt of {prompt.num_tokens} tokens + {max_new_tokens} new tokens exceeds the model's limit of "
            f"{limit}; retrieve fewer or shorter chunks, or lower max_new_tokens"
        )


def check_prompt_parts(
    method: str, chunks: Sequence[str] | TokenizedPrompt, question: str | None, request: Request
) -> TokenizedPrompt | None:
    """The parts of one `generate` / `stream` call's prompt, checked: a prebuilt prompt is returned as given (then
    with no question, prefix or suffix beside it); chunks and a question are checked, and None says to build the
    prompt from them."""
    if isinstance(chunks, TokenizedPrompt):
        if question is not None or request.prefix is not None or request.suffix is not None:
            raise PromptError(f"{method}(): a prebuilt prompt already has its question; pass no question, prefix "
                              "or suffix with it")  # fmt: skip
        return chunks
    with calling(method):
        check_chunks(chunks)
        check_text("question", question, optional=True)
        check_encodable(chunks, question=question, prefix=request.prefix, suffix=request.suffix)
    return None
