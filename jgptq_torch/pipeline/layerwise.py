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

1. calibrate: the layer runs on every batch with float weights; hooks and the capture experts implementation
   (:mod:`jgptq_torch.pipeline.capture`) sum each target's input rows into float32 Hessians in JAX (via DLPack, no copies);
2. solve: matrices are grouped by shape and plan, and each bucket is quantized by ONE call of
   :func:`jgptq.bucket.quantize_bucket` (all experts of a shape at once; shared Hessians stay shared; its
   fallbacks are reported);
3. write back: the dequantized weights are copied into the torch parameters in place (same storage and layout);
   the records of ``result.weights`` are made on a worker thread while the next layer runs (``store``);
4. replay: the layer runs again with quantized weights; its outputs are the next layer's inputs.

Around the step, small hooks: layer moves (:mod:`jgptq_torch.pipeline.offload`), compiling a new layer's solves ahead
(:func:`jgptq_torch.pipeline.solve.warm_solves`) and the state of a resumable run (:mod:`jgptq_torch.pipeline.resume`), written after every
layer when ``checkpoint_dir`` is given.

All of a layer's Hessians come from the float layer (its modules are not solved one after the other): this lets
every same-shape matrix of the layer go into a single batched solve, the form that spreads over devices. Error
from earlier layers does propagate (step 4). Written-back weights are the dequantized values cast to the
parameter's dtype; ``result.weights`` keeps the exact codes for exporters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import warnings

import jax
import torch

from jgptq_torch.pipeline import capture
from jgptq_torch.pipeline import float_stream
from jgptq_torch.pipeline import importance
from jgptq_torch import models
from jgptq_torch.pipeline import run_setup
from jgptq_torch.pipeline import offload as offload_mod
from jgptq_torch.pipeline import resume as resume_mod
from jgptq_torch.pipeline import weight_checks
from jgptq_torch.dlpack import to_torch
from jgptq_torch.gpu_sharing import share_gpu_with_torch
from jgptq_torch.pipeline.inputs import capture_inputs, run_layer
from jgptq_torch.report import ModuleRecord, QuantizeResult
from jgptq_torch.pipeline.solve import layer_stacks, solve_layer, solve_shapes, warm_solves
from jgptq_torch.progress import LayerProgress, stage_bar
from jgptq.surface import option
from jgptq_torch.pipeline.run_setup import Run
from jgptq import statistics, xla_options
from jgptq.config import PipelineConfig


SINK_SWITCH_INTERVAL = 5e-4   # seconds: Python's thread switch interval while a sink writes beside the run


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
    xla_options.enable_compilation_cache()
    if checkpoint_dir is not None and cfg.keep_hessians:
        raise ValueError("keep_hessians cannot be combined with checkpoint_dir: Hessians are not checkpointed")
    model = torch_model
    allocation = None
    if cfg.target_bpw is not None and not cfg.assignment:   # the formats under the budget: a first pass
        from jgptq_torch.pipeline.sensitivity import choose

        cfg, allocation = choose(model, calib, cfg, tokenizer=tokenizer, device=device, devices=devices,
                                 checkpoint_dir=checkpoint_dir, resume=resume, imatrix=imatrix)
    run = run_setup.prepare(model, calib, cfg, tokenizer, device, devices, imatrix, source)
    run.report.allocation = allocation or {}
    ckpt, start = None, 0
    if checkpoint_dir is not None:
        digest = source.source.fingerprint() if source is not None else None
        ckpt = resume_mod.Checkpoint(checkpoint_dir, resume_mod.fingerprint(model, run.batch_list, cfg,
                                                                            len(run.layers), imatrix=imatrix,
                                                                            model_digest=digest),
                                     resume=resume)
        start = ckpt.open()
        if start and cfg.progress:   # said once the state is known to match, never before a refusal
            print(f"jgptq: continuing the run whose state is in {checkpoint_dir} ({start} layers done; "
                  f"{option('no_resume')} starts over)", file=sys.stderr, flush=True)
        for i in range(start):
            resume_mod.restore_layer(ckpt, i, run.targets[i], run.prefix, run.names, run.result)
    has_experts = any(t.experts for t in run.targets)
    was_training = model.training
    model.eval()
    failed = True
    interval = sys.getswitchinterval()
    try:
        if sink is not None:
            sink.start(model, run.result)
            run.stores.sink = sink
            # a sink that writes the records as they come (a checkpoint folder): the run does not keep them (with
            # a resume state, each layer's are saved first, then dropped)
            run.stores.keep_records = ckpt is not None or not getattr(sink, "releases_records", False)
            # The writer thread holds Python's lock between its file writes; at the default 5 ms switch interval
            # each of the many short waits of the thread that drives the GPU could cost up to 5 ms (on the H200,
            # 0.06 s a layer of a 30B MoE model's solve).
            sys.setswitchinterval(min(interval, SINK_SWITCH_INTERVAL))
        with torch.no_grad(), (capture.experts_implementation(model) if has_experts else contextlib.nullcontext()):
            _run_layers(run, ckpt, start)
        if sink is not None:
            t0 = time.perf_counter()
            sink.finish(run.result)
            run.report.add_time(max(len(run.layers) - 1, 0), "export", time.perf_counter() - t0)
        failed = False
    except BaseException as exc:
        if sink is not None:
            sink.abort()
        note = run.placement.failure_note()
        if note:
            exc.add_note(note)
        raise
    finally:
        sys.setswitchinterval(interval)
        run.stores.close()
        model.train(was_training)
        run_setup.finish(run.placement, failed)
    run.report.memory = run.placement.memory
    for w in run.report.warnings:
        if w not in run.said:
            warnings.warn(w, stacklevel=2)
    return run.result


