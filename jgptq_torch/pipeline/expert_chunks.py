"""A layer's routed experts a chunk at a time: MoE layers larger than the device's working room.

When a layer's whole need is over the device budget (or, without one, an accelerator's free memory:
:func:`device_room`), the budget (:meth:`jgptq_torch.pipeline.budget.Budget.assess`) cuts its routed experts into
balanced chunks of consecutive experts (``Placement.chunks``), so that only one chunk's Hessians, solve and results
are on the device at a time. The layer step (:func:`jgptq_torch.pipeline.layerwise._layer_step`) then makes one
pass per chunk ``lo..hi-1`` (:class:`Passes`; a layer that fits makes one pass of every target):

1. calibrate: the one calibrate loop (:func:`jgptq_torch.pipeline.calibrate.calibrate`) with the chunk's span, a
   collector that keeps the statistics of that chunk's experts only; the first pass also collects the layer's
   linear targets (attention, shared expert: :func:`pass_target`) and serves the hooks that see a layer once
   (:attr:`jgptq_torch.pipeline.step.LayerStep.first`: the float stream);
2. solve the chunk's experts (the linear targets with the first chunk), one call per bucket as for a whole layer;
3. :meth:`Passes.add`: the chunk's dequantized experts are written back into the parameters at once, its results
   brought to host memory, its Hessians and device results freed; next chunk.

The linear targets are written back with the layer, after the last chunk: every pass sees the float attention, so
each expert's inputs are those of the float layer. An expert's inputs never depend on another expert's weights
(one experts module a layer: the budget chunks no other), so the experts written back early change nothing that a
later chunk sees. At the end (:meth:`Passes.joined`) each experts stack's parts are joined
(:meth:`jgptq.bucket.Solved.concat`) and the layer goes on as a whole one does: records, report and replay are the
same.

Same bytes as the whole layer. A chunk's collector groups its own experts only, and each expert's statistics are
the bytes a collector of every expert makes: a slot's Hessian product and its sums of squares (a fixed pairwise
tree, :func:`jgptq.hessian.slot_squares`) do not depend on the size of its group. The solver's result for a
matrix does not depend on the other matrices of its bucket (:mod:`jgptq.parallel`: by construction on the CPU,
measured on GPUs for batched widths; a one-expert chunk runs the unbatched program, whose kernels on a GPU differ
from the batched ones). On GPUs, where batched products of other group sizes may pick other kernels, the same
bytes are not shown yet.

Cost: one more forward of the layer per chunk after the first. The Hessian products stay about those of the whole
layer: with DeepSeek-V3's 256 experts, top-8, and 2,048 to 16,384 tokens a forward (routed counts uniform or
Zipf-skewed), 3 chunks pad their groups (powers of two) to 0.6 to 1.4 times the slot rows of the whole layer, 6
chunks to 0.8 to 1.9 times.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time

import numpy as np
import torch

from jgptq.bucket import Solved, Stack
from jgptq.imatrix import ImatrixEntry
from jgptq_torch.dlpack import to_torch
from jgptq_torch.pipeline.budget import chunk_note
from jgptq_torch.pipeline.importance import expert_rows
from jgptq_torch.pipeline.stores import _HostCopies

log = logging.getLogger(__name__)
ROOM_SHARE = 0.9   # without a budget, chunks are planned against this share of an accelerator's free memory


def device_room(device: torch.device, on_device: int):
    """Without a budget: the bytes chunks of routed experts are planned against on ``device``, a CUDA device's
    free memory plus the ``on_device`` bytes of the model already there, less a tenth for what the estimate does
    not see; None elsewhere (no chunks on the CPU unless a budget asks)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(ROOM_SHARE * (free + on_device))


def say_plan(placement, progress: bool) -> None:
    """Logs the run's chunk plan once (``report.memory["expert_chunks"]`` keeps it), and says it on stderr with
    ``progress``."""
    note = chunk_note(placement.memory.get("expert_chunks", []), str(placement.device))
    if note:
        log.info(note)
        if progress:
            print(f"jgptq: {note}", file=sys.stderr, flush=True)


def spans(sizes) -> list:
    """[(lo, hi)] of consecutive chunks of the given sizes: ``spans((3, 3, 2)) == [(0, 3), (3, 6), (6, 8)]``."""
    out, lo = [], 0
    for n in sizes:
        out.append((lo, lo + n))
        lo += n
    return out


def pass_target(target, span):
    """The targets that the pass of routed experts ``span`` collects and solves: all of the layer's ``target``
    (a :class:`jgptq_torch.models.LayerTargets`) on its first pass (``span`` None or from expert 0), its experts
    alone on a later chunk's (the linear targets are solved with the first)."""
    if span is None or span[0] == 0:
        return target
    return dataclasses.replace(target, linears={})


