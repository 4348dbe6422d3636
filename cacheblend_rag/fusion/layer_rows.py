"""The row-wise halves of each layer of the fused prefill: run eagerly, or padded and replayed as CUDA graphs.

A layer of the fused prefill works on the A tokens it recomputes (its rows) in three steps:
1. per row: the input norm, the q/k/v product and RoPE (`LayerRows.qkv`);
2. the rows meet the prompt: their K/V written into the prompt's KV, their queries attending over all its keys,
   the output projection (the fusor's own work, shapes set by the prompt);
3. per row: the residual, the post-attention norm, the MLP and its residual (`LayerRows.finish`).

Steps 1 and 3 are a dozen or more kernels each. With few rows (the question of a full-reuse pass, the last layer's
one token) each kernel takes less time on a GPU than its launch takes on the host, so the GPU waits on Python.
`GraphedLayerSteps` pads the rows to a size bucket (`bucket_rows`) and replays steps 1 and 3 of each layer as one CUDA
graph each, all captured when a bucket is first used; a layer then issues a handful of launches instead of dozens.
Rows are independent in these steps, so the padding rows never touch a real row's numbers; they are never written
into the prompt's KV and never attend. `EagerLayerSteps` runs the same steps as they are (the reference, and the CPU's
path); `GraphedLayerSteps(capture=False)` runs the padded steps eagerly, which is how they are tested on a CPU.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Protocol

import torch

from ..models.adapter import LayerwiseModel
from ..models.cuda_graphs import capture_graph


class LayerRows(Protocol):
    """The rows a fused prefill recomputes, from one `LayerSteps.rows` call until the set changes."""

    @property
    def hidden(self) -> torch.Tensor:
        """[A, hidden]: the rows' hidden states after the last `finish` (before the first: as given)."""
        ...

    def qkv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step 1 of a layer: rotated queries [A, H, D], rotated keys and values [A, Hkv, D]; valid until the next
        call on this set or on another set of its size bucket."""
        ...

    def finish(self, layer_idx: int, attn_out: torch.Tensor) -> None:
        """Step 3 of a layer, given the attention's output after its projection [A, hidden]: updates `hidden`."""
        ...


class LayerSteps(Protocol):
    """Makes the `LayerRows` of a set of rows: `rows(hidden [A, hidden], cos, sin_signed [A, 1, D] or None when
    only `finish` is asked for)`. A set made earlier may be overwritten by a newer one."""

    def rows(self, hidden: torch.Tensor, cos: torch.Tensor | None, sin_signed: torch.Tensor | None) -> LayerRows: ...


class _EagerRows:
    def __init__(self, lm: LayerwiseModel, hidden: torch.Tensor, cos: torch.Tensor | None,
                 sin_signed: torch.Tensor | None) -> None:  # fmt: skip
        self.lm, self._hidden, self.cos, self.sin = lm, hidden, cos, sin_signed

    @property
    def hidden(self) -> torch.Tensor:
        return self._hidden

    def qkv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.cos is None or self.sin is None:
            raise ValueError("these rows were made for `finish` only: pass cos and sin to `rows` for `qkv`")
        return self.lm.rotated_qkv(layer_idx, self.lm.normed_input(layer_idx, self._hidden), self.cos, self.sin)

    def finish(self, layer_idx: int, attn_out: torch.Tensor) -> None:
        self._hidden = self.lm.finish_layer(layer_idx, self._hidden, attn_out)


class EagerLayerSteps:
    """Each step run as it is: the reference, and what the fusor runs unless given other steps."""

    def __init__(self, lm: LayerwiseModel) -> None:
        self.lm = lm

    def rows(self, hidden: torch.Tensor, cos: torch.Tensor | None, sin_signed: torch.Tensor | None) -> LayerRows:
        return _EagerRows(self.lm, hidden, cos, sin_signed)


def bucket_rows(rows: int) -> int:
    """The padded size of `rows` rows: the next power of two up to 16, then the next multiple of an eighth of the
    power of two below (17 -> 18, 33 -> 36, 1,150 -> 1,152, 1,160 -> 1,280): at most 12.5% padding, eight sizes per
    doubling."""
    if rows < 1:
        raise ValueError(f"a bucket holds at least one row, got {rows}")
    if rows <= 16:
        return 1 << (rows - 1).bit_length()
    step = 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


