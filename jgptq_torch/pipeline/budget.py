"""The device budget of a layerwise run, in numbers: what each layer needs on the device, what stays there, and the
decisions that follow (moves beside the work or in line, routed experts in chunks, fits or not, and why not).

Everything here is plain integers and sets: no tensor, no device. :mod:`jgptq_torch.pipeline.offload` measures the model, asks
:class:`Budget` and moves the layers accordingly.

- :class:`LayerNeed`: the estimated device bytes of processing one decoder layer (:func:`estimate_need`, from the
  shapes of its targets).
- :class:`LayerWork`: what a layer's need is made of, so that it can be had for any number of routed experts per
  chunk (:meth:`LayerWork.need`).
- :class:`Budget`: the offload mode, ``device_budget``, each layer's parameter bytes and the bytes of the tensors
  outside the layers that sit on the device. It answers whether moves may run beside the work
  (:meth:`Budget.moves_ahead`, :meth:`Budget.evacuates_beside`), what the run needs at its worst layer and in how
  many chunks each layer's routed experts go (:meth:`Budget.assess`, a :class:`Verdict` with the error message when
  over) and how many parameter bytes a set of layers on the device holds (:meth:`Budget.booked`).

With moves beside the work, the layer before the current one (going back) and the layer after it (coming in) may be
on the device with it: their parameters count too. A budget without room for them turns the moves in line.

Routed experts in chunks. A MoE layer whose whole need is over the budget (or, without a budget, over the room
of an accelerator: :attr:`Budget.room`) has its routed experts calibrated and solved a chunk at a time
(:mod:`jgptq_torch.pipeline.expert_chunks`): only one chunk's Hessians, results and solve are on the device at
once. The chunk is the most experts that fit; the experts are then cut into that many balanced chunks
(:func:`balanced`: sizes differ by one at most). A layer is over the budget only when one expert per chunk does not
fit. Moves beside the work stay on only when they cost no extra chunk.

What a layer's Hessians and solves may hold (:attr:`Verdict.solve_room`): the limit (or room) less the rest of its
total. On an accelerator the solves are granted that much (:func:`jgptq.parallel.memory.granted`): JAX's own
statistics count only JAX's buffers, so without the grant a solve would size its batches to JAX's whole allocator
limit, whatever torch holds beside it (the parameters, the activations), and torch could then run out of memory.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from jgptq_torch.report import format_bytes

MODES = ("none", "cpu", "disk")


class DeviceBudgetError(ValueError):
    """The run would place more bytes on the device than ``device_budget`` allows."""


@dataclasses.dataclass
class LayerNeed:
    """Estimated device bytes of processing one decoder layer.

    Attributes:
      parameters: the layer's parameters and buffers.
      activations: the calibration activations (the layer's inputs and outputs of every batch, coexisting during
        the replay) and the captured per-layer arguments.
      hessians: float32 Hessian sums of its targets (one per linear module: an upper bound, since modules that
        share an input share one; one per expert and projection; one gate/up for ``all_experts``).
      solve: the solver's float32 results for every target (kept until written back) and the working set of its
        largest bucket (Hessian factor and float32 weights).
    """

    parameters: int
    activations: int
    hessians: int
    solve: int

    experts = 0   # routed experts that chunks could split: none, this need is fixed (see LayerWork)

    @property
    def total(self) -> int:
        return self.parameters + self.activations + self.hessians + self.solve

    def need(self, per_chunk=None) -> LayerNeed:
        """This need (a fixed need has no chunks)."""
        return self


def estimate_need(parameters: int, activations: int, matrices, all_experts: bool) -> LayerNeed:
    """The :class:`LayerNeed` of a layer of ``parameters`` bytes whose calibration activations take ``activations``
    bytes, from the shapes of its target matrices.

    Args:
      matrices: ``(count, rows, cols, kind)`` of each target (:class:`jgptq_torch.models.Matrix`: ``count`` stacked
        matrices of (rows, cols); ``kind`` ``"linear"``, ``"expert_gate_up"``, ``"expert_down"`` or
        ``"expert_stack"``).
      all_experts: one gate/up Hessian shared by all experts (calibration ``"all_experts"``) instead of one each.
    Returns:
      float32 bytes: one Hessian (cols x cols) per matrix (one for a whole gate/up stack with ``all_experts``);
      the results of every target and the working set of the largest bucket of same-shape matrices,
      ``n * cols * (2 * cols + 3 * rows)``: the solve holds about two (cols x cols) arrays per matrix (the damped
      Hessian and its factor) and three (rows x cols) ones (weights, codes being made, the propagated error).
      Measured on the H200 (peak JAX bytes less the Hessians, 4-bit g128): Qwen3-235B-A22B layer 43 GB against
      46 GB by this estimate (25 GB by the earlier ``n * cols * (cols + rows)``, which let an 80 GB GPU run out of
      memory); DeepSeek-V3 with 64 experts 45 against 61 GB; Qwen3-30B-A3B 13.4 against 11.6 GB.
    """
    hess, results, buckets = 0, 0, {}
    for count, r, c, kind in matrices:
        hess += c * c * (1 if all_experts and kind == "expert_gate_up" else count)
        results += count * r * c
        key = (kind != "linear", r, c)
        buckets[key] = buckets.get(key, 0) + count
    work = max((n * c * (2 * c + 3 * r) for (_, r, c), n in buckets.items()), default=0)
    return LayerNeed(int(parameters), int(activations), 4 * hess, 4 * (results + work))


@dataclasses.dataclass
class LayerWork:
    """What one decoder layer's need is made of: :meth:`need` for any number of routed experts per chunk.

    Attributes:
      parameters, activations: as in :class:`LayerNeed`.
      matrices: ``(count, rows, cols, kind)`` of each target (see :func:`estimate_need`).
      all_experts: the calibration ``"all_experts"`` (one gate/up Hessian for all experts).
      chunkable: whether the routed experts may go in chunks (a layer of one experts module; with several, one
        module's outputs could be another's inputs, and the float layer must then be calibrated whole).
    """

    parameters: int
    activations: int
    matrices: tuple
    all_experts: bool
    chunkable: bool = True

    @property
    def experts(self) -> int:
        """Routed experts a chunk plan splits (the most of any experts stack; 0 when not :attr:`chunkable`)."""
        if not self.chunkable:
            return 0
        return max((c for c, _, _, kind in self.matrices if kind != "linear"), default=0)

    def need(self, per_chunk=None) -> LayerNeed:
        """The :class:`LayerNeed` with at most ``per_chunk`` routed experts of each stack on the device at once
        (None: all): the linear targets' Hessians and results with one chunk's (an upper bound: the linear ones
        are solved with the first chunk, their Hessians freed after it)."""
        shapes = [(min(c, per_chunk) if per_chunk and kind != "linear" else c, r, col, kind)
                  for c, r, col, kind in self.matrices]
        return estimate_need(self.parameters, self.activations, shapes, self.all_experts)


def balanced(experts: int, most: int) -> tuple:
    """The sizes of the fewest chunks of at most ``most`` experts that hold ``experts``, as even as can be (the
    first ones one larger): ``balanced(8, 3) == (3, 3, 2)``."""
    count = -(-experts // max(1, most))
    return tuple(experts // count + (1 if j < experts % count else 0) for j in range(count))


def chunk_summary(chunks: dict) -> list:
    """The chunk plans of a run (layer -> chunk sizes) as records: one per distinct plan, ``{"layers": [...],
    "experts": E, "chunks": n, "experts_per_chunk": [sizes]}``."""
    plans: dict = {}
    for i in sorted(chunks):
        plans.setdefault(tuple(chunks[i]), []).append(i)
    return [{"layers": layers, "experts": sum(sizes), "chunks": len(sizes), "experts_per_chunk": list(sizes)}
            for sizes, layers in plans.items()]


def chunk_note(summary: list, device: str) -> str:
    """One line saying which layers go in chunks of routed experts, and how (``""`` when none does)."""
    if not summary:
        return ""
    parts = [f"layers {_ranges(p['layers'])}: {p['experts']} routed experts in {p['chunks']} chunks of "
             f"{'/'.join(str(n) for n in sorted(set(p['experts_per_chunk']), reverse=True))}" for p in summary]
    return f"routed experts a chunk at a time to fit {device}: " + "; ".join(parts)


def _ranges(layers: list) -> str:
    runs, start = [], None
    for j, i in enumerate(layers):
        if start is None:
            start = i
        if j + 1 == len(layers) or layers[j + 1] != i + 1:
            runs.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ",".join(runs)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a run needs on the device at its worst layer, and whether it fits.

    Attributes:
      ahead: whether layer moves run beside the work (False when the budget has no room for the neighbours).
      layer: the index of the layer whose total is largest (the first of equals).
      need: that layer's :class:`LayerNeed` (with its chunk of routed experts when it goes in chunks).
      total: its bytes on the device together with what stays there (int).
      problem: the message of the :class:`DeviceBudgetError` when over the budget, else ``""``.
      chunks: layer -> the sizes of its chunks of routed experts, for the layers that go in chunks.
      solve_room: layer -> the bytes its Hessians and solves may hold on the device: the limit (or the room) less
        what stays there with it, its parameters and its activations (empty without a limit or a room).
    """

    ahead: bool
    layer: int
    need: LayerNeed
    total: int
    problem: str = ""
    chunks: dict = dataclasses.field(default_factory=dict)
    solve_room: dict = dataclasses.field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return not self.problem

    def record(self) -> dict:
        """The ``need`` entry of the run's memory record: the worst layer, its need by part, the bytes that stay
        on the device with it (``other_on_device``) and the total; ``experts_per_chunk`` when that layer goes in
        chunks, ``solve_room`` under a limit or a room."""
        out = {"layer": self.layer, **dataclasses.asdict(self.need), "other_on_device": self.total - self.need.total,
               "total": self.total}
        if self.layer in self.chunks:
            out["experts_per_chunk"] = max(self.chunks[self.layer])
        if self.layer in self.solve_room:
            out["solve_room"] = self.solve_room[self.layer]
        return out

    def raise_if_over(self) -> None:
        """Raises :class:`DeviceBudgetError` with :attr:`problem` when over the budget."""
        if self.problem:
            raise DeviceBudgetError(self.problem)


