"""What watches a prefill's layers, as one object: `LayerEvents`, registered with once and handed to the prefill.

A prefill runs layer after layer, and on a CPU one prefill can take seconds (a 3,000-token blend on two cores: about
5 s; a full prefill: 30 s). Whatever must happen while it runs registers a watcher, called with a layer's index
when a pass over the prompt has finished that layer (never after the last one):
- a request's cancellation check (its reader left: the prefill stops there, `serving.jobs.Job`);
- the scheduler's decode steps for the requests already answering (`EngineConfig(serving=ServingConfig(
  max_token_gap_s=...))`), so a long prefill does not stop their answers;
- a study's own probe (anything with the signature `watcher(layer_idx)`).
The prompt's tensors are not touched in between, so the prefill computes what it computes alone.

The fusor (`fusion.fuse`) tells the events itself. A full prefill runs the model's own forward, which has no such
place: `hooked` registers forward hooks on the decoder layers for the length of that forward, and they tell the
events only on the thread that registered them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

Watcher = Callable[[int], None]  # runs with a layer's index when a pass over the prompt has finished that layer


class LayerEvents:
    """The watchers of one prefill's layers (or of a stored chunk's prefill), in the order they registered, and the
    seconds spent in them (`spent_s`: work done for others between the layers, not by the prefill)."""

    def __init__(self, *watchers: Watcher) -> None:
        self._watchers = list(watchers)
        self.spent_s = 0.0

    def watch(self, watcher: Watcher) -> None:
        """Call `watcher(layer_idx)` after every layer but the last of each pass over the prompt."""
        self._watchers.append(watcher)

    def layer_done(self, layer_idx: int) -> None:
        """A pass over the prompt finished layer `layer_idx`: tell every watcher (an exception stops the prefill)."""
        t = time.perf_counter()
        try:
            for watcher in self._watchers:
                watcher(layer_idx)
        finally:
            self.spent_s += time.perf_counter() - t

    @contextmanager
    def hooked(self, layers: Sequence[nn.Module]) -> Iterator[None]:
        """Inside the block, `layer_done(layer_idx)` runs after each decoder layer but the last of every model forward
        this thread runs (forward hooks, removed on leaving; forwards on other threads do not tell it)."""
        if not self._watchers:
            yield
            return
        owner = threading.get_ident()

        def hook(layer_idx: int) -> Callable[..., None]:
            def done(module: nn.Module, args: Any, output: Any) -> None:
                if threading.get_ident() == owner:
                    self.layer_done(layer_idx)

            return done

        handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers[:-1])]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
