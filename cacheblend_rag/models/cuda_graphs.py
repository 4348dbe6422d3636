"""Capturing a function of fixed shapes as a CUDA graph: warmed up on a side stream, then captured once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def capture_graph(
    run: Callable[[], T],
    *,
    device: torch.device | None = None,
    warmups: int = 1,
    pool: Any = None,
    error_mode: str = "global",
) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run `run` `warmups` times on a side stream (lazy initialisations, such as cuBLAS's, must stay out of the
    graph), then capture one more call. -> (the graph, what the captured call returned: tensors each replay
    writes again). `pool`: a memory pool shared with other graphs (`torch.cuda.graph_pool_handle`);
    `error_mode`: "thread_local" lets other threads keep working on the device while this one captures."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmups):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=error_mode):
        out = run()
    return graph, out
