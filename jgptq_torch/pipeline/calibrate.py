"""The calibration forward of one decoder layer: the layer runs on every calibration batch with a capture attached.

:func:`calibrate` is the one loop that runs calibration batches through a decoder layer. Its callers differ only
in what they hand it: the quantizing step (:mod:`jgptq_torch.pipeline.layerwise`) collects the Hessians and the
importance statistic (:func:`jgptq.statistics.of_config`) on the run's inputs; the float stream
(:mod:`jgptq_torch.pipeline.float_stream`) collects the importance statistic alone on the float model's inputs and
keeps the outputs; the first pass of ``target_bpw`` (:mod:`jgptq_torch.pipeline.sensitivity`) collects what the
quantizing step does and keeps the outputs (every layer measured on float inputs). A layer whose routed experts
go in chunks (:mod:`jgptq_torch.pipeline.expert_chunks`) runs it once per chunk, keeping that chunk's experts.
"""

from __future__ import annotations

from jgptq_torch.pipeline import capture
from jgptq_torch.pipeline.inputs import run_layer
from jgptq_torch.progress import stage_bar


def calibrate(layer, i: int, target, stats: dict, hidden: list, layer_inputs: list, batch_list: list, *,
              span=None, keep_outputs: bool = False, desc: str = "", progress: bool = False) -> tuple:
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
    Returns:
      (the filled Collector, the outputs: one (B, S, H) tensor per batch, or None without ``keep_outputs``). A
      layer without targets runs only when its outputs are kept.
    """
    collector = capture.Collector(target.linears, target.experts, stats, span=span)
    outputs = [] if keep_outputs else None
    if not (target.linears or target.experts or keep_outputs):
        return collector, outputs
    with collector.attach():
        for b, batch in enumerate(stage_bar(batch_list, desc=desc, enabled=progress)):
            rest, kw = layer_inputs[b][i]
            with collector.batch(batch.attention_mask.to(hidden[b].device)):
                out = run_layer(layer, hidden[b], rest, kw)
            if outputs is not None:
                outputs.append(out)
    return collector, outputs
