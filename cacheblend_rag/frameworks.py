"""What the framework integrations share: one answer to each question every integration has to settle.

`langchain-cacheblend` and `llama-index-cacheblend` wrap the same engine in two frameworks' classes. Everything
that does not depend on the framework lives here, so both packages behave the same:

- **Where the documents go.** A framework renders the user's prompt template to text. The integrations render
  it with `CONTEXT_PLACEHOLDER` where the documents go (`{context}`, `{context_str}`) and `split_at_context`
  cuts the text there: the text before is the request's prefix, the text after its suffix, and each document
  becomes its own chunk with its own cached KV.
- **A question placed before the documents.** A chunk's cached KV is keyed by the text before it, so when that
  text holds the question every question gets its own prefix and no chunk is ever reused. Such a prompt is
  accepted, as the frameworks' own chains accept it: `check_context_prompt` emits a
  `QuestionBeforeContextWarning` where the prompt is set, and each request runs in the chosen mode but computes
  its chunks' KV anew. Precomputing chunks for such a prompt raises, since the KV it would store is read by no
  request. Turn the warning into an error with `warnings.simplefilter("error", QuestionBeforeContextWarning)`.
- **Chat messages** are rendered by `render_chat` with the tokenizer's own chat template, as plain
  "Role: text" lines when it has none; roles are system, user and assistant, content is text only. The result is
  a `PromptText`: the template's control tokens stay control tokens, while a control-token string inside a message
  stays text, so neither a message nor a document stuffed into one can forge a turn. Documents passed as chunks
  are tokenized the same way by the engine.
- **Retrieved documents** become chunks through `document_chunks`: blank ones are left out, a text that is not a
  string is a `PromptError`. Text UTF-8 cannot encode (a lone surrogate) is a `PromptError` naming where it is, in
  a document or in a chat message.
- **Per-call arguments** are `CALL_ARGUMENTS`, the engine's names (`max_tokens` is accepted for
  `max_new_tokens`); `call_arguments` merges a model object's settings with a call's and refuses unknown ones.
- **A model object's settings** use the same names: `max_new_tokens`, with `max_tokens` accepted for it where the
  object is built too (`setting_aliases`), and are checked where the object is built (`call_arguments(settings,
  {})`), not at its first call.
- **Response metadata** is `metrics_metadata(metrics, detailed=...)`: the request's `RequestMetrics` without the
  per-layer list (`DETAILED_METRICS`) unless a model object's `detailed_metrics` asks for it.
- **The model's name** is `resolve_model_name(requested, engine)`, and `load_engine` shares one engine per
  (model, `ENGINE_SETTINGS`: device, dtype, store tiers and budgets) across every model object of a process,
  whichever framework built it; store settings beside an engine passed in are refused (`check_no_store_settings`).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .config import EngineConfig, PrefillMode, StoreConfig
from .engine import CacheBlendEngine, Request
from .engine.request.marked_text import PromptText, render_chat_text
from .engine.request.request import ALIASES as REQUEST_ALIASES
from .engine.request.request import check_encodable
from .errors import ConfigError, PromptError

__all__ = [
    "ALIASES",
    "CALL_ARGUMENTS",
    "CONTEXT_PLACEHOLDER",
    "DETAILED_METRICS",
    "DEVICE_HELP",
    "DTYPE_HELP",
    "ENGINE_SETTINGS",
    "ROLES",
    "STORE_SETTINGS",
    "ChatTurn",
    "QuestionBeforeContextWarning",
    "call_arguments",
    "check_context_prompt",
    "check_no_store_settings",
    "engine_config",
    "has_chat_template",
    "load_engine",
    "metrics_metadata",
    "non_text_error",
    "question_free_prefix",
    "render_chat",
    "resolve_model_name",
    "setting_aliases",
    "split_at_context",
]

# Stands for the documents in a rendered prompt. NUL bytes keep it from ever occurring in real text.
CONTEXT_PLACEHOLDER = "\x00<cacheblend:documents>\x00"

# Two stand-ins for the question (and any other variable): a prefix that differs between them depends on it.
_STAND_INS = ("\x01cacheblend:first\x01", "\x01cacheblend:second\x01")


class QuestionBeforeContextWarning(UserWarning):
    """The text before the documents depends on the question: requests run, but no chunk KV is reused."""


def split_at_context(text: str | PromptText) -> tuple[str | PromptText, str | PromptText]:
    """(prefix, suffix) of a prompt rendered with `CONTEXT_PLACEHOLDER` where the documents go."""
    parts = text.split(CONTEXT_PLACEHOLDER)
    if len(parts) != 2:
        raise PromptError(
            f"the rendered prompt must hold the documents' placeholder exactly once, found it {len(parts) - 1} "
            "times; the prompt template needs its context variable ({context} or {context_str}) once, and no "
            f"message or question may contain the reserved placeholder {CONTEXT_PLACEHOLDER!r}"
        )
    return parts[0], parts[1]


def _prefixes(render: Callable[[str], str]) -> tuple[str, str]:
    first, second = (split_at_context(render(stand_in))[0] for stand_in in _STAND_INS)
    return first, second


def check_context_prompt(render: Callable[[str], str], *, question: str = "the question") -> bool:
    """Check a prompt template where it is set; True when the text before the documents is question-free.

    `render(value)` renders the template with `CONTEXT_PLACEHOLDER` for the documents and `value` for every
    other variable. Raises PromptError when the documents' place is missing or repeated; warns with
    `QuestionBeforeContextWarning` when the text before them depends on `question` (the request still runs).
    """
    first, second = _prefixes(render)
    if first == second:
        return True
    warnings.warn(
        f"the prompt's text before the documents depends on {question}: every question then has its own prefix, "
        "computes its documents' KV anew and reuses none (the request runs, it is just not faster). Put the "
        "question after the documents.",
        QuestionBeforeContextWarning,
        stacklevel=3,
    )
    return False


def question_free_prefix(render: Callable[[str], str], *, question: str = "the question") -> str:
    """The text before the documents for precomputing their KV; PromptError when it depends on `question`,
    since KV computed for one stand-in question would be read by no request."""
    first, second = _prefixes(render)
    if first != second:
        raise PromptError(
            f"cannot precompute documents for this prompt: the text before them depends on {question}, so "
            "each question needs its own chunk KV; put the question after the documents"
        )
    return first


# -- chat ------------------------------------------------------------------------------------------------------

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTurn:
    role: str  # one of ROLES
    content: str  # text only

    def __post_init__(self) -> None:
        if self.role in ("tool", "function"):
            raise PromptError(f"no tool calling: drop {self.role} messages (and tool calls) from the conversation")
        if self.role not in ROLES:
            raise PromptError(f"unsupported message role {self.role!r}; use one of {', '.join(ROLES)}")


def non_text_error(kind: str, role: str) -> PromptError:
    """The error for a message part that is not text (an image, audio, a file, a tool call)."""
    return PromptError(
        f"the models read text only, got a {kind!r} content block in a {role} message; pass the content as text"
    )


def has_chat_template(tokenizer: Any) -> bool:
    """Whether a Hugging Face tokenizer carries a chat template (instruct models do, base models do not)."""
    return bool(tokenizer.chat_template)


def render_chat(tokenizer: Any, turns: Sequence[ChatTurn]) -> PromptText:
    """The prompt text of a conversation, ending where the assistant's answer starts (`.text` is the string).

    With a chat template this is the text the model was trained on; without one the turns become
    "Role: text" lines followed by "Assistant:". Each message's content is marked as content: a control-token
    string in it stays text when the engine tokenizes the prompt.
    """
    if not turns:
        raise PromptError("no messages to answer; pass at least one message")
    check_encodable((), **{f"{t.role} message {i}": t.content for i, t in enumerate(turns)})
    if has_chat_template(tokenizer):
        return render_chat_text(tokenizer, [{"role": t.role, "content": t.content} for t in turns])
    text = PromptText()
    for t in turns:
        text = text + f"{t.role.capitalize()}: " + PromptText.content(t.content) + "\n"
    return text + "Assistant:"


# -- per-call arguments ----------------------------------------------------------------------------------------

# The engine's names of what a call may set; a model object holds a default for each.
CALL_ARGUMENTS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "mode", "recompute_ratio")
# Other names of the same settings that the frameworks' users write: the engine's own (`Request`).
ALIASES = REQUEST_ALIASES


def call_arguments(
    defaults: Mapping[str, Any], overrides: Mapping[str, Any], *, framework: Collection[str] = ()
) -> dict[str, Any]:
    """`engine.generate` / `engine.stream` keyword arguments of one call.

    `defaults` holds the model object's setting for every name in `CALL_ARGUMENTS`; `overrides` holds the call's
    keyword arguments (engine names or `ALIASES`); names in `framework` are the framework's own (e.g. LangChain's
    `chunks`) and are left to the caller. An unknown name raises TypeError listing the accepted ones. `stop`
    None means no stop strings; `recompute_ratio` applies to blend mode only. The values are checked as the
    engine checks a request (`cacheblend_rag.Request`), before any compute.
    """
    missing = set(CALL_ARGUMENTS) - set(defaults)
    if missing:
        raise TypeError(f"defaults lack {sorted(missing)}; give a default for every name in CALL_ARGUMENTS")
    args = {name: defaults[name] for name in CALL_ARGUMENTS}
    given: dict[str, str] = {}
    for key, value in overrides.items():
        if key in framework:
            continue
        name = ALIASES.get(key, key)
        if name not in args:
            accepted = sorted({*CALL_ARGUMENTS, *ALIASES, *framework})
            raise TypeError(
                f"unexpected keyword argument {key!r}; a call accepts {accepted} (other settings are given when "
                "the model is built)"
            )
        if name in given:
            raise TypeError(f"{given[name]!r} and {key!r} set the same thing; pass one of them")
        given[name] = key
        args[name] = value
    if PrefillMode.parse(args["mode"]) is not PrefillMode.BLEND:
        args["recompute_ratio"] = None
    request = Request.from_options("a call", args)  # one check, one message per mistake, as the engine's
    args["stop"] = request.sampling.stop  # in the engine's form: a tuple of strings
    return args


def document_chunks(texts: Sequence[object]) -> list[str]:
    """The chunks of a request's retrieved documents: each document's text, in order, without the blank ones.

    A splitter or a retriever may return an empty document; it has no KV worth caching and nothing to read, so it is
    left out (both frameworks do the same). A document whose text is not a string is a PromptError naming it.
    """
    if isinstance(texts, (str, bytes)):
        raise PromptError("documents must be a list of texts, got a single string; wrap it: [text]")
    out = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise PromptError(f"document {i}'s text must be a string, got {type(text).__name__}")
        if text.strip():
            out.append(text)
    return out


def setting_aliases(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A model object's constructor arguments with `ALIASES` (`max_tokens`) under the engine's names
    (`max_new_tokens`); both names at once raise ValueError, since one would be dropped unseen."""
    out = dict(settings)
    for alias, name in ALIASES.items():
        if alias in out:
            if name in out:
                raise ValueError(f"{alias} and {name} set the same thing (the longest answer, in tokens); pass one")
            out[name] = out.pop(alias)
    return out