@dataclasses.dataclass(frozen=True)
class Budget:
    """The numbers of a run's placement.

    Attributes:
      mode: the offload mode, ``"none"``, ``"cpu"`` or ``"disk"``.
      limit: ``device_budget`` in bytes, or None (no limit).
      layer_bytes: parameter and buffer bytes of each decoder layer (ints, one per layer).
      other_on_device: bytes of the tensors outside the layers that are on the device (they stay there).
      resident: with ``mode="none"``, the indices of the layers that start on the device (they stay there).
      device: the run device, as it is named in messages (e.g. ``"cuda:0"``).
      room: without a limit, the bytes that chunks of routed experts are planned against (an accelerator's
        memory); None: no chunks unless a limit asks. Never an error: only a limit refuses a run.
    """

    mode: str
    limit: Optional[int]
    layer_bytes: tuple
    other_on_device: int = 0
    resident: frozenset = frozenset()
    device: str = "the device"
    room: int | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"offload mode {self.mode!r}: expected one of {MODES}")

    @property
    def target(self) -> Optional[int]:
        """The bytes a layer's work is planned against: the limit, else the room (None: neither)."""
        return self.limit if self.limit is not None else self.room

    @property
    def offloaded(self) -> bool:
        """Whether the layers move by the offload mode (``cpu`` or ``disk``): one at a time on the device."""
        return self.mode != "none"

    def moves_ahead(self, shared: bool, wanted: bool) -> bool:
        """Whether layer moves run beside the work, before any need is known: only when offloading, when no
        tensor belongs to two layers (``shared`` False) and when ``wanted`` (the caller's choice or the device's
        default)."""
        return self.offloaded and not shared and bool(wanted)

    def evacuates_beside(self, ahead: bool, device_is_host: bool) -> bool:
        """Whether the layers that start on the device leave it beside the work (from the last one back) instead
        of before the run: with ``cpu`` offload, moves ahead, no limit (the device is as full at the start as it
        was given) and a device that is not host memory itself."""
        return self.mode == "cpu" and ahead and self.limit is None and not device_is_host

    def booked(self, on_device) -> int:
        """Parameter bytes on the device with the layers ``on_device`` (indices) there: theirs and the others'."""
        return self.other_on_device + sum(self.layer_bytes[j] for j in on_device)

    def fixed(self, i: int, ahead: bool = False, offloaded: bool | None = None) -> int:
        """Device bytes while layer ``i`` is processed besides its own need: the tensors outside the layers, the
        resident layers unless ``offloaded`` (default: the mode's), and with ``ahead`` the layers before and after
        it."""
        fixed = self.other_on_device
        if not (self.offloaded if offloaded is None else offloaded):
            fixed += sum(self.layer_bytes[j] for j in self.resident if j != i)
        if ahead:  # the layer before (moving out) and the layer after (moving in)
            fixed += sum(self.layer_bytes[j] for j in (i - 1, i + 1) if 0 <= j < len(self.layer_bytes))
        return fixed

    def total(self, needs, i: int, ahead: bool = False, offloaded: Optional[bool] = None) -> int:
        """Device bytes while layer ``i`` is processed: its need (``needs[i]``, a :class:`LayerNeed`, or a
        :class:`LayerWork` taken whole) and :meth:`fixed`."""
        return self.fixed(i, ahead, offloaded) + needs[i].need().total

    def plan(self, work, i: int, ahead: bool, offloaded: bool | None = None) -> tuple:
        """(chunk sizes or None, :class:`LayerNeed`) of layer ``i`` needing ``work`` (a :class:`LayerWork` or a
        fixed :class:`LayerNeed`): whole when it fits the limit (or :attr:`room`) or has no experts to split; else
        the most experts per chunk that fit, in balanced chunks; one expert per chunk when none fits."""
        whole, target = work.need(), self.target
        fixed = self.fixed(i, ahead, offloaded)
        if target is None or work.experts < 2 or fixed + whole.total <= target:
            return None, whole
        lo, hi = 1, work.experts - 1             # the need grows with the experts per chunk: the largest that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fixed + work.need(mid).total <= target else (lo, mid - 1)
        sizes = balanced(work.experts, lo)
        return sizes, work.need(max(sizes))

    def assess(self, needs, ahead: bool) -> Verdict:
        """The :class:`Verdict` of layers needing ``needs`` (one :class:`LayerWork` or :class:`LayerNeed` per
        layer) with moves beside the work if ``ahead``. Each layer's routed experts go in chunks when it does not
        fit whole (:meth:`plan`). Moves ahead are kept only where they fit the limit and cost no extra chunk;
        over the limit, :attr:`Verdict.problem` says by how much and what would help (the offload mode that fits,
        if one does)."""
        n = len(needs)
        plans = [self.plan(needs[i], i, ahead) for i in range(n)]
        if ahead and (self.limit is not None or self.room is not None):
            inline = [self.plan(needs[i], i, False) for i in range(n)]
            over = self.limit is not None and any(self.fixed(i, True) + plans[i][1].total > self.limit
                                                  for i in range(n))
            if over or sum(len(p or ()) for p, _ in plans) > sum(len(p or ()) for p, _ in inline):
                ahead, plans = False, inline  # moves in line keep one layer on the device
        chosen = [need for _, need in plans]
        worst = max(range(n), key=lambda i: self.total(chosen, i, ahead=ahead))
        need, total = chosen[worst], self.total(chosen, worst, ahead=ahead)
        chunks = {i: sizes for i, (sizes, _) in enumerate(plans) if sizes}
        rooms = {} if self.target is None else {
            i: max(0, self.target - self.fixed(i, ahead) - n.parameters - n.activations) for i, n in enumerate(chosen)}
        verdict = Verdict(ahead, worst, need, total, chunks=chunks, solve_room=rooms)
        if self.limit is None or total <= self.limit:
            return verdict
        return dataclasses.replace(verdict, problem=self._problem(needs, chosen, worst, total))

    def _problem(self, needs, chosen, worst: int, total: int) -> str:
        need, b, dev = chosen[worst], format_bytes(self.limit), self.device
        if not self.offloaded and self.resident and \
                all(self.plan(needs[i], i, False, offloaded=True)[1].total + self.fixed(i, offloaded=True)
                    <= self.limit for i in range(len(needs))):
            kept = sum(self.layer_bytes[j] for j in self.resident)
            return (f"offload='none' keeps {len(self.resident)} decoder layers ({format_bytes(kept)}) on {dev}; with "
                    f"{format_bytes(self.other_on_device)} of other tensors there and layer {worst}'s work the run "
                    f"needs about {format_bytes(total)}, over device_budget {b}. Use offload='cpu' (layers in host "
                    f"memory, one at a time on the device) or offload='disk' (layers in files, for models larger "
                    f"than host memory); command line: --offload cpu|disk")
        parts = (f"parameters {format_bytes(need.parameters)}, activations {format_bytes(need.activations)}, "
                 f"Hessians {format_bytes(need.hessians)}, solve {format_bytes(need.solve)}")
        experts = needs[worst].experts
        chunked = f" with one of its {experts} routed experts at a time" if experts >= 2 else ""
        return (f"decoder layer {worst} alone needs about {format_bytes(need.total)} on {dev}{chunked} ({parts}), plus "
                f"{format_bytes(total - need.total)} of tensors that stay there: {format_bytes(total)}, over "
                f"device_budget {b}. Offloading other layers cannot lower this; fewer calibration tokens (samples x "
                f"length) shrink the activations, moving the embeddings and head off the device frees theirs, or "
                f"raise the budget")
