"""The model fingerprint that chunk keys hash: it must change whenever any weight changes.

Chunk KV is only valid for the exact weights that computed it, and disk and Redis tiers are shared between
processes and machines, so two models that differ anywhere must never share a fingerprint. What it covers:

- the architecture: the model's config, minus fields that do not change the computation (its path, versions);
- the buffers (the rotary embedding's `inv_freq`, ...): tensors the forward reads that are not parameters and that
  no checkpoint file holds (they are computed when the model is built), hashed whole up to 4096 values, sampled
  beyond, so a model whose rotary frequencies were changed never reads another model's entries;
- the weights, one of two ways:
  - **checkpoint content**: when the model was loaded from a local folder of weight files (`*.safetensors` or
    `*.bin`, as `from_pretrained` leaves in `model.name_or_path`; the presets load their converted copy this way),
    the sha256 of every byte of those files. It is computed once and cached beside them in
    `.cacheblend-fingerprint.json`, keyed by each file's name, device, inode, size, modification time and
    status-change time (`st_ctime_ns`), so later loads only `stat` the files. The cache trusts that key: a file
    written in place gets a new ctime even when its size and mtime are set back (no user can set ctime), and a
    copy of the folder (cached digest included) has other inodes, so either is hashed again. What the key cannot
    see is a change that keeps the inode and the ctime, which needs the clock or the filesystem rewritten.
    A sample of every parameter tensor as it is in memory (up to 64 evenly spaced values, all of it for tensors
    of up to 4096 values such as norms and biases) is hashed too, so editing the model after loading it (merging
    a LoRA, adding noise, replacing a layer) changes the fingerprint as well.
  - **parameter digest** otherwise (a model built in memory, a GGUF file, a hub id): the sha256 of every
    parameter tensor's bytes, names and shapes, computed when the engine is built (about 1 s per GB).

The dtype the engine runs in and the device are not part of the fingerprint (the chunk key adds the dtype), but a
model whose in-memory values differ (loaded in another dtype) gets another sample, hence another fingerprint.
`fingerprint_in(model, dtype)` works out that other fingerprint (from the weight files, or from fp32 weights
before a cast) so that an engine can say that a missing chunk is stored for another dtype; the buffers are hashed
rounded to bf16 for that reason (their bf16 values are every wider dtype's, rounded).
Not covered: an edit after loading that touches only unsampled values of a checkpoint-backed model's tensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "quantization_config"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_SIDECAR = ".cacheblend-fingerprint.json"
_SAMPLE = 64  # values sampled from each large tensor of a checkpoint-backed model
_SMALL = 4096  # tensors of at most this many values are hashed whole


def model_fingerprint(model: torch.nn.Module) -> str:
    """A 32-hex-digit digest of the model's architecture and weights (see the module docstring for what it covers)."""
    h = _architecture(model)
    files = checkpoint_files(model)
    if files:
        h.update(b"checkpoint\0" + checkpoint_digest(files).encode())
        h.update(b"sample\0" + _sample_digest(model.named_parameters()).encode())
    else:
        h.update(b"parameters\0" + parameter_digest(model).encode())
    return h.hexdigest()[:32]


def _architecture(model: torch.nn.Module) -> hashlib._Hash:
    """The hash begun with what does not depend on the dtype the model is loaded in: its config and its buffers,
    these rounded to bfloat16 (a buffer such as `inv_freq` is cast with the model, and its bf16 values are those
    of every wider dtype rounded)."""
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
    buffers = ((name, tuple(b.shape), _sample(b).to(torch.bfloat16)) for name, b in model.named_buffers())
    h.update(b"buffers\0" + _digest_samples(buffers).encode())
    return h


def checkpoint_files(model: torch.nn.Module) -> list[Path]:
    """The weight files of the local folder the model was loaded from, sorted; [] when there is none."""
    source = model.config.name_or_path or ""
    folder = Path(str(source)).expanduser()
    if not source or not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())


def checkpoint_digest(files: Iterable[Path]) -> str:
    """sha256 over the content of `files` (all in one folder), cached beside them.

    The cached digest is used only while every file has the same name, device, inode, size, mtime and ctime as
    when it was hashed (see the module docstring for what that does and does not catch).
    """
    files = sorted(files)
    stats = {p.name: _file_identity(p) for p in files}
    sidecar = files[0].parent / _SIDECAR
    try:
        cached = json.loads(sidecar.read_text())
        if isinstance(cached, dict) and cached.get("files") == stats and isinstance(cached.get("sha256"), str):
            return cached["sha256"]
    except (OSError, ValueError):
        pass  # no cache yet, or an unreadable one: hash again
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0")
        with p.open("rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
    digest = h.hexdigest()
    try:
        tmp = sidecar.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"files": stats, "sha256": digest}))
        os.replace(tmp, sidecar)
    except OSError as exc:  # a read-only folder: correct, only slower next time
        logger.info("could not cache the checkpoint digest beside %s (%s); it is recomputed on each load", p, exc)
    return digest


