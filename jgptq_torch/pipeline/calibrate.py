"""The calibration forward of one decoder layer: the layer runs on every calibration batch with a capture attached.

:func:`calibrate` is the one loop that runs calibration batches through a decoder layer. Its callers differ only
in what they hand it: the quantizing step (:mod:`jgptq_torch.pipeline.layerwise`) collects the Hessians and the
importance statistic (:func:`jgptq.statistics.of_config`) on the run's inputs; the float stream
(:mod:`jgptq_torch.pipeline.float_stream`) collects the importance statistic alone on the float model's inputs and
keeps the outputs; the first pass of ``target_bpw`` (:mod:`jgptq_torch.pipeline.sensitivity`) collects what the
quantizing step does and keeps the outputs (every layer measured on float inputs). A layer whose routed experts
go in chunks (:mod:`jgptq_torch.pipeline.expert_chunks`) runs it once per chunk, keeping that chunk's experts.

With a :class:`Partner` (a method that reads the error-feedback statistic: the float stream's hook makes one), each
batch first runs through the layer on the float stream with the partner's recording collector, then on the run's
inputs with the run's collector, which pairs its rows with the recorded ones (:mod:`jgptq_torch.pipeline.paired`);
the partner keeps the float outputs, the next layer's float inputs.
"""

from __future__ import annotations

import contextlib
import dataclasses

from jgptq_torch.pipeline import capture
from jgptq_torch.pipeline.layer_state import run_layer
from jgptq_torch.progress import stage_bar


@dataclasses.dataclass
class Partner:
    """The float stream beside a calibration: ``collector`` (a recording
    :class:`jgptq_torch.pipeline.capture.Collector`, with the statistics the float stream collects), its inputs
    ``hidden`` (one (B, S, H) tensor per batch) and, once run, its ``outputs``."""

    collector: object
    hidden: list
    outputs: list = dataclasses.field(default_factory=list)


def calibrate(layer, i: int, target, stats: dict, hidden: list, layer_inputs: list, batch_list: list, *,
              span=None, keep_outputs: bool = False, desc: str = "", progress: bool = False,
              partner: Partner = None) -> tuple:
    """Runs decoder layer ``i`` on every calibration batch with a :class:`jgptq_torch.pipeline.capture.Collector`
    of ``stats`` attached to the weights of ``target``.

    Args:
      layer: the decoder layer, where it runs; i: its index (its other arguments are ``layer_inputs[b][i]``).
      target: its :class:`jgptq_torch.models.LayerTargets`: the weights whose inputs are seen.
      stats: name -> :class:`jgptq.statistics.Statistic`: what is collected.
      hidden: the layer's inputs, one (B, S, H) tensor per batch.
      layer_inputs: every layer's other arguments per batch (:func:`jgptq_torch.pipeline.inputs.capture_inputs`).
      batch_list: the calibration batches (their attention masks keep padding tokens out of the statistics).
      span: (lo, hi): the experts' statistics keep experts ``lo <= e < hi`` only (a chunk); None: every expert.
      keep_outputs: keep the layer's outputs (the next layer's inputs on this stream).
      desc, progress: the title of a progress bar over the batches, and whether it is shown.
      partner: the float stream's :class:`Partner`, run before the run's inputs on each batch (its outputs filled).
    Returns:
      (the filled Collector, the outputs: one (B, S, H) tensor per batch, or None without ``keep_outputs``). A
      layer without targets runs only when its outputs are kept.
    """
    collector = capture.Collector(target.linears, target.experts, stats, span=span)
    outputs = [] if keep_outputs else None
    if not (target.linears or target.experts or keep_outputs):
        return collector, outputs
    if partner is not None:
        collector.partner = partner.collector
    # with a partner, each forward has its own collector attached (hooks on the same modules)
    with collector.attach() if partner is None else contextlib.nullcontext():
        for b, batch in enumerate(stage_bar(batch_list, desc=desc, enabled=progress)):
            rest, kw = layer_inputs[b][i]
            mask = batch.attention_mask.to(hidden[b].device)
            if partner is not None:
                with partner.collector.attach(), partner.collector.batch(mask):
                    partner.outputs.append(run_layer(layer, partner.hidden[b], rest, kw))
            with collector.attach() if partner is not None else contextlib.nullcontext(), collector.batch(mask):
                out = run_layer(layer, hidden[b], rest, kw)
            if outputs is not None:
                outputs.append(out)
    if partner is not None:
        partner.collector.recorded.clear()
        collector.partner = None
    return collector, outputs
