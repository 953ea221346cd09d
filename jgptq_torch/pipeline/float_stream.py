"""The float model's stream: the inputs each decoder layer gets when every earlier layer is float.

With ``imatrix_source="float"`` (:class:`jgptq.config.PipelineConfig`) the importance statistic is collected on
this stream, as llama.cpp's ``llama-imatrix`` collects it on the float model, rather than on the inputs of the
run's replay (where the earlier layers are already quantized). GPTQ's Hessians still come from the replay.

The stream is carried beside the run, one layer at a time, while the layer is on the device and still float: the
layer runs once more on every batch with a capture of the importance statistic alone, and its outputs are the
next layer's float inputs. The first layer's float inputs are the run's own, so its calibration forward serves
both. Cost: one more forward of every layer but the first per batch, and one more set of a layer's hidden states
(every batch) in memory; no first pass over the whole model, so layers that live off the device are fetched once.

:class:`FloatStream` is the run's hook (:mod:`jgptq_torch.pipeline.step`); the stream itself is
``run.float_hidden`` (a resumable run saves and restores it with the replay's inputs).
"""

from __future__ import annotations

import time

from jgptq import statistics
from jgptq_torch.pipeline import importance
from jgptq_torch.pipeline.calibrate import calibrate
from jgptq_torch.pipeline.step import Hook, LayerStep


def enabled(cfg, given) -> bool:
    """Whether a run carries the float stream: ``cfg.imatrix_source`` is ``"float"`` and no imatrix was given
    (a given one replaces the collected statistic)."""
    return cfg.imatrix_source == "float" and given is None


class FloatStream(Hook):
    """Carries ``run.float_hidden`` (one (B, S, H) tensor per batch: the current layer's float inputs; None after
    the last layer) and hands each layer's step the importance statistic collected on it. A layer in chunks of
    routed experts is seen on its first pass: the float pass covers every expert."""

    def __init__(self):
        self.shared = False

    def inputs(self, run, first: int, hidden: list, layer_inputs: list) -> list:
        if run.float_hidden is None:   # not restored: the stream starts from the run's own inputs
            run.float_hidden = hidden
        return hidden

    def before_calibrate(self, run, step: LayerStep) -> None:
        if not step.first:
            return
        # the float stream's inputs are the run's (the first layer): the calibration forward serves both
        target = run.targets[step.index]
        self.shared = run.float_hidden is step.hidden and bool(target.linears or target.experts)
        if self.shared and step.index < len(run.layers) - 1:
            step.keep_outputs = True

    def after_calibrate(self, run, step: LayerStep) -> None:
        if run.float_hidden is None or not step.first:
            return
        step.stage("float")
        if self.shared:
            run.float_hidden = step.outputs
            return
        i = step.index
        step.imatrix = importance.layer_imatrix(self.float_pass(run, step), run.prefix, i, run.targets[i])

    @staticmethod
    def float_pass(run, step: LayerStep):
        """Runs float layer ``step.index`` on the float stream's inputs; returns the
        :class:`jgptq_torch.pipeline.capture.Collector` of the importance statistic over them (routed tokens only
        for experts), and moves the stream on to the layer's outputs (None after the last layer)."""
        i = step.index
        t0 = time.perf_counter()
        collector, outputs = calibrate(step.layer, i, run.targets[i], {statistics.IMATRIX: statistics.importance()},
                                       run.float_hidden, step.layer_inputs, run.batch_list, keep_outputs=True,
                                       desc=f"layer {i} float", progress=run.cfg.progress)
        run.float_hidden = outputs if i < len(run.layers) - 1 else None
        run.report.add_time(i, "float", time.perf_counter() - t0)
        return collector
