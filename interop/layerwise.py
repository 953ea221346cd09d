"""GPTQ for a whole transformers model, one decoder layer at a time: ``jgptq.quantize_moe``.

Usage::

    import jgptq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-30B-A3B", dtype="bfloat16")
    tok = AutoTokenizer.from_pretrained("Qwen/Qwen3-30B-A3B")
    result = jgptq.quantize_moe(model, texts, tokenizer=tok, bits=4, group_size=128, device="cuda",
                                max_length=2048)
    print(result.report)                   # per-layer losses, expert coverage, fallbacks, seconds per stage
    result.report.to_json("report.json")
    result.weights["model.layers.0.mlp.experts.5.gate_proj.weight"].codes    # jgptq.export.QuantizedWeight

    from interop.export import export_model                 # a checkpoint folder serving stacks load
    export_model(model, result, "compressed-tensors", "Qwen3-30B-A3B-w4g128", tokenizer=tok)

With ``checkpoint_dir="run.state"`` the run's state is written after every layer; started again with the same
arguments after a crash, the run continues from its last finished layer (:mod:`interop.resume`).

``calib`` is token ids, a list of them, a tokenizer's dict, or text with ``tokenizer=`` (:mod:`interop.calib`).
Options are fields of :class:`jgptq.config.PipelineConfig`, :class:`~jgptq.config.QuantConfig` (``bits``,
``group_size``, ``sym``, ``act_order``, ``damp``...) or :class:`~jgptq.config.MoEConfig` (``calibration=
"all_experts"``, ``min_tokens``), given as a config object and/or keywords. ``device`` is where each layer runs
(default: where the model's first layer is). Where the other layers wait is ``offload``: ``"none"`` (where they
are), ``"cpu"`` (host memory) or ``"disk"`` (one file per layer; host memory holds one layer), and
``device_budget="40GB"`` checks each layer's estimated need on the device before any work (:mod:`interop.offload`;
peaks in ``result.report.memory``).

Pipeline, per decoder layer:

1. capture (once): the first layer's inputs and every layer's keyword arguments (position embeddings, masks) are
   recorded by running the model with its layers replaced by recorders (no layer computes);
2. calibrate: the layer runs on every batch with float weights; hooks and the capture experts implementation
   (:mod:`interop.capture`) sum each target's input rows into float32 Hessians in JAX (via DLPack, no copies);
3. solve: targets are grouped by shape and each group is solved by ONE batched call (all experts of a shape at
   once; shared Hessians stay shared); experts with fewer tokens than the threshold get round-to-nearest, with
   a warning and a line in the report;
4. write: the dequantized weights are copied into the torch parameters in place (same storage and layout; fused
   gate/up tensors and transposed layouts written through views); the records of ``result.weights`` (codes and
   scales copied to host memory and checked) are made on a worker thread while the next layer runs (``store``
   in the report: the seconds the pipeline waited for them);
5. replay: the layer runs again with quantized weights; its outputs are the next layer's inputs.

Written-back weights are the dequantized grid values cast to the parameter's dtype (exact in float32; rounded
for bf16/fp16 models); ``result.weights`` keeps the exact codes, scales and zeros for exporters.
``calibration="all_experts"`` runs every expert's gate/up on every token (E/k times the expert FLOPs of a routed
forward) and ties all experts' gate/up to one Hessian.

All of a layer's Hessians come from the float layer (the modules of one layer are not solved one after the
other with earlier ones already quantized): this lets every same-shape matrix of the layer go into a single
batched solve, the form that spreads over devices. Error from earlier layers does propagate (step 5).
"""

from __future__ import annotations

import functools
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import jax
import numpy as np
import torch

from interop import calib as calib_mod
from interop import capture, ggml_plan, models
from interop import offload as offload_mod
from interop import resume as resume_mod
from interop.dlpack import to_jax
from interop.report import ModuleRecord, QuantizeResult, Report
from interop.solve import Part, solve_layer, solve_shapes, warm_solves
from jgptq import statistics
from jgptq.config import PipelineConfig
from jgptq.export.records import QuantizedWeight

