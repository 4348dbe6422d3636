"""Quiet loading and the bfloat16 advice: `show_progress=False` silences the GGUF dequantizer's bar, and a model
loaded in bfloat16 on a CPU known to lack bf16 instructions warns (once per call site) that float32 is faster."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, EngineConfig, cpu
from cacheblend_rag.models import gguf
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer

BAR = "Converting and de-quantizing GGUF tensors..."


@pytest.fixture
def dequantizing_stub(monkeypatch):
    """transformers' GGUF loading replaced by a stub that draws the dequantizer's bar as transformers does."""
    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    def from_pretrained(*args, **kwargs):
        for _ in gguf_utils.tqdm(range(3), desc=BAR):
            pass
        return SimpleNamespace(config=SimpleNamespace())

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: "tokenizer")
    return gguf_utils


@pytest.mark.parametrize("show_progress", [False, True])
def test_the_dequantizing_bar_follows_show_progress(dequantizing_stub, capfd, show_progress) -> None:
    bar = dequantizing_stub.tqdm
    model, tokenizer = gguf.load_gguf(Path("model.gguf"), torch.float32, show_progress=show_progress)
    assert tokenizer == "tokenizer" and model.hf_quantizer is None
    assert (BAR in capfd.readouterr().err) is show_progress
    assert dequantizing_stub.tqdm is bar  # put back after the load


def test_cpuinfo_flags_tell_bf16() -> None:
    assert cpu.bf16_in_cpuinfo("processor : 0\nflags\t\t: fpu sse2 avx avx2\n") is False
    assert cpu.bf16_in_cpuinfo("flags : fpu avx2 avx512f avx512_bf16\n") is True
    assert cpu.bf16_in_cpuinfo("flags : fpu avx2 amx_tile amx_bf16\n") is True
    assert cpu.bf16_in_cpuinfo("processor : 0\nFeatures : fp asimd\n") is None  # no x86 flags: unknown
    assert cpu.cpu_has_bf16() in (True, False, None)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-bf16")
    make_tiny_model("llama").save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return folder


def test_bf16_on_a_cpu_without_bf16_instructions_warns(tiny_folder, monkeypatch) -> None:
    monkeypatch.setattr(cpu, "cpu_has_bf16", lambda: False)
    with pytest.warns(UserWarning, match=r"no bf16 instructions \(AMX or AVX-512-BF16\).*use float32"):
        engine = CacheBlendEngine.from_pretrained(str(tiny_folder), config=EngineConfig(dtype="bfloat16"))
    assert engine.dtype == torch.bfloat16


@pytest.mark.parametrize(("has_bf16", "dtype"), [(True, "bfloat16"), (None, "bfloat16"), (False, "float32")])
def test_no_warning_with_bf16_instructions_unknown_support_or_float32(tiny_folder, monkeypatch, has_bf16, dtype):
    monkeypatch.setattr(cpu, "cpu_has_bf16", lambda: has_bf16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CacheBlendEngine.from_pretrained(str(tiny_folder), config=EngineConfig(dtype=dtype), show_progress=False)


def test_a_model_converted_to_bf16_by_the_engine_warns_once(monkeypatch) -> None:
    monkeypatch.setattr(cpu, "cpu_has_bf16", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CacheBlendEngine(make_tiny_model("llama"), make_tiny_tokenizer(), config=EngineConfig(dtype="bfloat16"))
    assert [str(w.message) for w in caught if "bf16 instructions" in str(w.message)] == [cpu.SLOW_BF16_WARNING]


@pytest.mark.auto_dtype
@pytest.mark.parametrize(
    ("has_bf16", "device", "chosen"),
    [(True, "cpu", "bfloat16"), (False, "cpu", "float32"), (None, "cpu", "float32"), (False, "cuda", "bfloat16")],
)
def test_dtype_auto_picks_bf16_where_it_is_fast_and_float32_elsewhere(monkeypatch, has_bf16, device, chosen):
    monkeypatch.setattr(cpu, "cpu_has_bf16", lambda: has_bf16)
    assert EngineConfig(dtype="auto", device=device).dtype == chosen
    assert EngineConfig(dtype="AUTO", device=device).dtype == chosen


@pytest.mark.auto_dtype
def test_an_engine_and_a_model_loaded_with_dtype_auto_run_in_what_auto_chose(tiny_folder, monkeypatch) -> None:
    from cacheblend_rag.models import load_model

    monkeypatch.setattr(cpu, "cpu_has_bf16", lambda: True)
    model, _ = load_model(str(tiny_folder), dtype="auto", show_progress=False)
    assert model.dtype == torch.bfloat16
    monkeypatch.setattr(cpu, "cpu_has_bf16", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto never picks the slow bf16
        engine = CacheBlendEngine.from_pretrained(str(tiny_folder), config=EngineConfig(dtype="auto"))
    assert (engine.config.dtype, engine.dtype) == ("float32", torch.float32)