# -- response metadata -----------------------------------------------------------------------------------------

# RequestMetrics fields left out of a response's metadata unless detailed metrics are asked for: one number per
# layer, where the totals (recomputed_tokens, compute_share) say what a reader needs.
DETAILED_METRICS = ("recomputed_per_layer",)


def metrics_metadata(metrics: Any, *, detailed: bool = False) -> dict[str, Any]:
    """A request's `RequestMetrics.to_dict()` for a response's metadata: compact unless `detailed`."""
    d = metrics.to_dict()
    if not detailed:
        for name in DETAILED_METRICS:
            d.pop(name, None)
    return d


# -- the engine and its name -----------------------------------------------------------------------------------


# What a framework model object may set of the engine it loads (the names of EngineConfig and, for the store, of
# StoreConfig); None: the default.
ENGINE_SETTINGS = (
    "device",
    "dtype",
    "memory_budget_bytes",
    "disk_dir",
    "disk_budget_bytes",
    "redis_url",
    "redis_budget_bytes",
)
# What the frameworks' model objects say of their device and dtype fields: None leaves each to the engine's default.
DEVICE_HELP = (
    "Torch device of a loaded engine: 'auto' (the GPU where torch sees one, else the CPU), 'cpu', 'cuda' or "
    "'cuda:N'; None: the engine's default, 'auto'."
)
DTYPE_HELP = (
    "Precision of a loaded engine: 'auto' (bfloat16 on a GPU or a CPU with bf16 instructions, else float32), "
    "'float32', 'bfloat16' or 'float16'; None: the engine's default, 'auto'."
)
# Those that describe the chunk store: an engine passed in has its own, so they cannot apply to it.
STORE_SETTINGS = ("memory_budget_bytes", "disk_dir", "disk_budget_bytes", "redis_url", "redis_budget_bytes")


