"""GPTQ for a whole transformers model, one decoder layer at a time: ``jgptq.quantize_moe``.

Usage::

    import jgptq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-30B-A3B", dtype="bfloat16")
    tok = AutoTokenizer.from_pretrained("Qwen/Qwen3-30B-A3B")
    result = jgptq.quantize_moe(model, texts, tokenizer=tok, bits=4, group_size=128, device="cuda",
                                max_length=2048)
    print(result.report)                   # per-layer losses, expert coverage, fallbacks, seconds per stage
    result.weights["model.layers.0.mlp.experts.5.gate_proj.weight"].codes    # jgptq.export.QuantizedWeight
    jgptq.export_model(model, result, "compressed-tensors", "Qwen3-30B-A3B-w4g128", tokenizer=tok)

Before any work: the config is validated, every target matrix is planned (:func:`jgptq.plan.resolve`: method,
format, exclusions, block fallbacks; bad widths are errors here), the device budget is checked. Then, per decoder
layer (:func:`_layer_step`):

1. calibrate (:func:`jgptq_torch.pipeline.calibrate.calibrate`): the layer runs on every batch with float weights;
   forward hooks and the capture experts implementation (:mod:`jgptq_torch.pipeline.capture`) sum each target's
   input rows into float32 Hessians in JAX (via DLPack, no copies);
2. solve: matrices are grouped by shape and plan, and each bucket is quantized by ONE call of
   :func:`jgptq.bucket.quantize_bucket` (all experts of a shape at once; shared Hessians stay shared; its
   fallbacks are reported);
3. write back: the dequantized weights are copied into the torch parameters in place (same storage and layout);
   the records of ``result.weights`` are made on a worker thread while the next layer runs (``store``);
4. replay: the layer runs again with quantized weights; its outputs are the next layer's inputs.

A MoE layer over the device budget goes through steps 1 and 2 once per chunk of its routed experts, each chunk's
experts written back as it is solved (:mod:`jgptq_torch.pipeline.expert_chunks`); the bytes are the whole layer's.

Around the step, hooks (:mod:`jgptq_torch.pipeline.step` names the points where they are called;
:mod:`jgptq_torch.pipeline.hooks`): the layers' moves (:mod:`jgptq_torch.pipeline.offload`), the state of a
resumable run, written after every layer when ``checkpoint_dir`` is given (:mod:`jgptq_torch.pipeline.resume`),
compiling a new layer's solves ahead (:func:`jgptq_torch.pipeline.solve.warm_solves`), the float model's stream
(:mod:`jgptq_torch.pipeline.float_stream`), the fold of a pre-scaling method before the solve
(:mod:`jgptq_torch.pipeline.prescale`) and a ``sink`` that writes the records as the layers finish.

A ``target_bpw`` run first chooses its formats (:func:`choose_formats`): a first pass of the same layer step over
every layer, with the measurement as its only hook (:class:`jgptq_torch.pipeline.measure.Measure`: each step ends
after its calibration, whose float outputs are the next layer's inputs), then the allocation
(:mod:`jgptq_torch.pipeline.sensitivity`); the run that follows is the one above, under the chosen assignment.

All of a layer's Hessians come from the float layer (its modules are not solved one after the other): this lets
every same-shape matrix of the layer go into a single batched solve, the form that spreads over devices. Error
from earlier layers does propagate (step 4). Written-back weights are the dequantized values cast to the
parameter's dtype; ``result.weights`` keeps the exact codes for exporters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings

import jax
import torch

from jgptq import xla_options
from jgptq.config import PipelineConfig
from jgptq_torch.gpu_sharing import share_gpu_with_torch
from jgptq_torch.pipeline import (
    capture,
    expert_chunks,
    float_stream,
    hooks,
    importance,
    measure,
    prescale,
    run_setup,
    solve,
)
from jgptq_torch.pipeline.calibrate import calibrate
from jgptq_torch.pipeline.inputs import capture_inputs
from jgptq_torch.pipeline.layer_state import run_layer
from jgptq_torch.pipeline.measure import EXPERT_ROW_STRIDE, EXPERT_SHARE
from jgptq_torch.pipeline.run_setup import Run
from jgptq_torch.pipeline.sensitivity import FirstPass, assignment_of
from jgptq_torch.pipeline.step import Hooks, LayerStep
from jgptq_torch.progress import LayerProgress, stage_bar
from jgptq_torch.report import ModuleRecord, QuantizeResult


def quantize_moe(torch_model, calib, config=None, *, tokenizer=None, device=None, devices=None,
                 checkpoint_dir=None, resume: bool = True, imatrix=None, sink=None, source=None,
                 **kwargs) -> QuantizeResult:
    """Quantizes every linear and expert weight of a transformers decoder model with GPTQ, in place.

    Args:
      torch_model: a transformers causal LM (dense or MoE), on any device.
      calib: calibration data (see :mod:`jgptq_torch.pipeline.calib`).
      config: a :class:`jgptq.config.PipelineConfig`, a :class:`jgptq.config.QuantConfig`, or None.
      tokenizer: needed when ``calib`` is text.
      device: torch device each layer runs on (default: the device of the first decoder layer).
      devices: JAX devices for the solves (default: every local device).
      checkpoint_dir: a folder where the run's state is written after every layer (:mod:`jgptq_torch.pipeline.resume`); a
        run started again with the same model, calibration and config continues after its last finished layer
        and gives the same bytes as an uninterrupted run.
      resume: with ``checkpoint_dir``: continue a matching state (a mismatching one raises
        :class:`jgptq.ResumeMismatchError`); False discards any state and starts over.
      imatrix: model parameter name -> :class:`jgptq.imatrix.ImatrixEntry` (e.g. an earlier run's
        ``result.imatrix``): the importance of the GGML encoders comes from it instead of this run's statistic
        (``importance="imatrix"``). Every target weight needs an entry.
      sink: where the records go while the run goes: an :class:`jgptq_torch.export.gguf.stream.GGUFSink` writes the GGUF
        file layer by layer beside the work (``sink.start(model, result)`` before the first layer, ``add`` with
        each layer's records, ``finish(result)`` at the end, its time the report's ``export`` stage; ``abort``
        when the run fails).
      source: a :class:`jgptq_torch.source.stream.StreamedLayers`: the model is its meta skeleton and each
        decoder layer is read from the checkpoint folder when its turn comes (:func:`jgptq.quantize_folder`).
      **kwargs: overrides of config fields (``bits=3``, ``calibration="all_experts"``, ``batch_size=4``,
        ``offload="disk"``, ``offload_dir="layers"``, ``device_budget="40GB"``, ``reload=False``...).
    Returns:
      A :class:`jgptq.QuantizeResult` (model, weights by checkpoint key, report, the importance statistic
      ``imatrix`` by parameter name).
    Raises:
      ValueError: nothing to quantize, zero calibration tokens, a width not divisible by the group size,
        NaN/Inf in a weight to quantize (:class:`jgptq_torch.pipeline.weight_checks.CorruptWeightsError`, naming the weight and
        expert) or in activations, a run over ``device_budget`` (:class:`jgptq.DeviceBudgetError`);
        :class:`jgptq.UnsupportedModelError` for layouts jgptq cannot see into;
        :class:`jgptq.ResumeMismatchError` for a checkpoint of another run.
    """
    share_gpu_with_torch()
    cfg = PipelineConfig.build(config, **kwargs)
    prescale.check_run(cfg, checkpoint_dir, source)
    xla_options.enable_compilation_cache()
    if checkpoint_dir is not None and cfg.keep_hessians:
        raise ValueError("keep_hessians cannot be combined with checkpoint_dir: Hessians are not checkpointed")
    model = torch_model
    allocation = None
    if cfg.target_bpw is not None and not cfg.assignment:   # the formats under the budget: a first pass
        cfg, allocation = choose_formats(model, calib, cfg, tokenizer=tokenizer, device=device, devices=devices,
                                         checkpoint_dir=checkpoint_dir, resume=resume, imatrix=imatrix)
    run = run_setup.prepare(model, calib, cfg, tokenizer, device, devices, imatrix, source)
    run.report.allocation = allocation or {}
    saved = None if checkpoint_dir is None else hooks.Resume.open(run, checkpoint_dir, resume, source)
    # in this order: the sink starts with the restored records; the offload's budget check counts the float
    # stream's inputs; a layer is put back before its state is saved (after_layer unwinds)
    run.hooks = Hooks([saved, None if sink is None else hooks.Sink(sink, checkpointed=saved is not None),
                       float_stream.FloatStream.of(run),
                       prescale.Fold.of(run), hooks.WarmUp(), hooks.Offload()])
    _run_pass(run, 0 if saved is None else saved.done)
    for w in run.report.warnings:
        if w not in run.said:
            warnings.warn(w, stacklevel=2)
    return run.result


def choose_formats(model, calib, cfg, *, tokenizer=None, device=None, devices=None, checkpoint_dir=None,
                   resume: bool = True, imatrix=None, stride: int = EXPERT_ROW_STRIDE,
                   share: int = EXPERT_SHARE) -> tuple:
    """The first pass of a ``target_bpw`` run (:mod:`jgptq_torch.pipeline.sensitivity`): the layer step of every
    layer with the measurement as its hook (:class:`jgptq_torch.pipeline.measure.Measure`), then the allocation.
    Returns (the config with its ``assignment``, the allocation record).

    Args: as :func:`quantize_moe` (``cfg``: a :class:`jgptq.config.PipelineConfig` with ``target_bpw``);
      ``stride``: experts' rows measured one in ``stride`` (0: every matrix solved whole); ``share``:
      grid-search candidates solved on one expert in ``share`` (1: each measured itself).
    Raises:
      ValueError: a budget below every tensor at its cheapest candidate, a matrix no candidate fits.
    """
    first = FirstPass(model, calib, cfg, tokenizer=tokenizer, device=device, devices=devices,
                        imatrix=imatrix, checkpoint_dir=checkpoint_dir, resume=resume, stride=stride,
                      share=share)
    if first.allocation is None:   # not taken over from a resumed run's allocation.json
        measuring = measure.Measure(first.layout.free, first.gains(), stride, share)
        first.run.hooks = Hooks([measuring])
        _run_pass(first.run, 0, desc="jgptq target_bpw pass")
        first.allocate(measuring.costs, measuring.gains)
    return dataclasses.replace(cfg, assignment=assignment_of(first.allocation)), first.allocation


def _run_pass(run: Run, start: int, desc: str = "jgptq layers") -> None:
    """Runs the layers from ``start`` (:func:`_run_layers`; ``desc``: the progress's title) with the model in
    eval mode, without gradients and with the capture experts implementation, then the hooks' ``finish``;
    ``close`` at the end, whatever happens."""
    model = run.result.model
    has_experts = any(t.experts for t in run.targets)
    was_training = model.training
    model.eval()
    error = None
    try:
        with torch.no_grad(), (capture.experts_implementation(model) if has_experts else contextlib.nullcontext()):
            _run_layers(run, start, desc)
        run.hooks.finish(run)
    except BaseException as exc:
        error = exc
        raise
    finally:
        run.stores.close()
        model.train(was_training)
        run.hooks.close(run, error)


def _run_layers(run: Run, start: int, desc: str = "jgptq layers") -> None:
    """Captures the inputs of layer ``start``, then runs :func:`_layer_step` on every layer from there, with the
    run's hooks around it (:mod:`jgptq_torch.pipeline.step`)."""
    n, report = len(run.layers), run.report
    run.hooks.start(run, start)
    if start < n:
        t0 = time.perf_counter()
        source = run.placement.source   # a streamed model: its input embedding is read for the capture only
        with source.embedding(run.device) if source is not None else contextlib.nullcontext():
            run.placement.book()
            hidden, layer_inputs = capture_inputs(run.result.model, run.layers, run.batch_list, run.device)
        hidden = run.hooks.inputs(run, start, hidden, layer_inputs)
        report.add_time(start, "capture", time.perf_counter() - t0)
    progress = LayerProgress(start, n, enabled=run.cfg.progress, desc=desc, eta=True)
    for i in progress:
        run.hooks.before_layer(run, i)
        hidden = _layer_step(run, i, run.layers[i], hidden, layer_inputs, stage=progress.stage)
        run.hooks.after_layer(run, i, hidden)
    run.stores.collect(run.result.weights, report)


def _layer_step(run: Run, i: int, layer, hidden: list, layer_inputs: list, stage=lambda name: None) -> list:
    """One decoder layer: calibrate -> solve, once for the whole layer or once per chunk of its routed experts
    (:class:`jgptq_torch.pipeline.expert_chunks.Passes`), then write back -> replay; each stage named to ``stage``
    as it starts, with the hooks' points inside (:class:`jgptq_torch.pipeline.step.LayerStep`). Returns the next
    layer's inputs."""
    step, passes = LayerStep(i, layer, hidden, layer_inputs, stage), expert_chunks.Passes(run, i)
    for span, target in passes:
        step.begin(span, target)
        run.hooks.before_calibrate(run, step)
        stage("calibrate")
        _calibrate(run, step)
        run.hooks.after_calibrate(run, step)
        if step.next_inputs is not None:   # a pass that measures (target_bpw's first): nothing is solved
            return step.next_inputs
        stage("solve")
        own, stats = importance.pass_statistics(run, step)
        passes.add(run, span, solve.solve_pass(run, step, stats), own)
    solved = passes.joined(run, step.imatrix)
    passes.write_back(run, solved)
    _report(run, step, solved)
    if i == len(run.layers) - 1:
        return hidden
    stage("replay")
    return _replay(run, i, layer, hidden, layer_inputs)


def _calibrate(run: Run, step: LayerStep) -> None:
    """Runs the float layer on every batch with the capture attached (:func:`jgptq_torch.pipeline.calibrate.
    calibrate`) on the pass's targets and experts: the step's Collector, and its outputs when a hook asked for
    them."""
    i, target, cfg = step.index, step.target, run.cfg
    t0 = time.perf_counter()
    chunk = "" if step.span is None else f" experts {step.span[0]}-{step.span[1] - 1}"
    step.collector, step.outputs = calibrate(step.layer, i, target, run.stats, step.hidden,
                                             step.layer_inputs, run.batch_list, span=step.span,
                                             keep_outputs=step.keep_outputs, desc=f"layer {i} calibrate{chunk}",
                                             progress=cfg.progress, partner=step.partner)
    if target.linears or target.experts:
        jax.block_until_ready([s for s in step.collector.states.values()])
        run.placement.note_hessians(step.collector.states)
    run.report.add_time(i, "calibrate", time.perf_counter() - t0)


def _report(run: Run, step: LayerStep, solved: list) -> None:
    """The report's records and warnings of the layer's solved stacks."""
    t0 = time.perf_counter()
    threshold = run.cfg.moe.threshold(step.collector.batch_tokens)
    for m, _, stack, res in solved:
        _record(run.report, step.index, m, stack, res, res.plan.threshold(threshold))
    run.report.add_time(step.index, "solve", time.perf_counter() - t0)


def _replay(run: Run, i: int, layer, hidden: list, layer_inputs: list) -> list:
    """The quantized layer's outputs on every batch: the next layer's inputs."""
    t0 = time.perf_counter()
    out = []
    for b, hs in enumerate(stage_bar(hidden, desc=f"layer {i} replay", enabled=run.cfg.progress)):
        rest, kw = layer_inputs[b][i]
        out.append(run_layer(layer, hs, rest, kw))
    run.report.add_time(i, "replay", time.perf_counter() - t0)
    return out


def _record(report, layer_idx: int, m, stack, res, threshold: int) -> None:
    """The report's records and warnings of one solved stack."""
    fig = res.figures()
    plain = f"a plain {res.plan.format} encode" if res.plan.quant.is_ggml else "round-to-nearest"
    low = []
    for e in range(m.count):
        name = stack.name if m.layout is None else f"{stack.name}[{e}]"
        if res.reason[e] and int(stack.tokens[e]) < threshold:   # the token threshold's fallback
            low.append(e)
        report.records.append(ModuleRecord(
            name=name, layer=layer_idx, kind=m.kind, shape=(m.rows, m.cols), tokens=int(stack.tokens[e]),
            method=res.method[e], reason=res.reason[e], loss=float(fig["loss"][e]),
            damp_used=float(fig["damp_used"][e]), damp_stage=int(fig["damp_stage"][e]),
            fallback=bool(fig["fallback"][e]), dead_columns=int(fig["dead_columns"][e]), hessian=stack.hessian_key,
            format=res.plan.format))
        if fig["fallback"][e]:
            report.warnings.append(f"{name}: no damping made the Hessian positive definite; {plain} used")
    if low:
        what = "module" if m.layout is None else f"experts {low} of"
        report.warnings.append(f"{what} {stack.name}: fewer than {threshold} calibration tokens "
                               f"({[int(stack.tokens[e]) for e in low]}); {plain} used")
