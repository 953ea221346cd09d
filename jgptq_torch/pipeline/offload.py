"""Where decoder layers live during a layerwise run and what one layer needs on the device: the moves.

Modes (``PipelineConfig.offload``):

- ``"none"``: layers stay where they are; a layer that is not on the run device visits it while it is processed
  and goes back. Layers that start on the device stay there for the whole run.
- ``"cpu"``: before the run, layers on the device are moved to host memory; each layer is moved to the device,
  processed and moved back. The returned model's layers are in host memory.
- ``"disk"``: before the run, every layer is written to ``offload-layer-<i>.safetensors`` in ``offload_dir`` and
  released (its parameters and buffers become meta tensors: no storage); each layer is read from its file onto the
  device when processed, its quantized tensors written back to the file, and released again. Host memory then
  holds one layer plus the tensors outside the layers (embeddings, final norm, head), which stay where they are.
  At the end the layers are read back into host memory, unless ``reload=False``: the returned model's layers then
  stay on meta and ``load_layer(model, i, offload_dir)`` / ``reload_all(model, offload_dir)`` load them.

On a CUDA device the moves of ``"cpu"`` and ``"disk"`` run beside the work (:mod:`jgptq_torch.pipeline.moves`): while layer
``i`` is processed, layer ``i + 1`` is brought to the device and layer ``i - 1`` taken back, each on a worker
thread and stream of its own (three layers may then be on the device at once; the budget check counts them).
Before the run, the layers are moved to host memory or written to their files by several threads at once; with
``"cpu"``, moves ahead and no ``device_budget``, layers that start on the device leave it instead from the last one
back while the run works (the device is as full at the start as it was given).

Layer files and what a layer holds: :mod:`jgptq_torch.pipeline.layer_files` (``load_layer`` and ``reload_all`` are here too).

Device budget (``PipelineConfig.device_budget``): before any work, each layer's need on the device is estimated
(:func:`layer_need`: its parameters, the calibration activations of a layer's input and output, the Hessian
statistics of its targets, the solver's results and working set) and added to what stays on the device (tensors
outside the layers; with ``"none"``, the layers that start there). The arithmetic and the decisions on it are
:mod:`jgptq_torch.pipeline.budget` (plain numbers); :class:`Placement` measures the model and does the moves. Over the budget,
the run stops with :class:`DeviceBudgetError` before anything is written; a MoE layer over it has its routed
experts go in chunks (:mod:`jgptq_torch.pipeline.expert_chunks`), planned against the free memory of an
accelerator when no budget is given. During the run the pipeline books every
layer it places on the device; the peak, the measured activation and Hessian bytes, the peak of parameter bytes in
host memory and (on CUDA) ``torch.cuda.max_memory_allocated`` go to ``report.memory``. Transient tensors of the
forward (attention scores, expert intermediates) are not estimated: leave headroom.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time

import torch
from torch import nn

from jgptq_torch.dlpack import jax_device_for
from jgptq_torch.pipeline.budget import (  # noqa: F401 - DeviceBudgetError: public here too
    Budget, DeviceBudgetError, LayerNeed, LayerWork, chunk_summary, estimate_need)
from jgptq_torch.pipeline.expert_chunks import device_room
from jgptq_torch.pipeline.layer_files import (  # noqa: F401 - layer_file, load_layer, reload_all: public here too
    LayerFolder, check_not_shared, host_bytes, is_released, layer_file, load_layer, nbytes, read_layer, release_layer,
    reload_all, unique_tensors, write_layer)
from jgptq_torch.pipeline.moves import Evacuation, Moves, Staging

PREPARE_WORKERS = 8  # threads that move (or write) the layers to their places before the run
# moves between a CUDA device and host memory go through pinned buffers (see jgptq_torch.pipeline.moves.Staging); the
# environment variable JGPTQ_STAGED_MOVES=0 turns them back to plain ``module.to`` copies
STAGED_MOVES = os.environ.get("JGPTQ_STAGED_MOVES", "1") != "0"


def layer_need(layer, target, activations: int, all_experts: bool) -> LayerWork:
    """The :class:`jgptq_torch.pipeline.budget.LayerWork` of ``layer`` with targets ``target``
    (:func:`jgptq_torch.models.layer_targets`) and ``activations`` bytes of calibration activations: the layer's
    bytes and its targets' shapes; its routed experts may go in chunks when it has one experts module."""
    shapes = tuple((m.count, m.rows, m.cols, m.kind) for m in target.matrices())
    return LayerWork(nbytes(unique_tensors(layer).values()), activations, shapes, all_experts,
                     chunkable=len(target.experts) == 1)