def _run_layers(run: Run, ckpt, start: int) -> None:
    """Captures the layers' inputs, then runs :func:`_layer_step` on every layer from ``start``, with the moves
    and the resumable state around it."""
    n, report, placement = len(run.layers), run.report, run.placement
    if start < n:
        placement.prepare()
        t0 = time.perf_counter()
        source = placement.source   # a streamed model: its input embedding is read for the capture only
        with source.embedding(run.device) if source is not None else contextlib.nullcontext():
            placement.book()
            hidden, layer_inputs = capture_inputs(run.result.model, run.layers, run.batch_list, run.device)
        if start:
            hidden = ckpt.load_hidden(start, run.device)
        if float_stream.enabled(run.cfg, run.given):
            run.float_hidden = ckpt.load_hidden(start, run.device, stream="float") if start else hidden
        report.add_time(start, "capture", time.perf_counter() - t0)
        placement.check_activations(offload_mod.captured_bytes(hidden, layer_inputs, run.device)
                                    + (0 if run.float_hidden is None else offload_mod.nbytes(hidden)))
    progress = LayerProgress(start, n, enabled=run.cfg.progress, eta=True)
    for i in progress:
        layer = _timed_move(run, i, placement.fetch)
        if placement.source is not None:   # a streamed layer's weights exist only now: NaN/Inf named before work
            weight_checks.check_finite_weights(run.targets[i:i + 1], run.prefix, first=i)
        marks, before = (len(report.records), len(report.warnings)), set(run.result.weights)
        hidden = _layer_step(run, i, layer, hidden, layer_inputs, stage=progress.stage)
        _timed_move(run, i, placement.put_back)
        if ckpt is not None:
            run.stores.collect(run.result.weights, report)
            ckpt.save_layer(i, {k: v for k, v in run.result.weights.items() if k not in before},
                            resume_mod.report_part(report, i, run.prefix, marks), None if i == n - 1 else hidden,
                            importance.layer_entries(run.result.imatrix, run.prefix, i, run.targets[i]),
                            None if i == n - 1 else run.float_hidden)
        if ckpt is not None and getattr(run.stores.sink, "releases_records", False):
            run.result.weights.clear()      # in the resume state and handed to the sink: not kept in memory
    run.stores.collect(run.result.weights, report)


def _timed_move(run: Run, i: int, move):
    t0 = time.perf_counter()
    out = move(i)
    if run.placement.moves:
        run.report.add_time(i, "offload", time.perf_counter() - t0)
    return out


