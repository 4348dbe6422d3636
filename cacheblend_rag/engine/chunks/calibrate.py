"""The `pca` codec's calibration for one model: KV of a fixed text, fitted once, kept beside the disk tier.

The text (`calibration_text.txt`: prose, a dialogue, news, a multi-hop question, code, a recipe, notes) is
prefilled paragraph by paragraph after the template's prefix, as a chunk's entry is, and each head's keys (before
RoPE) and values give the basis and steps (`store.transform_codec.KVCalibration.fit`). Entries name the
calibration's digest, so a calibration must not change under a store: it is saved in the disk tier's folder
(`<disk_dir>/calibration/<model fingerprint>-<dtype>.safetensors`) on first use and read from there afterwards.
Without a disk folder it is fitted at each start (about one prefill of 1,200 tokens), which gives the same
calibration on the same machine and software; another machine may fit another one, whose entries then miss.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch

from ...config import StoreConfig
from ...fusion import FusionPlan, fuse
from ...models.adapter import LayerwiseModel
from ...store.codec import CALIBRATED_CODECS
from ...store.disk.folder import CALIBRATION_FOLDER
from ...store.transform_codec import KVCalibration, TransformCodec
from ..request.prompt import PromptTemplate, encode, tokenize_prefix
from .cache import whole_prompt_kv

logger = logging.getLogger(__name__)


def calibration_paragraphs() -> list[str]:
    """The calibration text, in the paragraphs it is prefilled as."""
    text = files(__package__).joinpath("calibration_text.txt").read_text(encoding="utf-8")
    return [p.strip() for p in text.split("\n\n") if p.strip()]


@torch.inference_mode()
def calibration_kv(lm: LayerwiseModel, tokenizer: Any, prefix_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys before RoPE and values of every calibration paragraph prefilled after `prefix_ids`, the paragraphs'
    tokens side by side: [L, Hkv, N, D] each, float32, on the CPU."""
    keys, values = [], []
    for paragraph in calibration_paragraphs():
        ids = [*prefix_ids, *encode(tokenizer, paragraph)]
        n, p = len(ids), len(prefix_ids)
        none = torch.zeros(n, dtype=torch.bool)
        plan = FusionPlan(input_ids=torch.tensor(ids), positions=torch.arange(n), exact=none, reused=none.clone())
        result = fuse(lm, plan, whole_prompt_kv(lm, [], n, keep_raw=True), want_logits=False)
        assert result.kv.raw_keys is not None
        keys.append(result.kv.raw_keys[:, :, p:].float().cpu())
        values.append(result.kv.values[:, :, p:].float().cpu())
    return torch.cat(keys, dim=2), torch.cat(values, dim=2)


def calibration_path(disk_dir: str | os.PathLike[str], fingerprint: str, dtype: torch.dtype) -> Path:
    return Path(disk_dir) / CALIBRATION_FOLDER / f"{fingerprint[:32]}-{str(dtype).removeprefix('torch.')}.safetensors"


def pca_codec(
    lm: LayerwiseModel, tokenizer: Any, prefix_ids: Sequence[int], fingerprint: str, dtype: torch.dtype,
    disk_dir: str | os.PathLike[str] | None,
) -> TransformCodec:  # fmt: skip
    """The `pca` codec for this model: its calibration read from `disk_dir` if kept there, else fitted (and kept
    there, when there is a folder). A damaged file is fitted again and replaced, with a warning."""
    path = calibration_path(disk_dir, fingerprint, dtype) if disk_dir is not None else None
    if path is not None and path.exists():
        try:
            calibration = KVCalibration.load(path)
            if calibration.shape == (lm.shape.num_layers, lm.shape.num_kv_heads, lm.shape.head_dim):
                return TransformCodec(calibration)
            logger.warning("%s is for another model shape %s: fitting it again", path, calibration.shape)
        except (OSError, ValueError, KeyError) as exc:  # safetensors' own errors are ValueErrors or OSErrors
            logger.warning("KV calibration %s is unreadable (%s): fitting it again", path, exc)
        path.unlink(missing_ok=True)  # the entries written under it are misses from now on
    calibration = KVCalibration.fit(*calibration_kv(lm, tokenizer, prefix_ids))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        calibration.save(tmp)
        try:
            os.link(tmp, path)  # whole or not at all, and never over another worker's: the first one kept wins
        except FileExistsError:
            calibration = KVCalibration.load(path)
        finally:
            tmp.unlink(missing_ok=True)
    return TransformCodec(calibration)


def store_options(
    config: StoreConfig, lm: LayerwiseModel, tokenizer: Any, template: PromptTemplate, fingerprint: str,
    dtype: torch.dtype,
) -> dict[str, Any]:  # fmt: skip
    """`store.build_store`'s arguments from `config`, with the codec fitted to this model where one is named."""
    options = config.build_options()
    fitted = None
    for name in ("kv_codec", "memory_codec"):
        if options[name] in CALIBRATED_CODECS:
            if fitted is None:
                prefix, _ = template.render_parts(tokenizer, "?")
                fitted = pca_codec(lm, tokenizer, tokenize_prefix(tokenizer, prefix), fingerprint, dtype,
                                   options["disk_dir"])  # fmt: skip
            options[name] = fitted
    return options
