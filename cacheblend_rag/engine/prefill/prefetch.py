"""The loading pipeline (paper §6): layer l+1's chunk KV is fetched while the fusor works on layer l.

A background thread calls the layer loader for layers 0, 1, 2, ... and keeps at most `depth` layers ready
ahead of the fusor; the fusor takes them with `get(layer_idx)` and waits only when a layer is not ready yet.
On a GPU the copies run on a side CUDA stream, and the fusor's stream waits on an event per layer, so copies
overlap with kernels as well. The timing this records is what separates load time from the wait it caused;
`LoadTiming` sums a request's loading, with the pipeline or without it, for its metrics.
"""

from __future__ import annotations

import threading
import time

import torch

from ...fusion import LayerLoader


class LayerPrefetcher:
    """Runs `load(0..num_layers-1)` on a thread, up to `depth` layers ahead of the consumer.

    `get(i)` must be called for i = 0, 1, ... in order (the fusor does). An error raised by `load` is raised
    again from `get` for that layer. Always `close()` (or use as a context manager): it stops the thread.
    Timings: `load_s` is the time spent inside `load`, `wait_s` the time `get` blocked for data.
    """

    def __init__(self, load: LayerLoader, num_layers: int, device: torch.device, *, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._load = load
        self._num_layers = num_layers
        self._depth = depth
        self._ready: dict[int, tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = {}
        self._error: tuple[int, BaseException] | None = None
        self._next_wanted = 0
        self._stop = False
        self._cond = threading.Condition()
        self.load_s = 0.0
        self.wait_s = 0.0
        self._cuda = device.type == "cuda"
        self._device = device
        self._stream = None
        if self._cuda:
            self._stream = torch.cuda.Stream(device=device)
            # Chunk KV already on the GPU was written by the consumer's stream: the side stream must see it.
            self._stream.wait_stream(torch.cuda.current_stream(device))
        self._thread = threading.Thread(target=self._run, name="cacheblend-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for layer_idx in range(self._num_layers):
            with self._cond:
                # Stay at most `depth` layers ahead: bounded memory, and no competing with the fusor for nothing.
                while not self._stop and layer_idx >= self._next_wanted + self._depth:
                    self._cond.wait()
                if self._stop:
                    return
            t = time.perf_counter()
            try:
                k, v, event = self._load_one(layer_idx)
            except BaseException as exc:  # handed to the consumer, which raises it in its own thread
                with self._cond:
                    self._error = (layer_idx, exc)
                    self._cond.notify_all()
                return
            finally:
                self.load_s += time.perf_counter() - t
            with self._cond:
                self._ready[layer_idx] = (k, v, event)
                self._cond.notify_all()

    def _load_one(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
        if not self._cuda:
            k, v = self._load(layer_idx)
            return k, v, None
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            k, v = self._load(layer_idx)
            k = k.to(self._device, non_blocking=True)
            v = v.to(self._device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return k, v, event

    def get(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> the layer's (keys, values), waiting for them if the thread is behind."""
        if layer_idx != self._next_wanted:
            raise RuntimeError(f"layers must be taken in order: expected layer {self._next_wanted}, got {layer_idx}")
        t = time.perf_counter()
        with self._cond:
            while layer_idx not in self._ready:
                if self._error is not None and self._error[0] <= layer_idx:
                    raise self._error[1]
                if not self._thread.is_alive() and layer_idx not in self._ready:
                    raise RuntimeError(f"the prefetch thread stopped before loading layer {layer_idx}")
                self._cond.wait(timeout=1.0)
            k, v, event = self._ready.pop(layer_idx)
            self._next_wanted += 1
            self._cond.notify_all()
        self.wait_s += time.perf_counter() - t
        if event is not None:
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(event)
            k.record_stream(stream)  # the side stream's allocator must not reuse this memory too early
            v.record_stream(stream)
        return k, v

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        self._ready.clear()

    def __enter__(self) -> LayerPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LoadTiming:
    """What reading a prompt's stored KV cost: `times()` -> (time spent loading, the part of it the fusor waited
    for: all of it without pipelining; with it, only what compute did not hide)."""

    def __init__(self) -> None:
        self.assembly_s = 0.0  # laying the parts into the buffers (all of them, when they are in memory)
        self.read_s = 0.0  # reading layers on the fusor's thread
        self.prefetcher: LayerPrefetcher | None = None

    def timed(self, load: LayerLoader) -> LayerLoader:
        def timed_load(layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
            t = time.perf_counter()
            try:
                return load(layer_idx)
            finally:
                self.read_s += time.perf_counter() - t

        return timed_load

    def times(self) -> tuple[float, float]:
        if self.prefetcher is not None:
            return self.assembly_s + self.prefetcher.load_s, self.assembly_s + self.prefetcher.wait_s
        return self.assembly_s + self.read_s, self.assembly_s + self.read_s