def _layer_step(run: Run, i: int, layer, hidden: list, layer_inputs: list, stage=lambda name: None) -> list:
    """One decoder layer: calibrate -> solve -> write back -> replay, each named to ``stage`` as it starts.
    Returns the next layer's inputs."""
    target = run.targets[i]
    stage("compile")
    warm = _warm_up(run, target)
    stage("calibrate")
    # the float stream's inputs are this run's (the first layer): the calibration forward serves both
    shared = run.float_hidden is hidden and bool(target.linears or target.experts)
    outputs = [] if shared and i < len(run.layers) - 1 else None
    collector = _calibrate(run, i, layer, hidden, layer_inputs, outputs)
    imatrix_from = collector
    if run.float_hidden is not None:
        stage("float")
        imatrix_from = collector if shared else float_stream.float_pass(run, i, layer, layer_inputs)
        if shared:
            run.float_hidden = outputs
    stage("solve")
    solved = _solve(run, i, collector, warm, imatrix_from)
    _write_back(run, i, solved)
    if i == len(run.layers) - 1:
        return hidden
    stage("replay")
    return _replay(run, i, layer, hidden, layer_inputs)


def _warm_up(run: Run, target):
    """A layer of new shapes: its solve programs compile beside its calibration (a thread, or None)."""
    shapes = solve_shapes(target)
    if shapes <= run.warmed:
        return None
    run.warmed.update(shapes)
    return warm_solves(target, run.cfg, devices=run.devices)


def _calibrate(run: Run, i: int, layer, hidden: list, layer_inputs: list, outputs: list = None):
    """Runs the float layer on every batch with the capture attached; returns the filled Collector (the layer's
    outputs are appended to ``outputs`` when it is a list)."""
    target, cfg = run.targets[i], run.cfg
    collector = capture.Collector(target.linears, target.experts, statistics.calibration(
        cfg.hessian_dtype, all_experts=cfg.moe.calibration == "all_experts"))
    t0 = time.perf_counter()
    if target.linears or target.experts:
        with collector.attach():
            for b, batch in enumerate(stage_bar(run.batch_list, desc=f"layer {i} calibrate", enabled=cfg.progress)):
                rest, kw = layer_inputs[b][i]
                with collector.batch(batch.attention_mask.to(hidden[b].device)):
                    out = run_layer(layer, hidden[b], rest, kw)
                if outputs is not None:
                    outputs.append(out)
        jax.block_until_ready([s for s in collector.states.values()])
        run.placement.note_hessians(collector.states)
    run.report.add_time(i, "calibrate", time.perf_counter() - t0)
    return collector


def _solve(run: Run, i: int, collector, warm, imatrix_from=None) -> list:
    """The layer's importance statistic (from ``imatrix_from``, default ``collector``), expert coverage and one
    quantize call per bucket."""
    t0 = time.perf_counter()
    target, base, report = run.targets[i], f"{run.prefix}.{i}", run.report
    threshold = run.cfg.moe.threshold(collector.batch_tokens)
    stats = importance.layer_imatrix(imatrix_from or collector, run.prefix, i, target)
    run.result.imatrix.update(stats)
    stacks = layer_stacks(collector, target, base, run.plan, run.cfg, stats if run.given is None else run.given)
    for name, counts in collector.routed.items():
        if collector.batch_tokens and not sum(counts):
            raise models.UnsupportedModelError(f"{base}.{name}: the experts forward never reached jgptq's capture "
                                               f"implementation; its routed tokens cannot be seen")
        report.coverage[f"{base}.{name}"] = list(counts)
        report.thresholds[f"{base}.{name}"] = threshold
    if run.cfg.keep_hessians:
        for key in collector.states:
            run.result.hessians[(i, key)] = collector.hessian(key)
    if warm is not None:
        warm.join()
    solved = solve_layer(stacks, run.plan, threshold, devices=run.devices)
    collector.release()
    for m, _, stack, res in solved:
        _record(report, i, m, stack, res, res.plan.threshold(threshold))
    report.add_time(i, "solve", time.perf_counter() - t0)
    return solved


def _write_back(run: Run, i: int, solved: list) -> None:
    """Copies the dequantized weights into the torch parameters in place; the records are made beside the next
    layer."""
    t0 = time.perf_counter()
    with torch.no_grad():
        for m, _, _, res in solved:
            dst = m.weight()
            dst.copy_(to_torch(res.weight, name=m.name).to(device=dst.device, dtype=dst.dtype))
    run.stores.submit(i, run.names, [(m, param, dataclasses.replace(res, weight=None))
                                     for m, param, _, res in solved])
    run.report.add_time(i, "write", time.perf_counter() - t0)


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
