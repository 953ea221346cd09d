"""The fold step of a pre-scaling method (:mod:`jgptq.methods.awq`): per-input-channel scales chosen by jgptq,
multiplied into every reader of an input and divided out of its producer, so the float layer is unchanged.

:class:`Fold` is the layer step's hook (:mod:`jgptq_torch.pipeline.step`) of a run whose plan has a
pre-scaling method; per decoder layer, before the solve (its ``before_solve``):

1. producers and readers are found from the layer itself, by one float forward on the first batch with hooks on
   every submodule: a producer is a normalization module (a leaf whose parameters are 1-D vectors of the hidden
   width: RMSNorm's weight, LayerNorm's weight and bias); its readers are the leaf modules whose input is a view
   of its output (same storage, offset and size). A producer is folded only when every reader is a linear module
   (a target, a router or an excluded one: all get their columns scaled, routers and excluded ones staying float)
   or a fused-experts module whose up (gate/up) projection is a target; otherwise, or where no reader is a
   target, its readers keep ``s = 1`` and the report says why;
2. each folded producer's scales come from :func:`jgptq.methods.awq.search` over its target readers' weights and
   Hessians; the readers' columns are multiplied by ``s`` and the producer's vectors divided by it, in place;
3. the float layer runs again on the first batch: an output that moved (a reader the hooks could not see, e.g.
   a functional use of the norm's output, or a norm that is not ``weight * normalized(x)``) undoes every fold of
   the layer, reported as a warning;
4. the scales go to the step (:attr:`jgptq_torch.pipeline.step.LayerStep.scales`), whose solve stacks get the
   scaled Hessians ``diag(s)^-1 H diag(s)^-1`` (:func:`jgptq_torch.pipeline.solve.layer_stacks`; their weights,
   read from the model, are already scaled).

A down projection (whose producer is an elementwise product inside the MLP, not a module) and an attention
output projection keep ``s = 1``; so does a layer whose routed experts are solved in chunks.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from jgptq import methods
from jgptq.methods import awq
from jgptq_torch import models
from jgptq_torch.dlpack import to_jax, to_torch
from jgptq_torch.pipeline.layer_state import run_layer
from jgptq_torch.pipeline.step import Hook, LayerStep

log = logging.getLogger(__name__)

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}   # relative change of the layer's output; others: 2e-2


class Fold(Hook):
    """The fold of a run whose plan pre-scales some matrices: before each pass's solve, :func:`fold_layer` on the
    calibrated layer, its scales handed to the step (:attr:`jgptq_torch.pipeline.step.LayerStep.scales`)."""

    @classmethod
    def of(cls, run):
        """The hook for ``run``, or None where no planned matrix's method pre-scales."""
        return cls() if prescaling(run.plan, run.plan.matrices) else None

    def before_solve(self, run, step: LayerStep) -> None:
        step.scales = fold_layer(run, step, f"{run.prefix}.{step.index}")


def prescaling(plan, params) -> dict:
    """Parameter name -> the :class:`jgptq.methods.awq.PreScale` of its method, for the ``params`` whose planned
    method pre-scales."""
    out = {}
    for p in params:
        pre = getattr(methods.get(plan.matrices[p].method), "prescale", None)
        if pre is not None:
            out[p] = pre
    return out


def _key(t: torch.Tensor):
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)


def _is_norm(module: nn.Module, width: int) -> bool:
    params = list(module.parameters(recurse=False))
    return (not list(module.children()) and bool(params)
            and all(p.ndim == 1 and p.shape[0] == width for p in params))


def _linear_reader(module: nn.Module, width: int) -> bool:
    """A module read as a matrix product over its input's columns: nn.Linear, or a leaf whose ``weight`` is 2-D
    over them (a router's ``F.linear(x, weight)``; the float check after the fold tells where that guess is
    wrong)."""
    w = getattr(module, "weight", None)
    return isinstance(module, nn.Linear) or (not list(module.children()) and isinstance(w, torch.Tensor)
                                              and w.ndim == 2 and w.shape[1] == width)


def find_producers(layer: nn.Module, hidden: torch.Tensor, rest, kw) -> dict:
    """Producer module name -> [its readers' module names] (see the module docstring), from one float forward of
    ``layer`` on ``hidden`` (B, S, H)."""
    width = hidden.shape[-1]
    outputs, inputs, handles, alive = {}, {}, [], []   # tensors kept alive: no storage is reused in the forward
    names = {id(m): n for n, m in layer.named_modules() if n}

    def on_output(module, args, out):
        if isinstance(out, torch.Tensor) and _is_norm(module, width):
            alive.append(out)
            outputs.setdefault(_key(out), names[id(module)])

    def on_input(module, args):
        if args and isinstance(args[0], torch.Tensor) and (
                not list(module.children()) or models.is_experts_module(module) or models.is_stacked(module)):
            alive.append(args[0])
            inputs.setdefault(names[id(module)], _key(args[0]))

    try:
        for n, m in layer.named_modules():
            if n:
                handles.append(m.register_forward_hook(on_output))
                handles.append(m.register_forward_pre_hook(on_input))
        run_layer(layer, hidden, rest, kw)
    finally:
        for h in handles:
            h.remove()
    out = {}
    for key, producer in outputs.items():
        readers = [n for n, k in inputs.items() if k == key]
        if readers:
            out[producer] = readers
    return out


