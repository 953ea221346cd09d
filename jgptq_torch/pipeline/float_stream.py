"""The float model's stream: the inputs each decoder layer gets when every earlier layer is float.

With ``imatrix_source="float"`` (:class:`jgptq.config.PipelineConfig`) the importance statistic is collected on
this stream, as llama.cpp's ``llama-imatrix`` collects it on the float model, rather than on the inputs of the
run's replay (where the earlier layers are already quantized). GPTQ's Hessians still come from the replay.

The stream is carried beside the run, one layer at a time, while the layer is on the device and still float: the
layer runs once more on every batch with a capture of the importance statistic alone, and its outputs are the
next layer's float inputs. The first layer's float inputs are the run's own, so its calibration forward serves
both. Cost: one more forward of every layer but the first per batch, and one more set of a layer's hidden states
(every batch) in memory; no first pass over the whole model, so layers that live off the device are fetched once.
"""

from __future__ import annotations

import time

from jgptq_torch.pipeline import capture
from jgptq_torch.pipeline.inputs import run_layer
from jgptq_torch.progress import stage_bar
from jgptq import statistics


def enabled(cfg, given) -> bool:
    """Whether a run carries the float stream: ``cfg.imatrix_source`` is ``"float"`` and no imatrix was given
    (a given one replaces the collected statistic)."""
    return cfg.imatrix_source == "float" and given is None


def float_pass(run, i: int, layer, layer_inputs: list):
    """Runs float layer ``i`` on the float stream's inputs ``run.float_hidden`` (one (B, S, H) tensor per batch).

    Returns the :class:`jgptq_torch.pipeline.capture.Collector` of the importance statistic over those inputs (routed tokens
    only for experts), and sets ``run.float_hidden`` to the layer's outputs (None after the last layer).
    """
    target, cfg = run.targets[i], run.cfg
    collector = capture.Collector(target.linears, target.experts, {statistics.IMATRIX: statistics.importance()})
    t0 = time.perf_counter()
    outputs = []
    with collector.attach():
        for b, batch in enumerate(stage_bar(run.batch_list, desc=f"layer {i} float", enabled=cfg.progress)):
            rest, kw = layer_inputs[b][i]
            with collector.batch(batch.attention_mask.to(run.float_hidden[b].device)):
                outputs.append(run_layer(layer, run.float_hidden[b], rest, kw))
    run.float_hidden = outputs if i < len(run.layers) - 1 else None
    run.report.add_time(i, "float", time.perf_counter() - t0)
    return collector
