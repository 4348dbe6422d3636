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
- **Those settings are declared once**, as the pydantic fields of `EngineFields`, which both frameworks' model
  classes inherit (`fields`, imported on first use: pydantic comes with the frameworks, not with the engine).
- **What else the integrations use of the package** is re-exported here, so they import nothing deeper:
  `PromptText`, `AsyncTextStream`, the packaged embedding model's folder and the FAISS file check.

Modules: `prompts` (the documents' place, chat, documents as chunks), `calls` (a call's arguments, response
metadata), `engines` (the shared engine and its settings), `fields` (their pydantic declaration).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..engine import AsyncTextStream
from ..engine.request.marked_text import PromptText
from ..retrieval.embeddings import packaged_model_path
from ..retrieval.faiss_file import flat_index_problem
from .calls import (
    ALIASES,
    CALL_ARGUMENTS,
    DETAILED_METRICS,
    call_arguments,
    metrics_metadata,
    setting_aliases,
)
from .engines import (
    DEVICE_HELP,
    DTYPE_HELP,
    ENGINE_SETTINGS,
    STORE_SETTINGS,
    check_no_store_settings,
    engine_config,
    load_engine,
    resolve_model_name,
)
from .prompts import (
    CONTEXT_PLACEHOLDER,
    ROLES,
    ChatTurn,
    QuestionBeforeContextWarning,
    check_context_prompt,
    document_chunks,
    has_chat_template,
    non_text_error,
    question_free_prefix,
    render_chat,
    split_at_context,
)

if TYPE_CHECKING:
    from .fields import EngineFields

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
    "AsyncTextStream",
    "ChatTurn",
    "EngineFields",
    "PromptText",
    "QuestionBeforeContextWarning",
    "call_arguments",
    "check_context_prompt",
    "check_no_store_settings",
    "document_chunks",
    "engine_config",
    "flat_index_problem",
    "has_chat_template",
    "load_engine",
    "metrics_metadata",
    "non_text_error",
    "packaged_model_path",
    "question_free_prefix",
    "render_chat",
    "resolve_model_name",
    "setting_aliases",
    "split_at_context",
]


def __getattr__(name: str) -> Any:  # EngineFields needs pydantic, which the frameworks bring: loaded on first use
    if name == "EngineFields":
        from .fields import EngineFields

        return EngineFields
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