class _Bucket:
    """The static buffers of one row count and, when captured, each layer's two graphs over them."""

    def __init__(self, lm: LayerwiseModel, size: int, pool: object | None) -> None:
        s, device, dtype = lm.shape, lm.device, lm.dtype
        self.lm = lm
        self.h = torch.zeros(size, s.hidden_size, dtype=dtype, device=device)
        self.attn = torch.zeros_like(self.h)
        self.cos = torch.zeros(size, 1, s.head_dim, dtype=dtype, device=device)
        self.sin = torch.zeros_like(self.cos)
        self.q = torch.zeros(size, s.num_heads, s.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(size, s.num_kv_heads, s.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.graphs: list[tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]] | None = None
        if pool is not None:
            self.graphs = [self._capture(i, pool) for i in range(s.num_layers)]

    def run_qkv(self, layer_idx: int) -> None:
        q, k, v = self.lm.rotated_qkv(layer_idx, self.lm.normed_input(layer_idx, self.h), self.cos, self.sin)
        self.q.copy_(q)
        self.k.copy_(k)
        self.v.copy_(v)

    def run_finish(self, layer_idx: int) -> None:
        self.h.copy_(self.lm.finish_layer(layer_idx, self.h, self.attn))

    def _capture(self, layer_idx: int, pool: object) -> tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]:
        """Both halves of a layer, each warmed up over the bucket's current contents (zeros: nothing is loaded yet)
        and captured. Another thread's work (the layer prefetcher's copies) goes on meanwhile: the capture checks
        only this thread's calls."""
        qkv, _ = capture_graph(lambda: self.run_qkv(layer_idx), device=self.h.device, pool=pool,
                               error_mode="thread_local")  # fmt: skip
        finish, _ = capture_graph(lambda: self.run_finish(layer_idx), device=self.h.device, pool=pool,
                                  error_mode="thread_local")  # fmt: skip
        return qkv, finish


class _PaddedRows:
    def __init__(self, bucket: _Bucket, count: int, rotary: bool) -> None:
        self.bucket, self.count, self.rotary = bucket, count, rotary

    @property
    def hidden(self) -> torch.Tensor:
        return self.bucket.h[: self.count]

    @torch.inference_mode()  # the buffers are inference tensors
    def qkv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, a = self.bucket, self.count
        if not self.rotary:
            raise ValueError("these rows were made for `finish` only: pass cos and sin to `rows` for `qkv`")
        if b.graphs is None:
            b.run_qkv(layer_idx)
        else:
            b.graphs[layer_idx][0].replay()
        return b.q[:a], b.k[:a], b.v[:a]

    @torch.inference_mode()
    def finish(self, layer_idx: int, attn_out: torch.Tensor) -> None:
        b = self.bucket
        b.attn[: self.count].copy_(attn_out)
        if b.graphs is None:
            b.run_finish(layer_idx)
        else:
            b.graphs[layer_idx][1].replay()


class GraphedLayerSteps:
    """Steps 1 and 3 of every layer over rows padded to a bucket (`bucket_rows`), replayed as CUDA graphs.

    A bucket's graphs (two per layer) are captured when it is first used and kept for the `max_buckets` buckets
    used last; a set of more than `max_rows` rows runs eagerly (its kernels are long enough to hide their launches,
    and its padding would cost real work). Graphs and buffers are per thread: two threads' prefills never share
    them. `capture=False` runs the padded steps eagerly (on a CPU: how they are tested against `EagerLayerSteps`).
    """

    def __init__(self, lm: LayerwiseModel, *, capture: bool = True, max_rows: int = 2048,
                 max_buckets: int = 8) -> None:  # fmt: skip
        if capture and lm.device.type != "cuda":
            raise ValueError("CUDA graphs need a model on a CUDA device (capture=False runs the padded steps eagerly)")
        if max_rows < 1 or max_buckets < 1:
            raise ValueError(f"max_rows and max_buckets must be at least 1, got {max_rows} and {max_buckets}")
        self.lm, self.capture, self.max_rows, self.max_buckets = lm, capture, max_rows, max_buckets
        self._eager = EagerLayerSteps(lm)
        self._local = threading.local()

    def _buckets(self) -> OrderedDict[int, _Bucket]:
        found = getattr(self._local, "buckets", None)  # this thread's buckets
        if found is None:
            found = self._local.buckets = OrderedDict()
            self._local.pool = torch.cuda.graph_pool_handle() if self.capture else None
        return found

    def bucket(self, size: int) -> _Bucket:
        """The bucket of `size` rows of this thread, made (and captured) when first asked for."""
        buckets = self._buckets()
        found = buckets.get(size)
        if found is None:
            with torch.inference_mode():  # the buffers are read and written only under inference mode
                found = buckets[size] = _Bucket(self.lm, size, self._local.pool)
            while len(buckets) > self.max_buckets:
                buckets.popitem(last=False)
        buckets.move_to_end(size)
        return found

    @property
    def bucket_sizes(self) -> list[int]:
        """This thread's buckets, the least recently used first."""
        return list(self._buckets())

    @torch.inference_mode()
    def rows(self, hidden: torch.Tensor, cos: torch.Tensor | None, sin_signed: torch.Tensor | None) -> LayerRows:
        a = hidden.shape[0]
        if a > self.max_rows:
            return self._eager.rows(hidden, cos, sin_signed)
        b = self.bucket(bucket_rows(a))
        if hidden.data_ptr() != b.h.data_ptr():  # not already this bucket's rows (a set continuing as it is)
            b.h[:a].copy_(hidden)
            b.h[a:].zero_()
        b.attn[a:].zero_()
        rotary = cos is not None and sin_signed is not None
        if rotary:
            b.cos[:a].copy_(cos)
            b.sin[:a].copy_(sin_signed)
        return _PaddedRows(b, a, rotary)