def fold_layer(run, step, base: str) -> dict:
    """Searches and folds the scales of one calibrated decoder layer (see the module docstring).

    Args:
      run: the run (plan, report, config); step: the :class:`jgptq_torch.pipeline.step.LayerStep` after its
        calibration (layer, inputs, collector, targets).
      base: the layer's qualified name.
    Returns:
      Hessian key of the collector (as :func:`jgptq_torch.pipeline.solve.layer_stacks` reads it) -> scale (C,)
      of every target matrix whose input was scaled (the ``scales`` of ``layer_stacks``).
    """
    layer, target, collector, report = step.layer, step.target, step.collector, run.report
    params = {m.param_name(base): m for m in target.matrices()}
    pre = prescaling(run.plan, params)
    if not pre:
        return {}
    if step.span is not None:
        report.warnings.append(f"{base}: routed experts solved in chunks; awq scales left at 1 in this layer")
        return {}
    rest, kw = step.layer_inputs[0][step.index]
    hidden = step.hidden[0]
    before = run_layer(layer, hidden, rest, kw)
    producers = find_producers(layer, hidden, rest, kw)
    modules = dict(layer.named_modules())
    by_module = {}
    for p, m in params.items():
        if m.kind in ("linear", "expert_gate_up", "expert_stack"):
            by_module[m.module_name] = (p, m)
    undo, scales, groups = [], {}, report.prescale.setdefault(base, {})
    covered = set()
    for producer, readers in producers.items():
        targets = [by_module[r] for r in readers if r in by_module and by_module[r][0] in pre]
        covered.update(r for r in readers if r in by_module)
        odd = [r for r in readers if r not in by_module and not _linear_reader(modules[r], hidden.shape[-1])]
        if not targets:
            continue
        if odd:
            groups[producer] = {"readers": readers, "alpha": None, "reason": f"read by {odd} as well"}
            continue
        other = [r for r in readers if r in by_module and by_module[r][0] not in pre]
        if other:   # their solve would get scaled weights with an unscaled Hessian
            groups[producer] = {"readers": readers, "alpha": None, "reason": f"{other} planned with another method"}
            continue
        members, hs, tokens = [], [], []
        for _, m in targets:
            key = collector.tie.get(m.hessian_key) if m.layout is None else m.hessian_key
            got = None if key is None else collector.hessian(key)
            if got is None:
                break
            members.append((to_jax(m.weight(), name=m.name), got[0]))
            hs.append(got[0])
            tokens.append(got[1])
        if len(members) < len(targets):
            groups[producer] = {"readers": readers, "alpha": None, "reason": "a reader was never calibrated"}
            continue
        choice = awq.search(members, awq.mean_square_of(hs, tokens), run.plan.matrices[targets[0][0]].quant,
                            pre[targets[0][0]].alphas)
        groups[producer] = {"readers": readers, "alpha": choice.alpha, "priced": choice.errors.tolist()}
        if choice.alpha == 0.0:
            continue
        s = to_torch(choice.scale, name=producer)
        undo += _fold(modules, producer, readers, params, by_module, s)
        for _, m in targets:
            scales[collector.tie.get(m.hessian_key) if m.layout is None else m.hessian_key] = choice.scale
    for p, m in params.items():   # o_proj, down projections (their inputs are products inside the block)
        if p in pre and not (m.module_name in covered and m.kind != "expert_down"):
            groups.setdefault(m.name, {"readers": [m.module_name], "alpha": None,
                                       "reason": "no normalization module produces its input"})
    if undo:
        after = run_layer(layer, hidden, rest, kw)
        change = float((after.float() - before.float()).abs().max() / before.float().abs().max().clamp_min(1e-30))
        if change > TOLERANCE.get(before.dtype, 2e-2):
            for tensor, saved in reversed(undo):
                tensor.copy_(saved)
            report.warnings.append(f"{base}: the folded scales changed the float layer's output by {change:.3g} "
                                   f"(relative); awq scales left at 1 in this layer")
            for g in groups.values():
                if g.get("alpha"):
                    g["reason"], g["alpha"] = f"undone: float output moved by {change:.3g}", None
            return {}
    return scales


def _fold(modules, producer, readers, params, by_module, s) -> list:
    """Multiplies every reader's input columns by ``s`` and divides the producer's vectors by it, in place;
    returns (tensor, its former value) pairs."""
    undo = []

    def scale(t: torch.Tensor, factor: torch.Tensor):
        undo.append((t, t.detach().clone()))
        t.copy_((t.float() * factor.to(t.device).reshape((1,) * (t.ndim - 1) + (-1,))).to(t.dtype))

    s = s.to(torch.float32)
    with torch.no_grad():
        for p in modules[producer].parameters(recurse=False):
            scale(p.data, 1.0 / s)
        for r in readers:
            if r in by_module:
                scale(by_module[r][1].weight(), s)
            else:
                scale(modules[r].weight.data, s)
    return undo


def check_run(cfg, checkpoint_dir, source) -> None:
    """Refuses what the fold cannot go with: a pre-scaling method with a resumable state or a streamed model (their
    records keep the quantized weights only, not the folded producers), or with a GGML format."""
    if getattr(methods.get(cfg.method), "prescale", None) is None:
        return
    if checkpoint_dir is not None or source is not None:
        raise ValueError(f"method {cfg.method!r} folds scales into normalization weights, which neither a "
                         f"checkpoint_dir state nor a streamed model keeps; run it without them")
    if cfg.quant.is_ggml:
        raise ValueError(f"method {cfg.method!r} quantizes integer grids only, not {cfg.quant.format!r}")