def _file_identity(path: Path) -> list[int]:
    """What the cached digest of `path` is keyed on: an in-place write changes ctime, a copy changes the inode."""
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())


def parameter_digest(model: torch.nn.Module, dtype: torch.dtype | None = None) -> str:
    """sha256 of every parameter tensor (names, shapes, dtypes and bytes), in name order; with `dtype`, of the
    parameters cast to it (what the model built in that dtype would hold)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda item: item[0]):
        p = p.detach() if dtype is None else p.detach().to(dtype)
        h.update(f"{name}\0{tuple(p.shape)}\0{p.dtype}\0".encode())
        h.update(_tensor_bytes(p))
    return h.hexdigest()


def _sample(p: torch.Tensor) -> torch.Tensor:
    """The values of `p` the fingerprint hashes: evenly spaced ones of a large tensor, all of a small one."""
    flat = p.detach().reshape(-1)
    n = flat.numel()
    if n > _SMALL:
        # integer spacing: float positions round past the end once n exceeds 2^24
        flat = flat[_sample_positions(n, flat.device)]
    return flat


def _sample_positions(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.arange(_SAMPLE, device=device) * (n - 1) // (_SAMPLE - 1)


def _digest_samples(samples: Iterable[tuple[str, tuple[int, ...], torch.Tensor]]) -> str:
    """sha256 of (name, shape, sampled values as float32) of every tensor, in name order."""
    h = hashlib.sha256()
    for name, shape, values in sorted(samples, key=lambda item: item[0]):
        h.update(f"{name}\0{tuple(shape)}\0".encode())
        h.update(_tensor_bytes(values.float()))
    return h.hexdigest()


def _sample_digest(params: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 of evenly spaced values of every tensor (all of each small one), as float32."""
    return _digest_samples((name, tuple(p.shape), _sample(p)) for name, p in params)


def fingerprint_in(model: torch.nn.Module, dtype: torch.dtype) -> str | None:
    """The fingerprint this model would have loaded in `dtype` instead: what an engine computing in that dtype keys
    its chunk entries by (to tell a user that they are stored, never to read them). From the checkpoint's values
    cast to `dtype` for a model loaded from local weight files and not edited since (its in-memory sample matches
    the checkpoint's); from the parameters cast to `dtype` for a model built in memory in float32. None where the
    values that dtype would hold cannot be known (a model built in bf16, a checkpoint edited after loading)."""
    params = dict(model.named_parameters())
    if not params:
        return None
    own = next(iter(params.values())).dtype
    if own == dtype:
        return model_fingerprint(model)
    h = _architecture(model)
    files = checkpoint_files(model)
    if files:
        stored = _checkpoint_sample(files, params)
        if stored is None:
            return None  # a tensor the files do not hold, or not safetensors
        as_loaded = _digest_samples((n, tuple(params[n].shape), v.to(own)) for n, v in stored.items())
        if as_loaded != _sample_digest(params.items()):
            return None  # edited after loading: the files do not say what it holds
        h.update(b"checkpoint\0" + checkpoint_digest(files).encode())
        cast = _digest_samples((n, tuple(params[n].shape), v.to(dtype)) for n, v in stored.items())
        h.update(b"sample\0" + cast.encode())
    elif own == torch.float32:
        h.update(b"parameters\0" + parameter_digest(model, dtype).encode())
    else:
        return None
    return h.hexdigest()[:32]


def _checkpoint_sample(files: Iterable[Path], params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """`_sample` of each parameter as the safetensors files hold it; None when a parameter is not in the files
    (or they are not safetensors). Large tensors are read a row at a time, only the rows sampled."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for path in files:
        if path.suffix != ".safetensors":
            return None
        with safe_open(str(path), "pt") as f:
            for name in set(f.keys()) & set(params):
                n, shape = params[name].numel(), params[name].shape
                if n <= _SMALL or len(shape) < 2:
                    found[name] = _sample(f.get_tensor(name))
                    continue
                sl, row = f.get_slice(name), n // shape[0]
                picks = [int(i) for i in _sample_positions(n)]
                rows = {r: sl[r : r + 1].reshape(-1) for r in {i // row for i in picks}}
                found[name] = torch.stack([rows[i // row][i % row] for i in picks])
    return found if set(found) == set(params) else None


def fingerprints_by_dtype(model: torch.nn.Module, dtype: torch.dtype) -> Callable[[torch.dtype], str | None]:
    """`fingerprint_in` of `model` once it is cast to `dtype`, for every dtype, as a lookup an engine keeps. A model
    built in memory and about to be cast loses its values in the cast, so its fingerprints are worked out now (a
    parameter digest each, about 1 s per GB); a checkpoint's are worked out from its files when first asked."""
    if checkpoint_files(model) or next(model.parameters()).dtype == dtype:
        return lambda other: fingerprint_in(model, other)  # `model.to(...)` casts this same module in place
    # only the other dtypes: the engine's own is `model_fingerprint` of the cast model, asked of no lookup
    known = {d: fingerprint_in(model, d) for d in (torch.float32, torch.bfloat16, torch.float16) if d != dtype}
    return known.get
