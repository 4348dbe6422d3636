"""One source of defaults: every entry point runs where `EngineConfig()` runs, with and without a GPU.

torch is told it has a GPU by replacing `torch.cuda.is_available` / `device_count`; the model load is replaced by
a recorder that stops the call, so no test here needs a GPU or loads weights.
"""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import ConfigError, EngineConfig, resolve_device
from cacheblend_rag.cli import build_parser
from cacheblend_rag.cli.ask import engine_config as ask_engine_config
from cacheblend_rag.cli.env import environment_report
from cacheblend_rag.config import dtype as dtype_rule

# "auto" as it really decides (the suite pins it to float32 elsewhere, for its tolerances)
pytestmark = pytest.mark.auto_dtype


class _Loaded(Exception):
    """Raised by the recording loader: the entry point got as far as loading a model."""


@pytest.fixture(params=[False, True], ids=["no-gpu", "gpu"])
def gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    if request.param:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return request.param


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(device, dtype) of every model load an entry point starts; the load itself stops with `_Loaded`."""
    import cacheblend_rag.models

    seen: list[tuple[str, str]] = []

    def record(name_or_path=None, *, device, dtype, **_):
        seen.append((str(device), str(dtype)))
        raise _Loaded

    monkeypatch.setattr(cacheblend_rag.models, "load_model", record)
    return seen


def _default() -> tuple[str, str]:
    config = EngineConfig()
    return config.device, config.dtype


def test_auto_is_the_gpu_where_torch_sees_one(gpu: bool) -> None:
    assert resolve_device("auto") == ("cuda" if gpu else "cpu")
    assert resolve_device() == resolve_device("auto")
    assert _default() == (("cuda", "bfloat16") if gpu else ("cpu", dtype_rule.auto_dtype("cpu")))


def test_a_device_torch_does_not_have_is_a_config_error(gpu: bool) -> None:
    with pytest.raises(ConfigError, match="must be 'auto'"):
        resolve_device("tpu")
    with pytest.raises(ConfigError, match="cuda:3"):
        resolve_device("cuda:3")  # one GPU at most here
    if not gpu:
        with pytest.raises(ConfigError, match="torch sees no CUDA device"):
            resolve_device("cuda")
    assert resolve_device("cpu") == "cpu"


def test_engine_from_pretrained_loads_where_engine_config_says(gpu: bool, loads: list) -> None:
    from cacheblend_rag import CacheBlendEngine

    with pytest.raises(_Loaded):
        CacheBlendEngine.from_pretrained()
    assert loads == [_default()]


def test_langchain_models_left_unset_use_the_engines_default(gpu: bool, loads: list) -> None:
    lc = pytest.importorskip("langchain_cacheblend")
    for model_class in (lc.ChatCacheBlend, lc.CacheBlendLLM):
        model = model_class()
        assert (model.device, model.dtype) == (None, None)  # unset: the engine decides, never a copied default
        with pytest.raises(_Loaded):
            model.get_engine()
    assert loads == [_default(), _default()]


def test_llamaindex_llm_left_unset_uses_the_engines_default(gpu: bool, loads: list) -> None:
    llms = pytest.importorskip("llama_index.llms.cacheblend")
    with pytest.raises(_Loaded):
        llms.CacheBlendLLM()
    with pytest.raises(_Loaded):
        llms.CacheBlendLLM.from_pretrained()
    assert loads == [_default(), _default()]


def test_cli_ask_runs_where_engine_config_says(gpu: bool, tmp_path) -> None:
    args = build_parser().parse_args(["ask", "--docs", str(tmp_path), "a question"])
    config = ask_engine_config(args)
    assert (config.device, config.dtype) == _default()


def test_embeddings_helpers_follow_the_device_rule(gpu: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    langchain_faiss = pytest.importorskip("langchain_cacheblend.vectorstores.faiss")
    synth_index = pytest.importorskip("llama_index.response_synthesizers.cacheblend.index")
    import langchain_huggingface

    seen: list[str] = []
    monkeypatch.setattr(
        langchain_huggingface, "HuggingFaceEmbeddings", lambda **kw: seen.append(kw["model_kwargs"]["device"])
    )
    monkeypatch.setattr(synth_index, "HuggingFaceEmbedding", lambda **kw: seen.append(kw["device"]))
    langchain_faiss.packaged_embeddings()
    synth_index.minilm_embedding()
    assert seen == [_default()[0]] * 2


def test_env_names_what_auto_resolves_to_and_checks_a_model(gpu: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if gpu:  # device_reason reads the GPU's name and memory
        props = type("Props", (), {"name": "Test GPU", "total_memory": 80 * 2**30})()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    report = environment_report(model="smollm2-135m-instruct")
    device, dtype = _default()
    assert f'device "auto" -> {device}' in report and f'dtype "auto" -> {dtype}' in report
    assert ("Test GPU, 80 GiB" in report) == gpu
    assert "torch " + torch.__version__ in report
    model_line = next(line for line in report.splitlines() if line.startswith("model smollm2-135m-instruct"))
    assert "supported" in model_line and "refused" not in model_line  # converted or not yet
    assert "store memory tier" in report


def test_env_refuses_an_unsupported_family_from_its_config(tmp_path) -> None:
    from transformers import GPTNeoXConfig

    GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64).save_pretrained(
        tmp_path
    )
    report = environment_report(model=str(tmp_path))
    assert f"model {tmp_path} (gpt_neox): refused:" in report


def test_env_says_which_fast_paths_a_family_gets(tmp_path) -> None:
    from transformers import Gemma2Config, LlamaConfig

    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    Gemma2Config(head_dim=16, sliding_window=64, **tiny).save_pretrained(tmp_path / "gemma2")
    LlamaConfig(**tiny).save_pretrained(tmp_path / "llama")
    assert "(gemma2): supported; fast paths:" in environment_report(model=str(tmp_path / "gemma2"))
    assert "CUDA graphs no (the exact path)" in environment_report(model=str(tmp_path / "gemma2"))
    assert "CUDA graphs yes" in environment_report(model=str(tmp_path / "llama"))
