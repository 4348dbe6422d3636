"""One request's options, checked once before any compute: how to prefill, how to decode, how to build the prompt.

`Request.from_options(method, options)` reads the keyword arguments of `engine.generate` / `engine.stream` (and the
framework integrations' per-call arguments): an unknown name, a wrong type or a value out of range is one
`ConfigError` / `PromptError` that names the method the caller called. The engine then passes the `Request` down to
the prefill and the decoding loop, which check nothing again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from ..config import BlendConfig, PrefillMode
from ..errors import CacheBlendError, ConfigError, PromptError
from .generation import SamplingParams, check_encodable, check_ratio_arg
from .prompt import PromptTemplate, TokenizedPrompt
from .prompt_text import PromptText

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
        check_ratio_arg(self.recompute_ratio)
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
        try:
            sampling = SamplingParams(
                args.pop("max_new_tokens"),
                args.pop("temperature"),
                args.pop("top_p"),
                args.pop("top_k"),
                args.pop("stop"),
                args.pop("seed"),
            )
            return cls(sampling=sampling, **args)
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


def request_prompt(
    build_prompt: Callable[..., TokenizedPrompt],
    method: str,
    chunks: Sequence[str] | TokenizedPrompt,
    question: str | None,
    request: Request,
) -> TokenizedPrompt:
    """The tokenized prompt of one `generate` / `stream` call: a prebuilt one as given (then with no question,
    prefix or suffix beside it), else built from checked chunks and question by `build_prompt`."""
    if isinstance(chunks, TokenizedPrompt):
        if question is not None or request.prefix is not None or request.suffix is not None:
            raise PromptError(f"{method}(): a prebuilt prompt already has its question; pass no question, prefix "
                              "or suffix with it")  # fmt: skip
        return chunks
    try:
        check_chunks(chunks)
        check_text("question", question, optional=True)
        check_encodable(chunks, question=question, prefix=request.prefix, suffix=request.suffix)
        return build_prompt(chunks, question, template=request.template, prefix=request.prefix, suffix=request.suffix)
    except CacheBlendError as exc:
        raise type(exc)(f"{method}(): {exc}") from None