def hidden_bytes(model, batch_list) -> int:
    """Bytes of one layer's input activations over every calibration batch, from the batch shapes, the model's
    hidden size and dtype (the inputs and the outputs of a layer coexist: twice this is on the device)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    width = getattr(getattr(model, "config", None), "hidden_size", None)
    if width is None and emb is not None:
        width = emb.weight.shape[-1]
    dtype = getattr(model, "dtype", None) or (emb.weight.dtype if emb is not None else torch.float32)
    size = torch.empty((), dtype=dtype).element_size()
    return sum(b.input_ids.numel() for b in batch_list) * int(width or 0) * size


def captured_bytes(hidden, layer_inputs, device) -> int:
    """Device bytes of the captured activations: the first layer's inputs (twice: a layer's outputs coexist with
    its inputs) and every distinct tensor among the layers' captured arguments."""
    seen: dict = {}

    def walk(obj):
        if isinstance(obj, torch.Tensor):
            if _same_device(obj.device, device):
                seen[id(obj)] = obj
        elif isinstance(obj, (tuple, list, dict)):
            for o in obj.values() if isinstance(obj, dict) else obj:
                walk(o)

    walk(layer_inputs)
    return 2 * nbytes(hidden) + nbytes(seen.values())


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index == b.index or a.type == "cpu")


def run_device(device, first_layer) -> torch.device:
    """The torch device layers run on: ``device``, or the first layer's; a CUDA device gets its index."""
    if device is None:
        tensors = list(unique_tensors(first_layer).values())
        dev = tensors[0].device if tensors else torch.device("cpu")
    else:
        dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def moves_ahead_on(device: torch.device) -> bool:
    """Whether offloaded layer moves run beside the work by default on ``device``: on CUDA devices, where the copies
    and the device's work overlap (on the CPU both take the same cores)."""
    return device.type == "cuda"


