"""A layer's solved matrices as checkpoint records, made on a worker thread while the next layer runs.

A record is :meth:`jgptq.bucket.Solved.record` taken under each checkpoint key the matrix's rows land in
(:func:`interop.models.checkpoint_names`): per-expert keys take one expert's rows, a fused key takes the stack.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from interop import models


def layer_records(names: dict, solved: list) -> dict:
    """Checkpoint key -> :class:`jgptq.export.QuantizedWeight` / :class:`jgptq.export.GGMLWeight` of a layer's
    solved matrices ``[(Matrix, parameter name, Solved)]`` (arrays brought to host memory here)."""
    weights: dict = {}
    for m, param, res in solved:
        whole = res.host().record(transposed=m.transposed)   # checked once; the keys take parts of it
        for key, expert, rows in names[param]:
            if m.layout is None or expert is not None:
                e = 0 if expert is None else expert
                weights[key] = whole.take(e, models.row_index(rows), method=res.method[e])
                continue
            if not np.array_equal(rows.numpy(), np.arange(m.count * m.rows)):
                raise models.UnsupportedModelError(f"{key}: checkpoint rows of a fused key are reordered")
            weights[key] = whole
    return weights


class Stores:
    """Turns each layer's results into checkpoint records on a worker thread (copies of codes and scales to host
    memory, their checks), while the next layer runs. :meth:`collect` adds the finished records to the run's
    weights in layer order; the seconds it waits go to the report's ``store`` stage."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jgptq-store")
        self._pending: list = []

    def submit(self, layer: int, names: dict, solved: list) -> None:
        self._pending.append((layer, self._pool.submit(layer_records, names, solved)))

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
