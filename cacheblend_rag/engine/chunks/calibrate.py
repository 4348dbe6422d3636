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
from typing import Any, NamedTuple

import torch

from ...config import StoreConfig
from ...models.adapter import LayerwiseModel
from ...models.rope import signed_sin
from ...store.codec import CALIBRATED_CODECS
from ...store.disk.folder import CALIBRATION_FOLDER
from ...store.transform_codec import KVCalibration, TransformCodec
from ..request.prompt import PromptTemplate, encode, tokenize_prefix

logger = logging.getLogger(__name__)


def calibration_paragraphs() -> list[str]:
    """The calibration text, in the paragraphs it is prefilled as."""
    text = files(__package__).joinpath("calibration_text.txt").read_text(encoding="utf-8")
    return [p.strip() for p in text.split("\n\n") if p.strip()]


class CalibrationSamples(NamedTuple):
    """What the calibration text gives: keys before RoPE and values [L, Hkv, N, D], and the mean square of the
    queries before RoPE per layer, query head and channel [L, H, D] (float32, CPU)."""

    keys: torch.Tensor
    values: torch.Tensor
    query_energy: torch.Tensor


@torch.inference_mode()
def calibration_samples(lm: LayerwiseModel, tokenizer: Any, prefix_ids: Sequence[int]) -> CalibrationSamples:
    """Every calibration paragraph prefilled after `prefix_ids`, layer by layer with the adapter's own steps (the
    fusor's full prefill, written out so that the queries can be read too); the prefix's tokens left out."""
    keys, values, energy, count = [], [], None, 0
    for paragraph in calibration_paragraphs():
        ids = torch.tensor([*prefix_ids, *encode(tokenizer, paragraph)], device=lm.device)
        p = len(prefix_ids)
        cos, sin = lm.rope(torch.arange(ids.shape[0], device=lm.device))
        cos, sin_signed = cos[:, None], signed_sin(sin, lm.shape.head_dim)[:, None]
        hidden = lm.embed(ids)
        layer_keys, layer_values, layer_energy = [], [], []
        for layer in range(lm.shape.num_layers):
            x = lm.normed_input(layer, hidden)
            raw_q, raw_k, v = lm.project_raw_qkv(layer, x)  # [H, T, D], [Hkv, T, D] x 2
            layer_keys.append(raw_k[:, p:].float().cpu())
            layer_values.append(v[:, p:].float().cpu())
            layer_energy.append(raw_q[:, p:].float().pow(2).sum(1).cpu())  # [H, D]
            q, k, v = lm.rotated_qkv(layer, x, cos, sin_signed)  # [T, H or Hkv, D]
            out = lm.attend(layer, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), None)
            hidden = lm.finish_layer(layer, hidden, out)
        keys.append(torch.stack(layer_keys))
        values.append(torch.stack(layer_values))
        energy = torch.stack(layer_energy) if energy is None else energy + torch.stack(layer_energy)
        count += ids.shape[0] - p
    assert energy is not None
    return CalibrationSamples(torch.cat(keys, dim=2), torch.cat(values, dim=2), energy / count)


def error_weights(lm: LayerwiseModel, query_energy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What an error in a stored key or value costs, per layer and KV head ([L, Hkv, D, D] each).

    A key error e moves the logit of every query q of its group by q . e after both are turned by RoPE, by angles
    that differ from token to token: on average each rotated pair of channels (c, c + D/2) weighs the same, the
    mean of the queries' square on the two. A value error e moves the attention output of each query head of the
    group by its output projection's columns W_g e: it costs e^T (sum_g W_g^T W_g) e."""
    s = lm.shape
    group, half = s.num_heads // s.num_kv_heads, s.head_dim // 2
    per_head = query_energy.view(s.num_layers, s.num_kv_heads, group, s.head_dim).sum(2).double()
    paired = (per_head[..., :half] + per_head[..., half:]) / 2
    key_w = torch.diag_embed(torch.cat([paired, paired], -1))
    value_w = torch.empty(s.num_layers, s.num_kv_heads, s.head_dim, s.head_dim, dtype=torch.float64)
    for layer in range(s.num_layers):
        w = lm.layers[layer].self_attn.o_proj.weight.detach().double().cpu()  # [hidden, H * D]
        cols = w.view(w.shape[0], s.num_kv_heads, group, s.head_dim)
        value_w[layer] = torch.einsum("ohgd,ohge->hde", cols, cols)
    return key_w, value_w


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
    samples = calibration_samples(lm, tokenizer, prefix_ids)
    calibration = KVCalibration.fit(samples.keys, samples.values, weights=error_weights(lm, samples.query_energy))
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
