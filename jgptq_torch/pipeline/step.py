"""The layer step's interface to what goes around it: :class:`LayerStep` and :class:`Hook`.

A hook is an object with a method for each point of a run of :func:`jgptq_torch.pipeline.layerwise.quantize_moe`
it takes part in (:class:`Hook` names them all and does nothing at any). The run calls them at these points, in
this order:

- ``start(run, first)``: before any work; ``first`` is the first layer to process (earlier ones were restored);
- ``inputs(run, first, hidden, layer_inputs)``: the first processed layer's inputs are captured; returns the
  inputs to go on with (a resumed run's stored ones);
- per layer: ``before_layer(run, i)``; inside the step (:class:`LayerStep`) ``before_calibrate``,
  ``after_calibrate`` and ``before_solve`` on each of its passes (one, or one per chunk of routed experts when the
  layer goes in chunks: :mod:`jgptq_torch.pipeline.expert_chunks`; :attr:`LayerStep.first` tells the first); a
  hook that sets :attr:`LayerStep.next_inputs` in ``after_calibrate`` ends the step there (the measuring pass of
  ``target_bpw``: :class:`jgptq_torch.pipeline.measure.Measure`); ``before_solve`` comes before the pass's
  matrices are read for the solve, so a hook may still change the layer there (the fold of a pre-scaling method:
  :class:`jgptq_torch.pipeline.prescale.Fold`, which sets :attr:`LayerStep.scales`);
  ``after_layer(run, i, hidden)`` with the next layer's inputs;
- ``finish(run)`` once every layer is done; ``close(run, error)`` always at the end (``error``: the exception the
  run stops with, or None).

:class:`Hooks` calls its hooks in their order, except that ``after_layer`` and ``close`` unwind in reverse, as
nested blocks do: the layer fetched last is put back first, before the state that names it is saved.

The hooks: :mod:`jgptq_torch.pipeline.hooks` (the layers' places, the resumable state, the solves' warm-up, the
sink), :class:`jgptq_torch.pipeline.float_stream.FloatStream` and :class:`jgptq_torch.pipeline.prescale.Fold`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass
class LayerStep:
    """One decoder layer's step while it runs: what its hooks read and add to."""

    index: int
    layer: object                  # the decoder layer, on the run device
    hidden: list                   # its inputs, one (B, S, H) tensor per batch
    layer_inputs: list             # every layer's other arguments per batch
    stage: Callable = lambda name: None   # names the stage that starts to the progress bar
    imatrix: dict = None           # the layer's importance statistic (parameter name -> ImatrixEntry) when a hook
                                   # collects it elsewhere (None: each pass's collector)
    # the pass: set by :meth:`begin`
    span: tuple = None             # its routed experts (lo, hi) when they go in chunks; None: the whole layer
    target: object = None          # the targets it collects and solves (a LayerTargets)
    keep_outputs: bool = False     # set by a hook that wants the calibration forward's outputs
    outputs: list = None           # they, when kept
    collector: object = None       # the calibration's Collector
    partner: object = None         # a hook's float stream run beside the calibration (calibrate.Partner), or None
    scales: dict = None            # set by a hook in before_solve that folded per-input-channel scales into the
                                   # layer (pre-scaling): Hessian key -> scale (C,); the solve's Hessians become
                                   # diag(s)^-1 H diag(s)^-1
    next_inputs: list = None       # set by a hook whose pass ends with the calibration (a measuring pass: nothing
                                   # is solved or written back): the next layer's inputs

    @property
    def first(self) -> bool:
        """Whether this is the layer's first pass (its only one unless its routed experts go in chunks)."""
        return self.span is None or self.span[0] == 0

    def begin(self, span, target) -> None:
        """Starts the pass of routed experts ``span`` over ``target``; what the pass before kept is let go."""
        self.span, self.target = span, target
        self.keep_outputs, self.outputs, self.collector, self.partner = False, None, None, None
        self.scales, self.next_inputs = None, None


class Hook:
    """A part of the run around the layer step; every point does nothing unless a hook overrides it."""

    def start(self, run, first: int) -> None:
        pass

    def inputs(self, run, first: int, hidden: list, layer_inputs: list) -> list:
        return hidden

    def before_layer(self, run, i: int) -> None:
        pass

    def before_calibrate(self, run, step: LayerStep) -> None:
        pass

    def after_calibrate(self, run, step: LayerStep) -> None:
        pass

    def before_solve(self, run, step: LayerStep) -> None:
        pass

    def after_layer(self, run, i: int, hidden) -> None:
        pass

    def finish(self, run) -> None:
        pass

    def close(self, run, error) -> None:
        pass


class Hooks(Hook):
    """Calls each of ``hooks`` (None entries left out) at every point, in order; ``after_layer`` and ``close``
    in reverse order."""

    def __init__(self, hooks=()):
        self.hooks = [h for h in hooks if h is not None]

    def start(self, run, first: int) -> None:
        for h in self.hooks:
            h.start(run, first)

    def inputs(self, run, first: int, hidden: list, layer_inputs: list) -> list:
        for h in self.hooks:
            hidden = h.inputs(run, first, hidden, layer_inputs)
        return hidden

    def before_layer(self, run, i: int) -> None:
        for h in self.hooks:
            h.before_layer(run, i)

    def before_calibrate(self, run, step: LayerStep) -> None:
        for h in self.hooks:
            h.before_calibrate(run, step)

    def after_calibrate(self, run, step: LayerStep) -> None:
        for h in self.hooks:
            h.after_calibrate(run, step)

    def before_solve(self, run, step: LayerStep) -> None:
        for h in self.hooks:
            h.before_solve(run, step)

    def after_layer(self, run, i: int, hidden) -> None:
        for h in reversed(self.hooks):
            h.after_layer(run, i, hidden)

    def finish(self, run) -> None:
        for h in self.hooks:
            h.finish(run)

    def close(self, run, error) -> None:
        for h in reversed(self.hooks):
            h.close(run, error)