try:
    from tqdm.auto import tqdm
except ImportError:  # progress bars are optional
    def tqdm(iterable, **kwargs):
        return iterable


class _StopForward(Exception):
    pass


def _param_device(module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def _to(obj, device, memo: dict):
    if isinstance(obj, torch.Tensor):
        key = id(obj)
        if key not in memo:
            memo[key] = obj.to(device)
        return memo[key]
    if isinstance(obj, tuple):
        return tuple(_to(o, device, memo) for o in obj)
    if isinstance(obj, list):
        return [_to(o, device, memo) for o in obj]
    if isinstance(obj, dict):
        return {k: _to(v, device, memo) for k, v in obj.items()}
    return obj


def capture_inputs(model, layers, batch_list, device):
    """Runs the model once per batch with every decoder layer replaced by a recorder.

    Returns:
      (hidden, layer_inputs): hidden[b] = first-layer input (B, S, H) of batch b on ``device``;
      layer_inputs[b][i] = (positional args after hidden_states, keyword args) of layer i for batch b.
    """
    hidden, inputs = [], []
    current: dict = {}

    def recorder(i):
        def forward(*args, **kwargs):
            if args:
                hs, rest = args[0], args[1:]
            else:
                hs, rest = kwargs.pop("hidden_states"), ()
            current["layers"][i] = _to((rest, kwargs), device, current["memo"])
            if i == 0:
                current["hidden"] = hs.to(device)
            if i == len(layers) - 1:
                raise _StopForward
            return hs
        return forward

    for i, layer in enumerate(layers):
        layer.forward = recorder(i)
    emb = model.get_input_embeddings()
    emb_device = emb.weight.device if emb is not None else _param_device(model)
    try:
        for b in batch_list:
            current.update(layers=[None] * len(layers), memo={}, hidden=None)
            try:
                model(input_ids=b.input_ids.to(emb_device), attention_mask=b.attention_mask.to(emb_device),
                      use_cache=False)
            except _StopForward:
                pass
            if current["hidden"] is None or any(r is None for r in current["layers"]):
                raise models.UnsupportedModelError(
                    f"{type(model).__name__}: the forward did not call every decoder layer in order")
            hidden.append(current["hidden"])
            inputs.append(current["layers"])
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
    return hidden, inputs


def _run_layer(layer, hs, rest, kwargs):
    out = layer(hs, *rest, **kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


def _check_shapes(prefix, targets, quant):
    gs = quant.group_size
    if gs == -1 or quant.is_ggml:  # GGML block sizes: interop.ggml_plan.choose_formats
        return
    for i, t in enumerate(targets):
        dims = [(n, m.in_features) for n, m in t.linears.items()]
        for n, (_, lay) in t.experts.items():
            dims += [(f"{n}.{lay.up_name}", lay.hidden), (f"{n}.down_proj", lay.inter)]
        for n, cols in dims:
            if cols % gs:
                raise ValueError(f"{prefix}.{i}.{n}: {cols} input columns are not a multiple of group_size {gs} "
                                 f"(exclude it with exclude=[...] or choose another group_size)")


def _param_specs(prefix, targets):
    specs = {}
    for i, t in enumerate(targets):
        for n, m in t.linears.items():
            specs[f"{prefix}.{i}.{n}.weight"] = (None, m.out_features, False)
        for n, (_, lay) in t.experts.items():
            specs[f"{prefix}.{i}.{n}.{lay.up_name}"] = (lay.num_experts, lay.up_rows, lay.transposed)
            specs[f"{prefix}.{i}.{n}.down_proj"] = (lay.num_experts, lay.hidden, lay.transposed)
    return specs


def _layer_parts(collector, target, layer_idx, prefix, moe_threshold, cfg=None, formats=None, stats=None):
    """The matrices of one layer with their Hessians, token counts, where their results go, and (GGML formats)
    their format and importance (``stats``: parameter name -> ImatrixEntry used for importance)."""
    parts = []
    base = f"{prefix}.{layer_idx}"

    def ggml(part):
        if formats:
            part.format = formats[part.param]
            part.importance = ggml_plan.importance_of(cfg, stats.get(part.param), part.hessian, part.tokens,
                                                      part.weight.shape[0])
        return part

    for name, module in target.linears.items():
        key = collector.tie.get(name)
        got = collector.hessian(key) if key is not None else None
        h, tokens = (None, 0) if got is None else got
        parts.append(ggml(Part(f"{base}.{name}", "linear", to_jax(module.weight, name=name)[None], h, [tokens],
                               1, f"{base}.{key}" if key else "", param=f"{base}.{name}.weight", module=module)))
    for name, (module, lay) in target.experts.items():
        up = getattr(module, lay.up_name)
        for kind, param, pname in (("expert_gate_up", up, lay.up_name), ("expert_down", module.down_proj,
                                                                        "down_proj")):
            key = (name, "gate_up" if kind == "expert_gate_up" else "down")
            got = collector.hessian(key)
            if got is None:
                h, tokens = None, [0] * lay.num_experts
            else:
                h, tokens = got
                tokens = tokens if isinstance(tokens, list) else [tokens] * lay.num_experts
            w = to_jax(lay.linear(param.detach()), name=f"{name}.{pname}")
            parts.append(ggml(Part(f"{base}.{name}.{pname}", kind, w, h, tokens, moe_threshold,
                                   f"{base}.{name}.{key[1]}", param=f"{base}.{name}.{pname}", module=param,
                                   transposed=lay.transposed)))
    return parts


def _write_back(part, weight):
    """Copies the dequantized float32 (N, R, C) ``weight`` into the part's torch parameter, in place."""
    src = weight
    if part.kind == "linear":
        dst = part.module.weight
        src = src[0]
    else:
        dst = part.module.transpose(1, 2) if part.transposed else part.module
    with torch.no_grad():
        dst.copy_(src.to(device=dst.device, dtype=dst.dtype))


def _store_layer(names, solved, cfg) -> dict:
    """The records of a layer's solved parts, by checkpoint key (see :func:`_store`)."""
    weights: dict = {}
    for part, res in solved:
        _store(weights, names, part, res, cfg)
    return weights


class _Stores:
    """Turns each layer's results into checkpoint records on a worker thread (copies of codes and scales to host
    memory, their checks), while the next layer runs. :meth:`collect` adds the finished records to the run's
    weights in layer order; the seconds it waits go to the report's ``store`` stage."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jgptq-store")
        self._pending: list = []

    def submit(self, layer: int, job) -> None:
        self._pending.append((layer, self._pool.submit(job)))

    def collect(self, weights: dict, report) -> None:
        for layer, job in self._pending:
            t0 = time.perf_counter()
            done = job.result()
            report.add_time(layer, "store", time.perf_counter() - t0)
            weights.update(done)
        self._pending.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()


def _store(weights, names, part, res, cfg):
    """Splits a part's results into checkpoint tensors (per-expert names where the checkpoint has them) as
    :class:`jgptq.export.QuantizedWeight` records (:class:`jgptq.export.GGMLWeight` for GGML formats)."""
    if res.format:
        ggml_plan.store_ggml(weights, names, part, res)
        return
    q = cfg.quant
    codes, scales, zeros, g_idx = (np.asarray(a) for a in (res.codes, res.scales, res.zeros, res.g_idx))
    common = dict(bits=q.bits, group_size=q.group_size, sym=q.sym, act_order=q.act_order, scale_dtype=q.scale_dtype,
                  transposed=part.transposed)
    for key, expert, rows in names[part.param]:
        if part.kind == "linear" or expert is not None:
            e, at = 0 if expert is None else expert, models.row_index(rows)
            weights[key] = QuantizedWeight(codes[e][at], scales[e][at], zeros[e][at], g_idx[e],
                                           method=res.method[e], **common)
        else:
            n, r = codes.shape[:2]
            if not np.array_equal(rows.numpy(), np.arange(n * r)):
                raise models.UnsupportedModelError(f"{key}: checkpoint rows of a fused key are reordered")
            methods = set(res.method)
            weights[key] = QuantizedWeight(codes, scales, zeros, g_idx,
                                           method=methods.pop() if len(methods) == 1 else "mixed", **common)


def quantize_moe(torch_model, calib, config=None, *, tokenizer=None, device=None, devices=None,
                 checkpoint_dir=None, resume: bool = True, imatrix=None, **kwargs) -> QuantizeResult:
    """Quantizes every linear and expert weight of a transformers decoder model with GPTQ, in place.

    Args:
      torch_model: a transformers causal LM (dense or MoE), on any device.
      calib: calibration data (see :mod:`interop.calib`).
      config: a :class:`jgptq.config.PipelineConfig`, a :class:`jgptq.config.QuantConfig`, or None.
      tokenizer: needed when ``calib`` is text.
      device: torch device each layer runs on (default: the device of the first decoder layer).
      devices: JAX devices for the solves (passed on to the multi-device solver; None = default device).
      checkpoint_dir: a folder where the run's state is written after every layer (:mod:`interop.resume`); a
        run started again with the same model, calibration and config continues after its last finished layer
        and gives the same bytes as an uninterrupted run.
      resume: with ``checkpoint_dir``: continue a matching state (a mismatching one raises
        :class:`interop.resume.ResumeMismatchError`); False discards any state and starts over.
      imatrix: model parameter name -> :class:`jgptq.imatrix.ImatrixEntry` (e.g. an earlier run's
        ``result.imatrix``): the importance of the GGML encoders comes from it instead of this run's statistic
        (``importance="imatrix"``). Every target weight needs an entry.
      **kwargs: overrides of config fields (``bits=3``, ``calibration="all_experts"``, ``batch_size=4``,
        ``offload="disk"``, ``offload_dir="layers"``, ``device_budget="40GB"``, ``reload=False``...).
    Returns:
      A :class:`interop.report.QuantizeResult` (model, weights by checkpoint key, report, the importance
      statistic ``imatrix`` by parameter name).
    Raises:
      ValueError: nothing to quantize, zero calibration tokens, a width not divisible by the group size,
        NaN/Inf activations, a run over ``device_budget`` (:class:`interop.offload.DeviceBudgetError`);
        ``interop.models.UnsupportedModelError`` for layouts jgptq cannot see into;
        ``interop.resume.ResumeMismatchError`` for a checkpoint of another run.
    """
    cfg = PipelineConfig.build(config, **kwargs)
    if checkpoint_dir is not None and cfg.keep_hessians:
        raise ValueError("keep_hessians cannot be combined with checkpoint_dir: Hessians are not checkpointed")
    model = torch_model
    prefix, layers = models.find_decoder_layers(model)
    targets = [models.layer_targets(layer, cfg.exclude) for layer in layers]
    if not any(t.linears or t.experts for t in targets):
        raise ValueError(f"{type(model).__name__}: nothing to quantize (no linear or experts weights in "
                         f"{prefix} after exclusions {list(cfg.exclude)})")
    _check_shapes(prefix, targets, cfg.quant)
    formats, format_notes = ggml_plan.choose_formats(prefix, targets, cfg) if cfg.quant.is_ggml else ({}, [])
    if imatrix is not None:
        ggml_plan.check_imatrix(imatrix, prefix, targets)
    names = models.checkpoint_names(model, _param_specs(prefix, targets))
    batch_list = calib_mod.batches(calib, tokenizer=tokenizer, batch_size=cfg.batch_size,
                                   max_length=cfg.max_length)
    n_tokens = calib_mod.token_count(batch_list)
    run_device = offload_mod.run_device(device, layers[0])
    placement = offload_mod.Placement(model, layers, cfg, run_device)
    activations = offload_mod.hidden_bytes(model, batch_list) * 2  # a layer's inputs and outputs coexist
    placement.check([offload_mod.layer_need(layer, t, activations, cfg.moe.calibration == "all_experts")
                     for layer, t in zip(layers, targets)])      # before any work: over budget is an error
    report = Report(config=cfg.to_dict(), model=type(model).__name__, calibration_tokens=n_tokens)
    report.skipped = [(f"{prefix}.{i}.{n}", why) for i, t in enumerate(targets) for n, why in t.skipped]
    report.warnings.extend(format_notes)
    said = set()
    slow = models.slow_linear_attention(model, run_device)
    if slow:  # said once, before the first forward, with the fix; kept in the report
        warnings.warn(slow, stacklevel=2)
        report.warnings.append(slow)
        said.add(slow)
    result = QuantizeResult(model, {}, report, config=cfg,
                            param_keys={p: [k for k, _, _ in rows] for p, rows in names.items()})
    ckpt, start = None, 0
    if checkpoint_dir is not None:
        ckpt = resume_mod.Checkpoint(checkpoint_dir, resume_mod.fingerprint(model, batch_list, cfg, len(layers),
                                                                            imatrix=imatrix), resume=resume)
        start = ckpt.open()
        for i in range(start):
            resume_mod.restore_layer(ckpt, i, targets[i], prefix, names, result)
    has_experts = any(t.experts for t in targets)
    stores, warmed = _Stores(), set()
    was_training = model.training
    model.eval()
    failed = True
    try:
        with torch.no_grad(), (capture.experts_implementation(model) if has_experts else _null()):
            if start < len(layers):
                placement.prepare()
                t0 = time.perf_counter()
                hidden, layer_inputs = capture_inputs(model, layers, batch_list, run_device)
                if start:
                    hidden = ckpt.load_hidden(start, run_device)
                report.add_time(start, "capture", time.perf_counter() - t0)
                placement.check_activations(offload_mod.captured_bytes(hidden, layer_inputs, run_device))
            bar = tqdm(range(start, len(layers)), desc="jgptq layers", disable=not cfg.progress, initial=start,
                       total=len(layers))
            for i in bar:
                t0 = time.perf_counter()
                layer = placement.fetch(i)
                if placement.moves:
                    report.add_time(i, "offload", time.perf_counter() - t0)
                marks, before = (len(report.records), len(report.warnings)), set(result.weights)
                last = i == len(layers) - 1
                hidden = _process_layer(i, layer, targets[i], hidden, layer_inputs, batch_list, names, cfg,
                                        prefix, report, result, devices, last=last, placement=placement,
                                        formats=formats, given=imatrix, stores=stores, warmed=warmed)
                t0 = time.perf_counter()
                placement.put_back(i)
                if placement.moves:
                    report.add_time(i, "offload", time.perf_counter() - t0)
                if ckpt is not None:
                    stores.collect(result.weights, report)
                    ckpt.save_layer(i, {k: v for k, v in result.weights.items() if k not in before},
                                    resume_mod.report_part(report, i, prefix, marks), None if last else hidden,
                                    ggml_plan.layer_entries(result.imatrix, prefix, i, targets[i]))
            stores.collect(result.weights, report)
        failed = False
    except BaseException as exc:
        note = placement.failure_note()
        if note:
            exc.add_note(note)
        raise
    finally:
        stores.close()
        model.train(was_training)
        _finish(placement, failed)
    report.memory = placement.memory
    for w in report.warnings:
        if w not in said:
            warnings.warn(w, stacklevel=2)
    return result


def _finish(placement, failed: bool) -> None:
    """Ends the placement; after a failure, an error of its own is only warned about (the run's error stands)."""
    if not failed:
        placement.finish(False)
        return
    try:
        placement.finish(True)
    except Exception as exc:  # noqa: BLE001 - the original error is the one to raise
        warnings.warn(f"after the run's error, the offloaded layers could not be loaded back ({exc}); "
                      f"{placement.memory.get('offload_dir', '')} holds them", stacklevel=3)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _process_layer(i, layer, target, hidden, layer_inputs, batch_list, names, cfg, prefix, report, result,
                   devices, last, placement=None, formats=None, given=None, stores=None, warmed=None):
    show = cfg.progress
    warm = None
    if warmed is not None:
        shapes = solve_shapes(target)
        if not shapes <= warmed:  # a layer of new shapes: its solve programs compile beside the calibration
            warm = warm_solves(target, cfg, devices=devices)
            warmed.update(shapes)
    collector = capture.Collector(target.linears, target.experts, statistics.calibration(
        cfg.hessian_dtype, all_experts=cfg.moe.calibration == "all_experts"))
    t0 = time.perf_counter()
    if target.linears or target.experts:
        with collector.attach():
            for b, batch in enumerate(tqdm(batch_list, desc=f"layer {i} calibrate", leave=False, disable=not show)):
                rest, kw = layer_inputs[b][i]
                with collector.batch(batch.attention_mask.to(hidden[b].device)):
                    _run_layer(layer, hidden[b], rest, kw)
        jax.block_until_ready([s for s in collector.states.values()])
        if placement is not None:
            placement.note_hessians(collector.states)
    report.add_time(i, "calibrate", time.perf_counter() - t0)

    t0 = time.perf_counter()
    layer_tokens = collector.batch_tokens
    threshold = cfg.moe.threshold(layer_tokens)
    stats = ggml_plan.layer_imatrix(collector, prefix, i, target)
    result.imatrix.update(stats)
    parts = _layer_parts(collector, target, i, prefix, threshold, cfg, formats,
                         stats if given is None else given)
    for name, counts in collector.routed.items():
        full = f"{prefix}.{i}.{name}"
        if layer_tokens and not sum(counts):
            raise models.UnsupportedModelError(f"{full}: the experts forward never reached jgptq's capture "
                                               f"implementation; its routed tokens cannot be seen")
        report.coverage[full] = list(counts)
        report.thresholds[full] = threshold
    if cfg.keep_hessians:
        for key in collector.states:
            result.hessians[(i, key)] = collector.hessian(key)
    if warm is not None:
        warm.join()
    solved = solve_layer(parts, cfg, devices=devices)
    collector.release()
    report.add_time(i, "solve", time.perf_counter() - t0)

    t0 = time.perf_counter()
    kept = []
    for part, res in solved:
        _write_back(part, res.weight)
        _record(report, part, res, i, cfg)
        # what the records need, without the Hessians and dequantized weights (freed with this layer)
        kept.append((SimpleNamespace(param=part.param, kind=part.kind, transposed=part.transposed),
                     res._replace(weight=None)))
    del solved
    if stores is None:
        result.weights.update(_store_layer(names, kept, cfg))
    else:
        stores.submit(i, functools.partial(_store_layer, names, kept, cfg))
    report.add_time(i, "write", time.perf_counter() - t0)

    if last:
        return hidden
    t0 = time.perf_counter()
    out = []
    for b, hs in enumerate(tqdm(hidden, desc=f"layer {i} replay", leave=False, disable=not show)):
        rest, kw = layer_inputs[b][i]
        out.append(_run_layer(layer, hs, rest, kw))
    report.add_time(i, "replay", time.perf_counter() - t0)
    return out


def _record(report, part, res, layer_idx, cfg):
    loss, damp, stage = (np.asarray(a).tolist() for a in (res.loss, res.damp_used, res.damp_stage))
    fallback, dead = np.asarray(res.fallback).tolist(), np.asarray(res.dead_columns).tolist()
    n, r, c = part.weight.shape
    plain = f"a plain {res.format} encode" if res.format else "round-to-nearest"
    low = []
    for e in range(n):
        name = part.name if part.kind == "linear" else f"{part.name}[{e}]"
        reason = res.reason[e]
        if reason and cfg.method == "gptq":
            low.append(e)
        report.records.append(ModuleRecord(
            name=name, layer=layer_idx, kind=part.kind, shape=(r, c), tokens=int(part.tokens[e]),
            method=res.method[e], reason=reason, loss=float(loss[e]), damp_used=float(damp[e]),
            damp_stage=int(stage[e]), fallback=bool(fallback[e]), dead_columns=int(dead[e]), hessian=part.hkey,
            format=res.format or "int"))
        if fallback[e]:
            report.warnings.append(f"{name}: no damping made the Hessian positive definite; {plain} used")
    if low:
        what = "module" if part.kind == "linear" else f"experts {low} of"
        report.warnings.append(f"{what} {part.name}: fewer than {part.threshold} calibration tokens "
                               f"({[int(part.tokens[e]) for e in low]}); {plain} used")