def engine_config(**settings: Any) -> EngineConfig:
    """The EngineConfig of a loaded engine from a model object's settings (`ENGINE_SETTINGS`; None: the default).

    A disk folder is made absolute, so two spellings of one folder name one engine. Bad values raise ConfigError.
    """
    unknown = set(settings) - set(ENGINE_SETTINGS)
    if unknown:
        raise TypeError(f"unknown engine settings {sorted(unknown)}; the accepted ones are {list(ENGINE_SETTINGS)}")
    given = {name: value for name, value in settings.items() if value is not None}
    if "disk_dir" in given:
        given["disk_dir"] = os.path.abspath(os.path.expanduser(os.fspath(given["disk_dir"])))
    store = StoreConfig(**{name: given.pop(name) for name in STORE_SETTINGS if name in given})
    return EngineConfig(store=store, **given)


def check_no_store_settings(**settings: Any) -> None:
    """ConfigError when store settings come with an engine built by the caller: it has its own store."""
    given = sorted(name for name in STORE_SETTINGS if settings.get(name) is not None)
    if given:
        raise ConfigError(
            f"{', '.join(given)} set the store of an engine the model loads, but an engine was passed in, which "
            "has its own; put them in that engine's StoreConfig, or drop engine= to let the model load one"
        )


def load_engine(name_or_path: str | None = None, **settings: Any) -> CacheBlendEngine:
    """The engine of a preset or local checkpoint, built once per process and shared by every model object.

    Building an engine loads the model (seconds) and owns the chunk KV store: sharing it lets every chain,
    LLM, chat model and synthesizer of a process reuse each other's chunk caches. The engine is thread-safe.
    `settings` are `ENGINE_SETTINGS` (device, dtype, store tiers and budgets): model objects share an engine only
    when the model (None: `default_model()`, `$CACHEBLEND_RAG_MODEL` or the default preset) and every setting are
    equal, so two objects with different stores never share one. Pass an engine you built yourself to control
    the rest of its configuration (blend settings, lead-in, signing key).
    """
    from .models import default_model

    return _shared_engine(name_or_path or default_model(), engine_config(**settings))


@functools.lru_cache(maxsize=8)
def _shared_engine(name_or_path: str, config: EngineConfig) -> CacheBlendEngine:
    return CacheBlendEngine.from_pretrained(name_or_path, config=config, show_progress=False)


def resolve_model_name(requested: str | None = None, engine: CacheBlendEngine | None = None) -> str:
    """The name metadata and traces report: the name the user gave (a preset or a path), else the engine's
    checkpoint name or folder as `transformers` recorded it ("cacheblend" for a model built in code), else
    `default_model()` (what `load_engine()` loads)."""
    if requested:
        return requested
    if engine is not None:
        return str(engine.model.config.name_or_path or "cacheblend")
    from .models import default_model

    return default_model()
