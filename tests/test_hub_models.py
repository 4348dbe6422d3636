"""A Hugging Face hub id loads as `transformers` loads it, from a local Hugging Face cache built here: offline.

Each test writes the cache layout the hub client reads (`models--org--name/snapshots/<commit>/` with config,
tokenizer and safetensors weights, `refs/main` naming the commit) into a temporary folder, with downloads off
(`HF_HUB_OFFLINE=1`, as `tests/conftest.py` sets for every test), so nothing is ever fetched. The tiny model
is a Llama: for a Qwen2 config, transformers rebuilds the tokenizer as its own Qwen2 BPE class, which cannot
read the tiny word-level vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3NextConfig

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.errors import ModelNotFoundError, UnsupportedModelError
from cacheblend_rag.models.loader import load_model
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _snapshot(cache: Path, repo_id: str) -> Path:
    """The snapshot folder of `repo_id` in the cache at `cache`, with refs/main pointing at it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    return snapshot


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_cached_hub_id_loads_through_from_pretrained(tmp_path: Path, offline: None) -> None:
    model = make_tiny_model("llama", seed=3, num_layers=2)
    snapshot = _snapshot(tmp_path, "tiny-org/tiny-llama")
    model.save_pretrained(snapshot)  # config.json, generation_config.json, model.safetensors
    make_tiny_tokenizer(chat_template=True).save_pretrained(snapshot)
    assert list(snapshot.glob("*.safetensors"))

    engine = CacheBlendEngine.from_pretrained("tiny-org/tiny-llama", cache_dir=str(tmp_path), show_progress=False)

    assert engine.model.config.model_type == "llama"
    input_ids = torch.tensor([[5, 6, 7, 8]])  # (1, 4)
    with torch.no_grad():
        torch.testing.assert_close(engine.model(input_ids).logits, model(input_ids).logits, rtol=0, atol=0)
    assert engine.tokenizer.encode("w1 w2", add_special_tokens=False) == [4, 5]
    assert engine.generate(["w5 w6 w7"], "w8 w9", max_new_tokens=2).metrics.generated_tokens == 2


def test_uncached_hub_id_without_downloads_says_how_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        load_model("tiny-org/not-in-the-cache", cache_dir=tmp_path, local_files_only=True)
    message = str(info.value)
    assert "'tiny-org/not-in-the-cache' is not cached" in message
    assert "network" in message and "local folder" in message


def test_hf_hub_offline_forbids_downloads_like_local_files_only(tmp_path: Path, offline: None) -> None:
    with pytest.raises(ModelNotFoundError, match="downloads are off"):
        CacheBlendEngine.from_pretrained("tiny-org/not-in-the-cache", cache_dir=str(tmp_path))


def test_cached_unsupported_family_is_refused_from_its_config(tmp_path: Path, offline: None) -> None:
    # Qwen3-Next's layers are mostly linear attention; the config alone decides, no weights needed.
    config = Qwen3NextConfig(
        vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    config.save_pretrained(_snapshot(tmp_path, "tiny-org/tiny-qwen3-next"))
    with pytest.raises(UnsupportedModelError, match="qwen3_next"):
        load_model("tiny-org/tiny-qwen3-next", cache_dir=tmp_path)


def test_missing_path_that_cannot_be_a_hub_id_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not an existing file or folder, and not a Hugging Face hub id"):
        load_model(str(tmp_path / "no" / "such" / "folder"))


@pytest.fixture
def unreachable_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """Downloads on, but the hub is a closed port on this machine: the probe is refused at once, and nothing
    outside this machine is ever asked."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: refused


def test_uncached_hub_id_with_the_hub_unreachable_fails_at_once_saying_what_to_do(
    tmp_path: Path, unreachable_hub: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.utils._http as hub_http

    waits: list[float] = []  # the hub client's back-off between retries ("Retrying in Ns"), about 30 s in all
    monkeypatch.setattr(hub_http.time, "sleep", waits.append)
    with pytest.raises(ModelNotFoundError) as info:
        load_model("some-org/some-model", cache_dir=tmp_path)
    assert waits == []  # one probe, then the local cache only: no retry was ever waited for
    message = str(info.value)
    assert "'some-org/some-model' is not in" in message and "cannot be reached" in message
    assert "hf download some-org/some-model" in message and "local folder" in message


def test_cached_hub_id_loads_from_the_cache_when_the_hub_is_unreachable(tmp_path: Path, unreachable_hub: None) -> None:
    snapshot = _snapshot(tmp_path, "tiny-org/tiny-llama")
    make_tiny_model("llama", seed=3, num_layers=2).save_pretrained(snapshot)
    make_tiny_tokenizer().save_pretrained(snapshot)
    with pytest.warns(UserWarning, match="hub cannot be reached .* read from the local cache"):
        model, _ = load_model("tiny-org/tiny-llama", cache_dir=tmp_path)
    assert model.config.model_type == "llama"