# -- the pipeline's placement of layers -----------------------------------------------------------------------
class Placement:
    """Moves the decoder layers of a run between their places per the offload mode, and books the bytes of
    parameters it places on the device (see the module docstring). The numbers and the decisions on them are its
    :class:`jgptq_torch.pipeline.budget.Budget` (``budget``); this class measures the model and does the moves.

    Args:
      model: the transformers model; layers: its decoder layers (``ModuleList``).
      cfg: the :class:`jgptq.config.PipelineConfig` (``offload``, ``offload_dir``, ``device_budget``, ``reload``,
        ``keep_offload_files``).
      device: the run device (:func:`run_device`).
      ahead: whether layer moves run beside the work (:mod:`jgptq_torch.pipeline.moves`): while layer ``i`` is processed, layer
        ``i + 1`` comes to the device and layer ``i - 1`` goes back, so three layers may be on the device at once.
        Default: on CUDA devices, when offloading and no tensor belongs to two layers. A ``device_budget`` that the
        two extra layers would exceed turns it off.
    Raises:
      ValueError: a layer is already released (on meta); with disk offload, a tensor shared by two layers or by a
        layer and the rest of the model.
    """

    def __init__(self, model, layers, cfg, device: torch.device, ahead=None, source=None):
        self.model, self.layers, self.device, self.mode, self.reload = model, layers, device, cfg.offload, cfg.reload
        self.folder = LayerFolder(cfg.offload_dir, cfg.keep_offload_files)
        # the device's JAX twin, which keys the solves' grant (pipeline.solve.solve_limit); CUDA only
        self.jax_device = jax_device_for(device) if device.type == "cuda" else None
        self.source = source     # layers read from a checkpoint folder (jgptq_torch.source.stream.StreamedLayers)
        if source is not None:
            self.mode = "stream"
        for i, layer in enumerate(layers):
            if is_released(layer) and source is None:
                raise ValueError(f"decoder layer {i} is released (its tensors are on the meta device); load it "
                                 f"first with jgptq_torch.pipeline.offload.load_layer(model, {i}, offload_dir) or reload_all")
        in_layers: dict = {}
        for layer in layers:
            in_layers.update(unique_tensors(layer))
        if self.mode in ("disk", "stream"):
            check_not_shared(model, layers)
        self.homes = [run_device(None, layer) for layer in layers]
        other = [t for k, t in unique_tensors(model).items() if k not in in_layers]
        resident = {i for i, h in enumerate(self.homes) if _same_device(h, device)} if self.mode == "none" else set()
        sizes = tuple(nbytes(unique_tensors(la).values()) for la in layers)
        here = nbytes(t for t in other if _same_device(t.device, device))
        room = None if cfg.device_budget is not None else device_room(
            device, here + sum(b for b, h in zip(sizes, self.homes) if _same_device(h, device)))
        self.budget = Budget("disk" if source is not None else self.mode, cfg.device_budget, sizes, here,
                             frozenset(resident), str(device), room)
        self.on_device = set(resident)               # layers booked on the device
        self.peak = self.peak_host = 0
        self.needs: list = []
        self.chunks: dict = {}                       # layer -> sizes of its chunks of routed experts
        self.solve_room: dict = {}                   # layer -> bytes its solves may hold (solve.solve_limit)
        # moves run ahead (next layer in, finished layer out, beside the work) unless layers share tensors
        shared = len(in_layers) != sum(len(unique_tensors(la)) for la in layers)
        self.ahead = self.budget.moves_ahead(shared, moves_ahead_on(device) if ahead is None else ahead)
        self._moves = self._evac = None              # moves ahead; the evacuation beside the work (cpu)
        self._local = threading.local()              # per thread: pinned staging buffers
        self._early: set = set()                     # layers brought ahead and not yet fetched
        self._leaving: set = set()                   # layers whose move out is pending
        self.memory = {"offload": self.mode, "device": str(device), "budget": self.budget.limit,
                       "other_on_device": self.budget.other_on_device, "other_bytes": nbytes(other),
                       "largest_layer": max(self.budget.layer_bytes, default=0), "moves_ahead": self.ahead}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @property
    def moves(self) -> bool:
        """Whether layers are moved by the offload mode (their moves are timed as the ``offload`` stage)."""
        return self.budget.offloaded

    # -- the budget --------------------------------------------------------------------------------------------
    def check(self, needs: list) -> None:
        """Records each layer's need (:class:`LayerWork` or :class:`LayerNeed`) and checks the largest total
        against the budget (:meth:`jgptq_torch.pipeline.budget.Budget.assess`); moves ahead without room in the
        budget turn in line; layers over it have their routed experts go in chunks (:attr:`chunks`).

        Raises:
          DeviceBudgetError: over the budget (with the mode that would fit, if one does).
        """
        self.needs = list(needs)
        verdict = self.budget.assess(self.needs, self.ahead)
        self.ahead = self.memory["moves_ahead"] = verdict.ahead
        if self._moves is not None and not self.ahead:  # turned off after prepare (no move is queued yet)
            self._moves, moves = None, self._moves
            moves.close()
        self.memory["need"] = verdict.record()
        self.chunks, self.memory["expert_chunks"] = verdict.chunks, chunk_summary(verdict.chunks)
        self.solve_room = verdict.solve_room
        verdict.raise_if_over()

    def check_activations(self, measured: int) -> None:
        """Re-checks the budget with the activation bytes measured after the capture."""
        self.memory["activations_measured"] = int(measured)
        if self.needs:
            self.check([dataclasses.replace(n, activations=int(measured)) for n in self.needs])

    def note_hessians(self, states: dict) -> None:
        """Books the measured bytes of one layer's Hessian statistics (jax pytrees)."""
        import jax

        size = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(list(states.values())))
        self.memory["hessians_measured"] = max(self.memory.get("hessians_measured", 0), int(size))

    def book(self):
        """Books the bytes on the device and the parameter bytes in host memory now (their peaks)."""
        self._book()

    def _book(self):
        self.peak = max(self.peak, self.budget.booked(self.on_device))
        self.peak_host = max(self.peak_host, host_bytes(self.model))

    # -- moves ---------------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Puts every layer in its place for the run: host memory (``cpu``) or its file, released (``disk``).
        Layers are moved (or written) by :data:`PREPARE_WORKERS` threads at once; with moves ahead and no
        ``device_budget``, ``cpu`` leaves the layers that are on the device there, and a worker moves them to host
        memory from the last one back while the run works (the layers the run reaches first never make the trip
        twice)."""
        t0 = time.perf_counter()
        if self.mode == "disk":
            self.folder.open()
            self.memory["offload_dir"] = str(self.folder.dir)
        eager = list(range(len(self.layers))) if self.mode != "stream" else []   # streamed layers start on meta
        if self.budget.evacuates_beside(self.ahead, self.device.type == "cpu"):
            # layers already on the device leave it from the last one back, beside the work
            resident = [i for i, layer in enumerate(self.layers)
                        if any(_same_device(t.device, self.device) for t in unique_tensors(layer).values())]
            if resident:
                self._evac = Evacuation(self.device, resident, self._leave)
                self.on_device |= set(resident)
                eager = [i for i in eager if i not in resident]
        if self.moves and eager:
            moves = Moves(self.device, PREPARE_WORKERS)
            try:
                for i in eager:
                    moves.submit(i, functools.partial(self._leave, i), after_current=True)
                done, errors = moves.wait_each()
            finally:
                moves.close()
            if self.mode == "disk":
                self.folder.written.update(done)
            if errors:
                raise next(iter(errors.values()))
        if self.mode == "cpu":
            self.homes = [torch.device("cpu")] * len(self.layers)
        if self.ahead:
            self._moves = Moves(self.device, 1)
        self._book()
        self.memory["prepare_s"] = time.perf_counter() - t0

    def _move(self, layer: nn.Module, device: torch.device) -> None:
        """``layer.to(device)``; between a CUDA device and host memory through this thread's pinned buffers
        (:class:`jgptq_torch.pipeline.moves.Staging`) when :data:`STAGED_MOVES` is on."""
        if not (STAGED_MOVES and self.device.type == "cuda"):
            layer.to(device)
            return
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = Staging(self.device)
        staging.move(layer, device)

    def _arrive(self, i: int) -> None:
        """Places layer ``i`` on the device (a move: runs on a worker or in line)."""
        layer = self.layers[i]
        if self.mode == "disk":
            read_layer(layer, self.folder.file(i), self.device)
        elif self.mode == "stream":
            self.source.arrive(i, self.device)
        else:
            self._move(layer, self.device)

    def _leave(self, i: int) -> None:
        """Puts layer ``i`` in its place: host memory, or its file (then released)."""
        layer = self.layers[i]
        if self.mode == "disk":
            write_layer(layer, self.folder.file(i))
            release_layer(layer)
        elif self.mode == "stream":
            self.source.leave(i)
        elif self.mode == "none":
            layer.to(self.homes[i])
        else:
            self._move(layer, torch.device("cpu"))

    def _settle(self, i: int) -> None:
        """Claims layers ``i`` and ``i + 1`` from the evacuation and unbooks the layers whose move out (or
        evacuation) has ended."""
        if self._evac is not None:
            self._evac.claim(i, self.on_device)
        for j in [j for j in self._leaving if self._moves.done(("out", j))]:
            self._moves.wait(("out", j))
            self._leaving.discard(j)
            self.on_device.discard(j)
        if self._evac is not None:
            self._evac.unbook(self.on_device)

    def fetch(self, i: int) -> nn.Module:
        """Places layer ``i`` on the device for processing and returns it; with moves ahead, starts bringing
        layer ``i + 1``."""
        if self._moves is not None:
            self._settle(i)
            if i in self._early:
                self._early.discard(i)
                self._moves.wait(("in", i))
            else:
                self._arrive(i)
            self.on_device.add(i)
            if i + 1 < len(self.layers):
                self.on_device.add(i + 1)     # booked from the start of its move
                self._early.add(i + 1)
                self._moves.submit(("in", i + 1), functools.partial(self._arrive, i + 1))
        else:
            self._arrive(i)
            self.on_device.add(i)
        self._book()
        return self.layers[i]

    def put_back(self, i: int) -> None:
        """Returns processed layer ``i`` to its place (its file: written, then released); with moves ahead, on
        a worker once the work queued on the layer is done."""
        if self._moves is not None:
            self._leaving.add(i)
            self._moves.submit(("out", i), functools.partial(self._leave, i), after_current=True)
            return
        if self.moves:
            self._leave(i)
        elif not _same_device(self.homes[i], self.device):
            self.layers[i].to(self.homes[i])
        if self.moves or not _same_device(self.homes[i], self.device):
            self.on_device.discard(i)

    def finish(self, failed: bool) -> None:
        """After the run (or a failure): pending moves end (a layer brought ahead and never processed goes back
        to its place); with disk offload and ``reload``, every layer whose file this run wrote is read back into
        host memory (after a failure too: the model is whole again, finished layers quantized, the layer being
        processed as it was before) and the files are removed unless kept; the peaks go to ``memory``."""
        t0 = time.perf_counter()
        try:
            errors: dict = {}
            if self._evac is not None:
                evac, self._evac = self._evac, None
                moved, errors = evac.end()
                self.on_device.difference_update(moved)
            if self._moves is not None:
                moves, self._moves = self._moves, None
                try:
                    _, broken = moves.wait_each()
                finally:
                    moves.close()
                errors = {**errors, **broken}
                for i in sorted(self._early):
                    if ("in", i) not in broken:
                        self._leave(i)
                self.on_device -= self._early | self._leaving
                self._early.clear()
                self._leaving.clear()
            if self.mode == "disk" and self.folder.opened and self.reload:
                for i in sorted(self.folder.written):
                    read_layer(self.layers[i], self.folder.file(i), "cpu")
                if not self.folder.keep:
                    self.folder.remove(len(self.layers))
            if errors:  # raised once the layers are in place
                raise next(iter(errors.values()))
        finally:
            self.memory.update(peak_parameters_on_device=self.peak, peak_host_parameters=self.peak_host,
                               finish_s=time.perf_counter() - t0)
            if self.source is not None:
                self.memory["streamed"] = self.source.memory()
            if self.device.type == "cuda":
                self.memory["cuda_max_allocated"] = int(torch.cuda.max_memory_allocated(self.device))

    def failure_note(self) -> str:
        """What a failed run leaves where (for the error), or ``""`` when :meth:`finish` restores the model."""
        if self.mode != "disk" or not self.folder.opened or self.reload:
            return ""
        return (f"the model's decoder layers are released (meta device); the files in {self.folder.dir} hold them: "
                f"jgptq_torch.pipeline.offload.reload_all(model, {str(self.folder.dir)!r}) loads them")
