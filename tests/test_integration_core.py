"""cacheblend_rag.frameworks: what the LangChain and LlamaIndex packages share, checked without either framework."""

from __future__ import annotations

import warnings

import pytest

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.errors import ConfigError, PromptError
from cacheblend_rag.frameworks import (
    CALL_ARGUMENTS,
    CONTEXT_PLACEHOLDER,
    ChatTurn,
    QuestionBeforeContextWarning,
    call_arguments,
    check_context_prompt,
    check_no_store_settings,
    engine_config,
    load_engine,
    question_free_prefix,
    render_chat,
    resolve_model_name,
    split_at_context,
)
from cacheblend_rag.models import DEFAULT_PRESET, default_model
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer

DEFAULTS = {
    "max_new_tokens": 8,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "seed": None,
    "stop": None,
    "mode": "blend",
    "recompute_ratio": 0.2,
}


def question_after(question: str) -> str:
    return f"Passages: {CONTEXT_PLACEHOLDER} Question: {question}"


def question_before(question: str) -> str:
    return f"Question: {question} Passages: {CONTEXT_PLACEHOLDER}"


def test_split_at_context_cuts_the_prompt_where_the_documents_go():
    assert split_at_context(question_after("why?")) == ("Passages: ", " Question: why?")
    for text in ("no documents here", f"{CONTEXT_PLACEHOLDER} twice {CONTEXT_PLACEHOLDER}"):
        with pytest.raises(PromptError, match="exactly once"):
            split_at_context(text)


def test_question_after_the_documents_passes_silently_and_gives_a_question_free_prefix():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_context_prompt(question_after) is True
    assert question_free_prefix(question_after) == "Passages: "


def test_question_before_the_documents_warns_and_cannot_be_precomputed():
    with pytest.warns(QuestionBeforeContextWarning, match="depends on \\{query_str\\}.*reuses none"):
        assert check_context_prompt(question_before, question="{query_str}") is False
    with pytest.raises(PromptError, match="cannot precompute"):
        question_free_prefix(question_before)
    with pytest.raises(PromptError, match="exactly once"):
        check_context_prompt(lambda question: f"no documents, {question}")


