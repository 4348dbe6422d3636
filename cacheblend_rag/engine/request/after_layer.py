"""Decode steps between a prefill's layers, so that answers already streaming do not stop while a prompt is computed.

A prefill runs layer after layer, and on a CPU one prefill can take seconds (a 3,000-token blend on two cores: about
5 s; a full prefill: 30 s). Served whole, it stops every request that is decoding for that long. The scheduler
instead hands the prefill an `AfterLayer` callback: when a pass over the prompt has finished a layer, the callback
may run one batched decode step for the requests already answering, then the prefill goes on with the next layer.
The prompt's tensors are not touched in between, so the prefill computes what it computes alone; the decode step
reads only its own requests' caches, so their tokens are those of steps run anywhere else.

The blend's fusor calls the callback itself (`fusion.fuse(after_layer=...)`). A full prefill runs the model's own
forward, which has no such place: `between_layers` registers forward hooks on the decoder layers for the length of
that forward, and they call back only on the thread that registered them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

AfterLayer = Callable[[int], None]  # runs with a layer's index when a pass over the prompt has finished that layer


@contextmanager
def between_layers(layers: Sequence[nn.Module], after_layer: AfterLayer | None) -> Iterator[None]:
    """Inside the block, `after_layer(layer_idx)` runs after each decoder layer but the last of every model forward
    this thread runs (forward hooks, removed on leaving; forwards on other threads do not call it)."""
    if after_layer is None:
        yield
        return
    owner = threading.get_ident()

    def hook(layer_idx: int) -> Callable[..., None]:
        def done(module: nn.Module, args: Any, output: Any) -> None:
            if threading.get_ident() == owner:
                after_layer(layer_idx)

        return done

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers[:-1])]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
