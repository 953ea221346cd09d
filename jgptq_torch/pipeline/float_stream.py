"""The float model's stream: the inputs each decoder layer gets when every earlier layer is float.

With ``imatrix_source="float"`` (:class:`jgptq.config.PipelineConfig`) the importance statistic is collected on
this stream, as llama.cpp's ``llama-imatrix`` collects it on the float model, rather than on the inputs of the
run's replay (where the earlier layers are already quantized). GPTQ's Hessians still come from the replay.

The stream is carried beside the run, one layer at a time, while the layer is on the device and still float: the
layer runs once more on every batch with a capture of the importance statistic alone, and its outputs are the
next layer's float inputs. The first layer's float inputs are the run's own, so its calibration forward serves
both. Cost: one more forward of every layer but the first per batch, and one more set of a layer's hidden states
(every batch) in memory; no first pass over the whole model, so layers that live off the device are fetched once.

A method that reads the error-feedback statistic (:func:`jgptq.statistics.error_cross`) needs the stream too,
whatever ``imatrix_source``: each layer's float forward then runs inside its calibration, batch by batch before
the run's own (:class:`jgptq_torch.pipeline.calibrate.Partner`), so that each weight's inputs in the run pair with
the float model's (:mod:`jgptq_torch.pipeline.paired`); it is the stream's forward (no extra one) and collects the
importance statistic when ``imatrix_source="float"``. The first layer needs no pairs (its inputs are the float
model's: the statistic is zero there and never collected).

:class:`FloatStream` is the run's hook (:mod:`jgptq_torch.pipeline.step`); the stream itself is
``run.float_hidden`` (a resumable run saves and restores it with the replay's inputs).
"""

from __future__ import annotations

import time

from jgptq import statistics
from jgptq_torch.pipeline import capture, importance
from jgptq_torch.pipeline.calibrate import Partner, calibrate
from jgptq_torch.pipeline.step import Hook, LayerStep


def enabled(cfg, given, stats: dict) -> bool:
    """Whether a run carries the float stream: ``cfg.imatrix_source`` is ``"float"`` and no imatrix was given
    (a given one replaces the collected statistic), or the run's statistics ``stats``
    (:func:`jgptq.statistics.of_config`) hold the error-feedback one (inputs paired with the stream's)."""
    return (cfg.imatrix_source == "float" and given is None) or statistics.ERROR_CROSS in stats


class FloatStream(Hook):
    """Carries ``run.float_hidden`` (one (B, S, H) tensor per batch: the current layer's float inputs; None after
    the last layer) and, with ``imatrix_source="float"``, hands each layer's step the importance statistic
    collected on it. A layer in chunks of routed experts is seen on its first pass: the float pass covers every
    expert; with pairs, every pass runs the float layer beside the run's (its chunk's experts are paired)."""

    def __init__(self, cfg=None, given=None, stats: dict = None):
        self.shared = False
        self.float_inputs = None   # the current layer's float inputs (the stream moves on after its first pass)
        self.importance = cfg is None or (cfg.imatrix_source == "float" and given is None)
        self.pairs = bool(stats) and statistics.ERROR_CROSS in stats

    @classmethod
    def of(cls, run):
        """The hook of ``run`` (a :class:`jgptq_torch.pipeline.run_setup.Run`), or None when it carries no float
        stream (:func:`enabled`)."""
        return cls(run.cfg, run.given, run.stats) if enabled(run.cfg, run.given, run.stats) else None

    def _stats(self, step: LayerStep) -> dict:
        use = self.importance and step.first
        return {statistics.IMATRIX: statistics.importance()} if use else {}

    def inputs(self, run, first: int, hidden: list, layer_inputs: list) -> list:
        if run.float_hidden is None:   # not restored: the stream starts from the run's own inputs
            run.float_hidden = hidden
        return hidden

    def before_calibrate(self, run, step: LayerStep) -> None:
        target = run.targets[step.index]
        if step.first:
            self.float_inputs = run.float_hidden
            # the float stream's inputs are the run's (the first layer): the calibration forward serves both
            self.shared = run.float_hidden is step.hidden and bool(target.linears or target.experts)
            if self.shared and step.index < len(run.layers) - 1:
                step.keep_outputs = True
        if self.pairs and not self.shared and self.float_inputs is not None and (target.linears or target.experts):
            step.partner = Partner(capture.Collector(target.linears, target.experts, self._stats(step), record=True),
                                   self.float_inputs)

    def after_calibrate(self, run, step: LayerStep) -> None:
        if run.float_hidden is None or not step.first:
            return
        step.stage("float")
        if self.shared:
            run.float_hidden = step.outputs
            return
        i = step.index
        if step.partner is not None:   # the float forward ran inside the calibration
            run.float_hidden = step.partner.outputs if i < len(run.layers) - 1 else None
            collector = step.partner.collector
        else:
            collector = self.float_pass(run, step, self._stats(step))
        if self.importance:
            step.imatrix = importance.layer_imatrix(collector, run.prefix, i, run.targets[i])

    @staticmethod
    def float_pass(run, step: LayerStep, stats: dict | None = None):
        """Runs float layer ``step.index`` on the float stream's inputs; returns the
        :class:`jgptq_torch.pipeline.capture.Collector` of ``stats`` (default: the importance statistic; routed
        tokens only for experts) over them, and moves the stream on to the layer's outputs (None after the last
        layer)."""
        i = step.index
        t0 = time.perf_counter()
        stats = {statistics.IMATRIX: statistics.importance()} if stats is None else stats
        collector, outputs = calibrate(step.layer, i, run.targets[i], stats, run.float_hidden, step.layer_inputs,
                                       run.batch_list, keep_outputs=True, desc=f"layer {i} float",
                                       progress=run.cfg.progress)
        run.float_hidden = outputs if i < len(run.layers) - 1 else None
        run.report.add_time(i, "float", time.perf_counter() - t0)
        return collector
