"""Moves of decoder layers that run beside the pipeline, on worker threads.

Offloaded runs bring each layer to the device and take it back. Done in line, those copies stall the device (a
layer of a 30B MoE model is 1.25 GB each way). :class:`Moves` runs them on worker threads instead: the pipeline
asks for the next layer while it processes the current one, and hands a finished layer back without waiting.

- A move is a function called on a worker. On a CUDA device each worker has a stream of its own, and the move's
  copies run on it.
- ``after_current=True``: the move's stream first waits, on the device, for the work queued on the caller's
  current stream until the call (a recorded event). A layer the pipeline has just used is copied only once that
  work is done, never half-written.
- :meth:`Moves.wait` blocks until a move has finished (its copies included) and raises its error, if any. Memory a
  move allocates is complete when ``wait`` returns; the caller's stream may use it without further sync.

:class:`Evacuation` moves the layers that start on the device off it, from the last one back, while the pipeline
works from the first one on; a layer the pipeline claims stays.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Hashable

import torch


class Moves:
    """A queue of layer moves run by ``workers`` threads (in submission order with one worker).

    Args:
      device: the run device (CUDA devices get a stream per worker; others run moves as plain calls).
      workers: worker threads.
    """

    def __init__(self, device: torch.device, workers: int = 1):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._pool = ThreadPoolExecutor(max_workers=max(1, int(workers)), thread_name_prefix="jgptq-moves")
        self._local = threading.local()
        self._pending: dict = {}

    def _stream(self):
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.device)
        return stream

    def submit(self, key: Hashable, move: Callable[[], object], *, after_current: bool = False) -> None:
        """Queues ``move()`` under ``key`` (a key may have one move pending at a time)."""
        if key in self._pending:
            raise RuntimeError(f"a move for {key!r} is already pending")
        event = torch.cuda.current_stream(self.device).record_event() if self._cuda and after_current else None

        def run():
            if not self._cuda:
                return move()
            stream = self._stream()
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                if event is not None:
                    stream.wait_event(event)
                out = move()
            stream.synchronize()
            return out

        self._pending[key] = self._pool.submit(run)

    def keys(self) -> list:
        """The keys of the moves submitted and not yet waited for, in submission order."""
        return list(self._pending)

    def pending(self, key: Hashable) -> bool:
        """Whether a move for ``key`` was submitted and not yet waited for."""
        return key in self._pending

    def done(self, key: Hashable) -> bool:
        """Whether the move for ``key`` has ended (True when none is pending)."""
        fut: Future = self._pending.get(key)
        return fut is None or fut.done()

    def cancel(self, key: Hashable) -> bool:
        """Drops the move of ``key`` if it has not started; returns whether it was dropped (False: none is pending,
        or it runs or ran, and :meth:`wait` gives its end)."""
        fut: Future = self._pending.get(key)
        if fut is None or not fut.cancel():
            return False
        del self._pending[key]
        return True

    def wait(self, key: Hashable):
        """Waits for the move of ``key`` and returns its result (None when none is pending); raises its error."""
        fut = self._pending.pop(key, None)
        return None if fut is None else fut.result()

    def wait_each(self) -> tuple[dict, dict]:
        """Waits for every pending move, in submission order, raising nothing; returns ``(results, errors)``:
        key -> result of the moves that ended well, key -> exception of those that failed."""
        results, errors = {}, {}
        for key in list(self._pending):
            try:
                results[key] = self.wait(key)
            except BaseException as exc:  # noqa: BLE001 - every move must end before anything is raised
                errors[key] = exc
        return results, errors

    def wait_all(self) -> list:
        """Waits for every pending move; returns the keys of those that ended, raises the first error after all
        have ended."""
        results, errors = self.wait_each()
        if errors:
            raise next(iter(errors.values()))
        return list(results)

    def close(self) -> None:
        """Waits for every move (errors are dropped: call :meth:`wait_all` first to see them) and stops the
        workers."""
        self.wait_each()
        self._pool.shutdown(wait=True)


class Staging:
    """Copies between a CUDA device and pageable host memory through two pinned buffers of ``chunk`` bytes.

    A copy from pageable memory goes through the CUDA driver's own staging, which holds up other threads' calls
    into the driver while it runs. Here the host side is a plain memory copy into (or out of) a pinned buffer, and
    the device side an asynchronous copy from (or into) it on the caller's current stream; the two buffers let the
    two halves overlap. Use one instance per worker thread.
    """

    def __init__(self, device: torch.device, chunk: int = 64 << 20):
        self.device, self.chunk = torch.device(device), int(chunk)
        self._buffers = None
        self._ready = [None, None]   # event: the buffer's last device copy has ended

    def _bufs(self):
        if self._buffers is None:
            self._buffers = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        return self._buffers

    @staticmethod
    def _bytes(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of host tensor ``t`` on the device (complete once the current stream reaches this point)."""
        out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        src, dst = self._bytes(t.contiguous()), self._bytes(out)
        stream, bufs = torch.cuda.current_stream(self.device), self._bufs()
        for k, start in enumerate(range(0, src.numel(), self.chunk)):
            b, n = k % 2, min(self.chunk, src.numel() - start)
            if self._ready[b] is not None:
                self._ready[b].synchronize()
            bufs[b][:n].copy_(src[start:start + n])
            dst[start:start + n].copy_(bufs[b][:n], non_blocking=True)
            self._ready[b] = stream.record_event()
        return out

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of device tensor ``t`` in pageable host memory (complete on return)."""
        out = torch.empty(t.shape, dtype=t.dtype)
        src, dst = self._bytes(t.contiguous()), self._bytes(out)
        stream, bufs = torch.cuda.current_stream(self.device), self._bufs()
        last = None
        for k, start in enumerate(range(0, src.numel(), self.chunk)):
            b, n = k % 2, min(self.chunk, src.numel() - start)
            if self._ready[b] is not None:
                self._ready[b].synchronize()
            bufs[b][:n].copy_(src[start:start + n], non_blocking=True)
            event = self._ready[b] = stream.record_event()
            if last is not None:
                self._drain(*last)
            last = (b, start, n, event, dst)
        if last is not None:
            self._drain(*last)
        return out

    def _drain(self, b, start, n, event, dst):
        event.synchronize()
        dst[start:start + n].copy_(self._bufs()[b][:n])

    def move(self, module: torch.nn.Module, device: torch.device) -> None:
        """Moves every parameter and buffer of ``module`` to ``device`` (CUDA or CPU) through the buffers, in place
        of ``module.to(device)`` (parameters stay the same objects; tied tensors stay tied)."""
        device = torch.device(device)

        def fn(t):
            if t.device.type == device.type and (device.type == "cpu" or t.device == self.device):
                return t
            return self.to_host(t) if device.type == "cpu" else self.to_device(t)

        module._apply(fn)


class Evacuation:
    """Layers that start on the device leave it one by one on a worker, from the last one back, beside the work;
    the layers the pipeline claims (processed now or next) are left where they are.

    Args:
      device: the run device.
      layers: indices of the layers to evacuate.
      leave: ``leave(j)`` moves layer ``j`` off the device (called on the worker).
    """

    def __init__(self, device: torch.device, layers, leave: Callable[[int], None]):
        self._moves = Moves(device, 1)
        self._lock = threading.Lock()
        self._claimed = -1                  # layers up to this one stay
        self._leave = leave
        for j in sorted(layers, reverse=True):
            self._moves.submit(j, lambda j=j: self._evacuate(j), after_current=True)

    def _evacuate(self, j: int) -> bool:
        """Moves layer ``j`` off the device unless it was claimed; returns whether it moved."""
        with self._lock:
            if j <= self._claimed:
                return False
        self._leave(j)
        return True

    def claim(self, i: int, booked: set) -> None:
        """Stops the evacuation of layers up to ``i + 1``: a move not started is dropped (it would wait behind the
        layers queued before it), one under way is waited for, and if it moved its layer, the layer leaves
        ``booked`` (the layers on the device). Raises the error of a move waited for."""
        with self._lock:
            self._claimed = max(self._claimed, i + 1)
        for j in (i, i + 1):
            if self._moves.pending(j) and not self._moves.cancel(j) and self._moves.wait(j):
                booked.discard(j)

    def unbook(self, booked: set) -> None:
        """Removes from ``booked`` the layers whose evacuation has ended with a move; raises the error of an ended
        move (the layers queued before it are unbooked first)."""
        for j in [j for j in self._moves.keys() if self._moves.done(j)]:
            if self._moves.wait(j):
                booked.discard(j)

    def end(self) -> tuple[list, dict]:
        """Drops the evacuations not yet started, waits for the others and stops the worker; returns the layers
        that left and the errors by layer (raising nothing)."""
        with self._lock:
            self._claimed = float("inf")
        try:
            moved, errors = self._moves.wait_each()
        finally:
            self._moves.close()
        return [j for j, went in moved.items() if went], errors