def test_chat_uses_the_tokenizers_template_or_plain_role_lines():
    turns = [ChatTurn("system", "w1"), ChatTurn("user", "w2")]
    templated = make_tiny_tokenizer(chat_template=True)
    expected = templated.apply_chat_template(
        [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert render_chat(templated, turns).text == expected
    assert render_chat(make_tiny_tokenizer(), turns).text == "System: w1\nUser: w2\nAssistant:"
    with pytest.raises(PromptError, match="at least one message"):
        render_chat(templated, [])


def test_chat_roles_are_system_user_and_assistant_only():
    with pytest.raises(PromptError, match="no tool calling"):
        ChatTurn("tool", "result")
    with pytest.raises(PromptError, match="unsupported message role 'critic'"):
        ChatTurn("critic", "w1")


def test_call_arguments_merge_defaults_and_overrides_under_one_list():
    args = call_arguments(DEFAULTS, {"max_tokens": 3, "stop": "\n", "chunks": ["x"]}, framework=("chunks",))
    assert set(args) == set(CALL_ARGUMENTS)
    assert args["max_new_tokens"] == 3 and args["stop"] == ("\n",) and args["recompute_ratio"] == 0.2
    assert call_arguments(DEFAULTS, {})["stop"] == ()  # None: no stop strings
    assert call_arguments(DEFAULTS, {"mode": "full"})["recompute_ratio"] is None  # blend's setting only
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'.*'temperature'"):
        call_arguments(DEFAULTS, {"temprature": 1.0})
    with pytest.raises(TypeError, match="pass one of them"):
        call_arguments(DEFAULTS, {"max_tokens": 3, "max_new_tokens": 4})


def test_model_name_is_the_requested_name_else_the_checkpoint_else_the_default_preset(tmp_path, monkeypatch):
    monkeypatch.delenv("CACHEBLEND_RAG_MODEL", raising=False)
    make_tiny_model("llama").save_pretrained(tmp_path)
    make_tiny_tokenizer().save_pretrained(tmp_path)
    engine = CacheBlendEngine.from_pretrained(
        str(tmp_path), config=EngineConfig(miss_policy="blend"), show_progress=False
    )
    assert resolve_model_name("my-model", engine) == "my-model"
    assert resolve_model_name(None, engine) == str(tmp_path)
    in_code = CacheBlendEngine(
        make_tiny_model("llama"), make_tiny_tokenizer(), config=EngineConfig(miss_policy="blend")
    )
    assert resolve_model_name(None, in_code) == "cacheblend"
    assert resolve_model_name(None, None) == DEFAULT_PRESET


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama").save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def test_model_objects_share_an_engine_only_when_model_and_store_settings_are_equal(tiny_checkpoint, tmp_path):
    disk = tmp_path / "kv"
    first = load_engine(tiny_checkpoint, disk_dir=str(disk), memory_budget_bytes=2**20)
    assert load_engine(tiny_checkpoint, disk_dir=str(disk / ".." / "kv"), memory_budget_bytes=2**20) is first
    assert first.config.store.disk_dir == str(disk) and first.config.store.memory_budget_bytes == 2**20
    assert load_engine(tiny_checkpoint, disk_dir=str(tmp_path / "other"), memory_budget_bytes=2**20) is not first
    assert load_engine(tiny_checkpoint, disk_dir=str(disk)) is not first  # another memory budget
    assert load_engine(tiny_checkpoint) is load_engine(tiny_checkpoint, device="cpu", disk_dir=None)


def test_engine_settings_are_checked_before_anything_loads():
    with pytest.raises(ConfigError, match="redis_url must start with redis://"):
        engine_config(redis_url="localhost:6379")
    with pytest.raises(TypeError, match="unknown engine settings \\['lead_in'\\]"):
        engine_config(lead_in="x")
    check_no_store_settings(device="cpu", disk_dir=None)  # no store setting given: nothing to refuse
    with pytest.raises(ConfigError, match="disk_dir, redis_url set the store.*engine was passed in"):
        check_no_store_settings(disk_dir="/tmp/kv", redis_url="redis://h")


def test_the_model_loaded_when_none_is_named_comes_from_the_environment(monkeypatch):
    assert default_model({}) == DEFAULT_PRESET
    assert default_model({"CACHEBLEND_RAG_MODEL": " "}) == DEFAULT_PRESET
    assert default_model({"CACHEBLEND_RAG_MODEL": "smollm2-135m-instruct"}) == "smollm2-135m-instruct"
    monkeypatch.setenv("CACHEBLEND_RAG_MODEL", "/models/mine")
    assert resolve_model_name(None, None) == "/models/mine"


def test_engine_fields_are_declared_once_under_the_engines_names() -> None:
    pytest.importorskip("pydantic")
    from cacheblend_rag.frameworks import ENGINE_SETTINGS, EngineFields

    assert tuple(EngineFields.model_fields) == ENGINE_SETTINGS
    assert all(field.default is None for field in EngineFields.model_fields.values())  # unset: the engine's default
    fields = EngineFields(redis_url="redis://:pw@host:6379/0", dtype="bf16")
    assert fields.engine_settings()["redis_url"] == "redis://:pw@host:6379/0" and "pw" not in repr(fields)
    assert engine_config(**fields.engine_settings()).dtype == "bfloat16"


def test_the_integrations_import_only_the_public_api() -> None:
    import re
    from pathlib import Path

    public = {"cacheblend_rag", "cacheblend_rag.frameworks", "cacheblend_rag.errors"}
    root = Path(__file__).resolve().parents[1] / "integrations"
    pattern = re.compile(r"^\s*(?:from|import)\s+(cacheblend_rag[\w.]*)", re.MULTILINE)
    deeper = {
        f"{path.relative_to(root)}: {module}"
        for path in root.rglob("*.py")
        if "tests" not in path.parts
        for module in pattern.findall(path.read_text())
        if module not in public
    }
    assert not deeper, f"the integrations reach past the public API: {sorted(deeper)}"
