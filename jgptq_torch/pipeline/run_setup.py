"""What a run of :func:`jgptq_torch.pipeline.layerwise.quantize_moe` decides before any work.

:func:`prepare` makes the :class:`Run` every layer step shares: the decoder layers and their targets, the plan
(:func:`plan_layers`), checkpoint names, calibration batches, the layer placement with its budget checked, the
up-front weight checks, and the report. The quantizing pass
(:mod:`jgptq_torch.pipeline.layerwise`) and the first pass of a ``target_bpw`` run (:mod:`jgptq_torch.pipeline.sensitivity`) both start here.
"""

from __future__ import annotations

import dataclasses
import warnings

from jgptq_torch.pipeline import calib as calib_mod
from jgptq_torch.pipeline import float_stream
from jgptq_torch.pipeline import importance
from jgptq_torch import checkpoint_keys, linear_attention, models
from jgptq_torch.pipeline import weight_checks
from jgptq_torch.pipeline import offload as offload_mod
from jgptq_torch.report import QuantizeResult, Report
from jgptq_torch.pipeline.stores import Stores
from jgptq import plan as plan_mod
from jgptq import statistics
from jgptq.config import PipelineConfig


@dataclasses.dataclass
class Run:
    """What every layer step of one run shares."""

    cfg: PipelineConfig
    prefix: str
    layers: object
    targets: list
    plan: plan_mod.Plan
    names: dict
    batch_list: list
    result: QuantizeResult
    placement: object
    device: object
    devices: object = None
    given: dict = None
    stats: dict = None           # what calibration collects: the statistics chain of cfg
                                 # (jgptq.statistics.of_config), resolved once for the run
    float_hidden: list = None    # the float model's stream (imatrix_source="float"): layer i's inputs when all
                                 # earlier layers are float, one tensor per batch; None without that stream
    stores: Stores = dataclasses.field(default_factory=Stores)
    hooks: object = None         # what goes around the layer step (jgptq_torch.pipeline.step.Hooks)
    said: set = dataclasses.field(default_factory=set)   # warnings already shown

    @property
    def report(self) -> Report:
        return self.result.report


def prepare(model, calib, cfg, tokenizer, device, devices, imatrix, source=None) -> Run:
    """Every check and decision that comes before any work: targets, the plan, names, calibration, budget
    (``source``: the :class:`jgptq_torch.source.stream.StreamedLayers` of a streamed model, or None)."""
    stats = statistics.of_config(cfg)     # an option the pipeline cannot collect for raises here, before any work
    prefix, layers = models.find_decoder_layers(model)
    targets, plan = plan_layers(prefix, layers, cfg)
    if not plan.matrices:
        raise ValueError(models.nothing_to_quantize(model, prefix, layers, targets, cfg.exclude))
    if imatrix is not None:
        importance.check_imatrix(imatrix, prefix, targets)
    specs = {m.param_name(f"{prefix}.{i}"): (m.experts, m.rows, m.transposed)
             for i, t in enumerate(targets) for m in t.matrices()}
    names = checkpoint_keys.checkpoint_names(model, specs)
    run_device = offload_mod.run_device(device, layers[0])
    slow = linear_attention.slow_linear_attention(model, run_device)
    batch_list = calib_mod.batches(calib, tokenizer=tokenizer, batch_size=cfg.batch_size, max_length=cfg.max_length)
    placement = offload_mod.Placement(model, layers, cfg, run_device, source=source)
    # a layer's inputs and outputs coexist; the float stream (imatrix_source="float") keeps one more set
    activations = offload_mod.hidden_bytes(model, batch_list) * (3 if float_stream.enabled(cfg, imatrix, stats) else 2)
    placement.check([offload_mod.layer_need(layer, t, activations, cfg.moe.calibration == "all_experts")
                     for layer, t in zip(layers, targets)])      # before any work: over budget is an error
    weight_checks.check_finite_weights(targets, prefix)         # NaN/Inf named by weight and expert, up front
    report = Report(config=cfg.to_dict(), model=type(model).__name__,
                    calibration_tokens=calib_mod.token_count(batch_list))
    report.skipped = [(f"{prefix}.{i}.{n}", why) for i, t in enumerate(targets) for n, why in t.skipped]
    report.warnings.extend(plan.notes + plan.unmatched)
    result = QuantizeResult(model, {}, report, config=cfg,
                            param_keys={p: [k for k, _, _ in rows] for p, rows in names.items()})
    run = Run(cfg, prefix, layers, targets, plan, names, batch_list, result, placement, run_device, devices, imatrix,
              stats=stats)
    for note in (calib_mod.token_floor(report.calibration_tokens, targets, prefix), slow):
        if note:  # said once, before the first forward; kept in the report
            warnings.warn(note, stacklevel=3)
            report.warnings.append(note)
            run.said.add(note)
    for note in plan.notes + plan.unmatched:   # the plan's fallbacks and unused rules: known now, said now
        if note not in run.said:
            warnings.warn(note, stacklevel=3)
            run.said.add(note)
    return run


def plan_layers(prefix: str, layers, cfg) -> tuple:
    """The targets of every decoder layer and the run's :class:`jgptq.plan.Plan` (:func:`jgptq.plan.resolve`):
    returns (targets less the matrices the plan excludes, plan)."""
    found = [models.layer_targets(layer) for layer in layers]
    n_expert = max([lay.num_experts for t in found for _, lay in t.experts.values()] or [0])
    # query heads per key-value head, of the first layer with softmax attention (a hybrid's first may be linear)
    attn = next((a for a in (getattr(layer, "self_attn", None) for layer in layers) if a is not None), None)
    n_gqa = int(getattr(attn, "num_key_value_groups", 1) or 1)
    plan = plan_mod.resolve(cfg, [plan_mod.Target(m.name, i, m.cols, m.param_name(f"{prefix}.{i}"),
                                                  m.layout is not None)
                                  for i, t in enumerate(found) for m in t.matrices()], len(layers), n_expert, n_gqa)
    targets = [t.without({m.name for m in t.matrices() if m.param_name(f"{prefix}.{i}") in plan.skipped})
               for i, t in enumerate(found)]
    return targets, plan
