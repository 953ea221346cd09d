"""A layer's solved matrices as checkpoint records, made on a worker thread while the next layer runs.

A record is :meth:`jgptq.bucket.Solved.record` taken under each checkpoint key the matrix's rows land in
(:func:`jgptq_torch.checkpoint_keys.checkpoint_names`): per-expert keys take one expert's rows, a fused key takes the stack.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from jgptq_torch import checkpoint_keys, models
from jgptq_torch.dlpack import to_torch
from jgptq_torch.pipeline.moves import Staging


class _HostCopies:
    """Brings a result's arrays to host memory without holding up the thread that runs the model.

    ``np.asarray`` of a GPU array copies into fresh host memory while holding the GIL: for a layer of a 30B MoE
    model (600 MB of codes) the model's thread then stalled for 0.2 s. A single-device CUDA array here goes
    through torch instead (DLPack, no copy), on a stream of its own, through pinned buffers
    (:class:`jgptq_torch.pipeline.moves.Staging`); torch's copies release the GIL and never touch pageable memory from the
    device. Other arrays (CPU, sharded) take ``np.asarray``."""

    def __init__(self, chunk: int = 64 << 20):
        self._staging, self._chunk = {}, chunk

    def __call__(self, a) -> np.ndarray:
        if a is None or isinstance(a, np.ndarray):
            return a
        devices = a.devices()
        device = next(iter(devices))
        if len(devices) != 1 or device.platform != "gpu" or not torch.cuda.is_available():
            return np.asarray(a)
        t = to_torch(a)
        if t.dtype == torch.bfloat16:                  # no numpy dtype on torch's side
            return np.asarray(a)
        if t.device not in self._staging:
            self._staging[t.device] = (Staging(t.device, self._chunk), torch.cuda.Stream(t.device))
        staging, stream = self._staging[t.device]
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            return staging.to_host(t).numpy()


def layer_records(names: dict, solved: list, copies=None) -> dict:
    """Checkpoint key -> :class:`jgptq.export.QuantizedWeight` / :class:`jgptq.export.GGMLWeight` of a layer's
    solved matrices ``[(Matrix, parameter name, Solved)]`` (arrays brought to host memory here, by ``copies``: a
    :class:`_HostCopies`, the converter of :meth:`jgptq.bucket.Solved.host`)."""
    copies = copies or _HostCopies()
    weights: dict = {}
    for m, param, res in solved:
        whole = res.host(copies).record(transposed=m.transposed)   # checked once; the keys take parts of it
        for key, expert, rows in names[param]:
            if m.layout is None or expert is not None:
                e = 0 if expert is None else expert
                weights[key] = whole.take(e, checkpoint_keys.row_index(rows), method=res.method[e])
                continue
            weights[key] = whole.take(rows=_expert_row_order(key, rows.numpy(), m.count, m.rows))
    return weights


def _expert_row_order(key: str, rows: np.ndarray, experts: int, per_expert: int):
    """The one order of each expert's rows under which fused checkpoint ``key`` holds the stack's ``rows`` (None:
    the stack's own order), e.g. gate and up rows interleaved in the checkpoint, concatenated in the model.

    Raises:
      UnsupportedModelError: the key does not hold every expert, in order, each with its rows in one shared order.
    """
    if np.array_equal(rows, np.arange(experts * per_expert)):
        return None
    local = rows.reshape(experts, per_expert) - (np.arange(experts) * per_expert)[:, None] \
        if rows.size == experts * per_expert else None
    if local is None or not (local == local[0]).all() or not np.array_equal(np.sort(local[0]), np.arange(per_expert)):
        raise models.UnsupportedModelError(f"{key}: checkpoint rows of a fused key are reordered across experts")
    return local[0]


class Stores:
    """Turns each layer's results into checkpoint records on a worker thread (copies of codes and scales to host
    memory, their checks), while the next layer runs. :meth:`collect` adds the finished records to the run's
    weights in layer order; the seconds it waits go to the report's ``store`` stage."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jgptq-store")
        self._copies = _HostCopies()     # used by the one worker thread only
        self._pending: list = []
        self.sink = None                 # an object whose add(records) takes each layer's records (a GGUF file)
        self.keep_records = True         # False: records handed to the sink are not kept for the run's weights

    def submit(self, layer: int, names: dict, solved: list) -> None:
        self._pending.append((layer, self._pool.submit(self._records, names, solved)))

    def _records(self, names: dict, solved: list) -> dict:
        records = layer_records(names, solved, self._copies)
        if self.sink is not None:
            self.sink.add(records)
        return records if self.keep_records else {}

    def collect(self, weights: dict, report) -> None:
        for layer, job in self._pending:
            t0 = time.perf_counter()
            done = job.result()
            report.add_time(layer, "store", time.perf_counter() - t0)
            weights.update(done)
        self._pending.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
