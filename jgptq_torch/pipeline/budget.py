"""The device budget of a layerwise run, in numbers: what each layer needs on the device, what stays there, and the
decisions that follow (moves beside the work or in line, fits or not, and why not).

Everything here is plain integers and sets: no tensor, no device. :mod:`jgptq_torch.pipeline.offload` measures the model, asks
:class:`Budget` and moves the layers accordingly.

- :class:`LayerNeed`: the estimated device bytes of processing one decoder layer (:func:`estimate_need`, from the
  shapes of its targets).
- :class:`Budget`: the offload mode, ``device_budget``, each layer's parameter bytes and the bytes of the tensors
  outside the layers that sit on the device. It answers whether moves may run beside the work
  (:meth:`Budget.moves_ahead`, :meth:`Budget.evacuates_beside`), what the run needs at its worst layer
  (:meth:`Budget.assess`, a :class:`Verdict` with the error message when over) and how many parameter bytes a set
  of layers on the device holds (:meth:`Budget.booked`).

With moves beside the work, the layer before the current one (going back) and the layer after it (coming in) may be
on the device with it: their parameters count too. A budget without room for them turns the moves in line.
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

    @property
    def total(self) -> int:
        return self.parameters + self.activations + self.hessians + self.solve


def estimate_need(parameters: int, activations: int, matrices, all_experts: bool) -> LayerNeed:
    """The :class:`LayerNeed` of a layer of ``parameters`` bytes whose calibration activations take ``activations``
    bytes, from the shapes of its target matrices.

    Args:
      matrices: ``(count, rows, cols, kind)`` of each target (:class:`jgptq_torch.models.Matrix`: ``count`` stacked
        matrices of (rows, cols); ``kind`` ``"linear"``, ``"expert_gate_up"`` or ``"expert_down"``).
      all_experts: one gate/up Hessian shared by all experts (calibration ``"all_experts"``) instead of one each.
    Returns:
      float32 bytes: one Hessian (cols x cols) per matrix (one for a whole gate/up stack with ``all_experts``);
      the results of every target and the working set of the largest bucket of same-shape matrices
      (``n * cols * (cols + rows)``).
    """
    hess, results, buckets = 0, 0, {}
    for count, r, c, kind in matrices:
        hess += c * c * (1 if all_experts and kind == "expert_gate_up" else count)
        results += count * r * c
        key = (kind != "linear", r, c)
        buckets[key] = buckets.get(key, 0) + count
    work = max((n * c * (c + r) for (_, r, c), n in buckets.items()), default=0)
    return LayerNeed(int(parameters), int(activations), 4 * hess, 4 * (results + work))


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a run needs on the device at its worst layer, and whether it fits.

    Attributes:
      ahead: whether layer moves run beside the work (False when the budget has no room for the neighbours).
      layer: the index of the layer whose total is largest (the first of equals).
      need: that layer's :class:`LayerNeed`.
      total: its bytes on the device together with what stays there (int).
      problem: the message of the :class:`DeviceBudgetError` when over the budget, else ``""``.
    """

    ahead: bool
    layer: int
    need: LayerNeed
    total: int
    problem: str = ""

    @property
    def fits(self) -> bool:
        return not self.problem

    def record(self) -> dict:
        """The ``need`` entry of the run's memory record: the worst layer, its need by part, the bytes that stay
        on the device with it (``other_on_device``) and the total."""
        return {"layer": self.layer, **dataclasses.asdict(self.need), "other_on_device": self.total - self.need.total,
                "total": self.total}

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
    """

    mode: str
    limit: Optional[int]
    layer_bytes: tuple
    other_on_device: int = 0
    resident: frozenset = frozenset()
    device: str = "the device"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"offload mode {self.mode!r}: expected one of {MODES}")

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

    def total(self, needs, i: int, ahead: bool = False, offloaded: Optional[bool] = None) -> int:
        """Device bytes while layer ``i`` is processed: its need (``needs[i]``, a :class:`LayerNeed`), the tensors
        outside the layers, the resident layers unless ``offloaded`` (default: the mode's), and with ``ahead`` the
        layers before and after it."""
        fixed = self.other_on_device
        if not (self.offloaded if offloaded is None else offloaded):
            fixed += sum(self.layer_bytes[j] for j in self.resident if j != i)
        if ahead:  # the layer before (moving out) and the layer after (moving in)
            fixed += sum(self.layer_bytes[j] for j in (i - 1, i + 1) if 0 <= j < len(self.layer_bytes))
        return fixed + needs[i].total

    def assess(self, needs, ahead: bool) -> Verdict:
        """The :class:`Verdict` of layers needing ``needs`` (one :class:`LayerNeed` per layer) with moves beside
        the work if ``ahead``. A limit without room for the neighbours of moves ahead turns them in line; over the
        limit, :attr:`Verdict.problem` says by how much and what would help (the offload mode that fits, if one
        does)."""
        n = len(needs)
        if ahead and self.limit is not None and max(self.total(needs, i, True) for i in range(n)) > self.limit:
            ahead = False  # moves in line keep one layer on the device
        worst = max(range(n), key=lambda i: self.total(needs, i, ahead=ahead))
        need, total = needs[worst], self.total(needs, worst, ahead=ahead)
        verdict = Verdict(ahead, worst, need, total)
        if self.limit is None or total <= self.limit:
            return verdict
        return dataclasses.replace(verdict, problem=self._problem(needs, worst, total))

    def _problem(self, needs, worst: int, total: int) -> str:
        need, b, dev = needs[worst], format_bytes(self.limit), self.device
        if not self.offloaded and self.resident and \
                max(self.total(needs, i, offloaded=True) for i in range(len(needs))) <= self.limit:
            kept = sum(self.layer_bytes[j] for j in self.resident)
            return (f"offload='none' keeps {len(self.resident)} decoder layers ({format_bytes(kept)}) on {dev}; with "
                    f"{format_bytes(self.other_on_device)} of other tensors there and layer {worst}'s work the run "
                    f"needs about {format_bytes(total)}, over device_budget {b}. Use offload='cpu' (layers in host "
                    f"memory, one at a time on the device) or offload='disk' (layers in files, for models larger "
                    f"than host memory); command line: --offload cpu|disk")
        parts = (f"parameters {format_bytes(need.parameters)}, activations {format_bytes(need.activations)}, "
                 f"Hessians {format_bytes(need.hessians)}, solve {format_bytes(need.solve)}")
        return (f"decoder layer {worst} alone needs about {format_bytes(need.total)} on {dev} ({parts}), plus "
                f"{format_bytes(total - need.total)} of tensors that stay there: {format_bytes(total)}, over "
                f"device_budget {b}. Offloading other layers cannot lower this; fewer calibration tokens (samples x "
                f"length) shrink the activations, moving the embeddings and head off the device frees theirs, or "
                f"raise the budget")