class Passes:
    """The calibrate-and-solve passes of layer ``i``'s step: iterating gives (span, targets) of each pass (one
    chunk of routed experts each, or ``(None, every target)`` once when the layer goes whole); :meth:`add` takes
    each pass's results and :meth:`joined` gives the whole layer's."""

    def __init__(self, run, i: int):
        sizes = run.placement.chunks.get(i)
        self.index, self.target, self.base = i, run.targets[i], f"{run.prefix}.{i}"
        self.spans = spans(sizes) if sizes else [None]
        self.solved: list = []     # (Matrix, parameter name, Stack, Solved) of the linear targets (or all, whole)
        self.order: dict = {}      # parameter name -> its place in the first pass's results (bucket order)
        self.entries: dict = {}    # parameter name -> the importance statistic of this layer's inputs
        self.parts: dict = {}      # experts parameter name -> [(Matrix, Stack, host Solved, entry)] per chunk
        self._copies = _HostCopies()

    def __iter__(self):
        return iter([(span, pass_target(self.target, span)) for span in self.spans])

    def add(self, run, span, solved: list, entries: dict) -> None:
        """One pass's ``solved`` (:func:`jgptq_torch.pipeline.solve.solve_layer`) and the importance ``entries``
        of its collector. A chunk's experts are written back into the parameters now and their results taken to
        host memory (without their weight); linear targets, and a whole layer's results, are kept as they are."""
        if span is None:
            self.solved, self.entries = solved, entries
            return
        if span[0] == 0:   # the first pass solves every target: its bucket order is the whole layer's
            self.order = {param: k for k, (_, param, _, _) in enumerate(solved)}
        t0 = time.perf_counter()
        with torch.no_grad():
            for m, param, stack, res in solved:
                if m.layout is None:             # written back with the layer, after the last chunk
                    self.solved.append((m, param, stack, res))
                    self.entries[param] = entries[param]
                    continue
                lo, hi = expert_rows(m, span)
                _copy_into(m.weight()[lo:hi], res, m.name)
                # the stack without its arrays: its weight view, Hessian and statistics would hold each chunk's
                # device memory until the layer ends
                light = Stack(stack.name, None, None, stack.tokens, stack.hessian_key)
                self.parts.setdefault(param, []).append((m, light, res.host(self._copies), entries[param]))
        run.report.add_time(self.index, "write", time.perf_counter() - t0)

    def joined(self, run, imatrix=None) -> list:
        """The layer's [(Matrix, parameter name, Stack, Solved)] in the order one pass of the whole layer gives
        them: experts stacks' parts joined (in host memory, without a weight: written back already). Records the
        layer's importance statistic in ``run.result.imatrix``: ``imatrix`` (parameter name -> entry, when a hook
        collected it elsewhere) or the passes' own."""
        for param, parts in self.parts.items():
            ms, stacks, results, entries = zip(*parts)
            stack = Stack(stacks[0].name, None, None, [t for s in stacks for t in s.tokens], stacks[0].hessian_key)
            self.solved.append((ms[0], param, stack, Solved.concat(results)))
            self.entries[param] = ImatrixEntry(np.concatenate([e.sums for e in entries]),
                                               np.concatenate([e.counts for e in entries]))
        self.parts = {}
        entries = self.entries if imatrix is None else imatrix
        run.result.imatrix.update({p: entries[p] for p in (m.param_name(self.base) for m in self.target.matrices())})
        if not self.order:   # one pass: its own order
            return self.solved
        return sorted(self.solved, key=lambda item: self.order[item[1]])

    def write_back(self, run, solved: list) -> None:
        """The layer's ``solved`` (:meth:`joined`) into the torch parameters in place, those not written yet (a
        result without a weight was, a chunk at a time: :meth:`add`), dequantized; then to the run's stores
        without their weights (the records are made beside the next layer)."""
        t0 = time.perf_counter()
        with torch.no_grad():
            for m, _, _, res in solved:
                if res.weight is not None:
                    _copy_into(m.weight(), res, m.name)
        run.stores.submit(self.index, run.names, [(m, param, dataclasses.replace(res, weight=None))
                                                  for m, param, _, res in solved])
        run.report.add_time(self.index, "write", time.perf_counter() - t0)


def _copy_into(dst: torch.Tensor, res, name: str) -> None:
    """A solved result's dequantized weight into its parameter (or a chunk's rows of it), in place."""
    dst.copy_(to_torch(res.weight, name=name).to(device=dst.device, dtype=dst.dtype))
