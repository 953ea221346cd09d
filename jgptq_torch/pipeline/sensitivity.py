"""``target_bpw``: a first pass that measures what every candidate format costs, and the allocation it leads to.

Groups. The experts of a layer share one format per projection (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``; per-expert linear modules ``experts.<e>.<proj>`` likewise), because llama.cpp, vLLM and
TensorRT-LLM store a layer's experts as one tensor of one type; every other matrix (attention, shared experts, dense
MLPs) is a group of its own. Matrices that ``formats`` rules or ``exclude`` patterns match keep their format (or
stay in floating point, 16 bits per weight) and are fixed costs of the budget. Embeddings and the output head are
not decoder-layer targets: they keep their normal handling and are outside the budget.

Layout (:func:`_layout`). Before any work, every decoder-layer target is resolved once into a :class:`Layout`,
by one question to :func:`jgptq.choices.layout`: the fixed matrices with their sizes, and for every free matrix
its candidates (:func:`jgptq.allocate.candidates`), each with its exact size and the plan the first pass solves it
with. The reach check, the line that says what the pass will do, the measurement and the allocation all read it.

Measure (:class:`jgptq_torch.pipeline.measure.Measure`, the hook of the pipeline's layer step in this pass:
:func:`jgptq_torch.pipeline.layerwise.choose_formats`). The float model runs layer by layer on float inputs and
every free matrix is solved under every candidate; each matrix's cost is ``1/2 G * s * tr((W - Q) H (W - Q)^T) / 2``:
the GPTQ objective of the solved weight ``Q`` on its Hessian ``H = 2/N sum x x^T`` (the mean squared output error
over the tokens it saw), times ``s``, the share of the layer's calibration tokens it saw (experts: their routed
tokens), times its gain ``G`` (:mod:`jgptq_torch.pipeline.gains`; 1 with ``target_gain="one"``). With the Fisher
gain the sum over all matrices is a second-order estimate of the mean next-token KL to the float model, reported as
``predicted_objective``. Experts' costs are estimated from a sample of their rows (the trace is a sum over rows),
other matrices are solved whole; the measure module says how and what that costs in quality.

Allocate (:meth:`FirstPass.allocate`). Sizes are exact (:func:`jgptq.allocate.tensor_bits`); the budget is
``floor(target_bpw * weights)`` bits over every decoder-layer target (fixed ones included); the groups get their
formats from :func:`jgptq.allocate.allocate`. The choice becomes the run's ``assignment`` (parameter -> format),
which :func:`jgptq.plan.plan_matrix` applies, so the second pass is the normal pipeline and its export, report
and resume work unchanged. With ``checkpoint_dir``, the allocation is kept in ``allocation.json`` there and a
resumed run takes it over instead of measuring again (same formats, same bytes).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from jgptq import allocate as alloc
from jgptq import choices, plan
from jgptq.surface import on_command_line, option
from jgptq_torch import models
from jgptq_torch.pipeline import measure as measure_mod
from jgptq_torch.pipeline import run_setup

ALLOCATION_FILE = "allocation.json"
GAIN_SHARE = 2   # the gain pass runs on the first ceil(batches / GAIN_SHARE) calibration batches


def gain_batches(batch_list: list, share: int = GAIN_SHARE) -> list:
    """The calibration batches the Fisher gain pass runs on: the first ``ceil(len / share)`` (at least one). A gain
    is a mean of squared gradients over every (token, output row) entry of a matrix, so half the calibration
    already fixes it to about 10% per group on the benchmark's deep model, for half the pass's time."""
    return list(batch_list)[:max(1, -(-len(batch_list) // share))]


def group_name(name: str) -> str:
    """The group of a matrix named relative to its layer: per-expert modules ``experts.<e>.<proj>`` share
    ``experts.*.<proj>``; any other name is its own group."""
    return re.sub(r"(^|\.)experts\.\d+\.", r"\1experts.*.", name)


class Candidate(NamedTuple):
    """A candidate format of a free matrix: its exact size in ``bits`` (:func:`jgptq.allocate.tensor_bits`) and
    the :class:`jgptq.bucket.MatrixPlan` the first pass solves it with (:func:`jgptq.plan.plan_matrix` with this
    candidate in place of the run's choice)."""

    bits: int
    plan: object


class Free(NamedTuple):
    """A matrix whose format the budget chooses: its decoder ``layer``, its ``group`` (:func:`group_name`), the
    :class:`jgptq_torch.models.Matrix` and its ``candidates`` (format -> :class:`Candidate`, in the order of
    :func:`jgptq.allocate.candidates`)."""

    layer: int
    group: str
    matrix: object
    candidates: dict


class Layout(NamedTuple):
    """Every decoder-layer target of a ``target_bpw`` run, resolved once before any work: ``free`` (param ->
    :class:`Free`), ``fixed`` (param -> (format or ``"float"``, bits): the matrices a ``formats`` or ``exclude``
    rule holds) and ``weights`` (of every target: what the budget is counted over)."""

    free: dict
    fixed: dict
    weights: int


def _layout(cfg, model) -> tuple:
    """(the :class:`Layout` of ``model``'s decoder layers under ``cfg``, their number): every matrix's rule,
    candidates, their sizes and plans, decided once by :func:`jgptq.choices.layout`.

    Raises:
      ValueError: a free matrix that no candidate fits.
    """
    prefix, layers = models.find_decoder_layers(model)
    found = [models.layer_targets(layer) for layer in layers]
    n_expert = max([lay.num_experts for t in found for _, lay in t.experts.values()] or [0])
    matrices = {m.param_name(f"{prefix}.{i}"): (i, m) for i, t in enumerate(found) for m in t.matrices()}
    fixed, options, weights = choices.layout(
        cfg, [choices.Sized(plan.Target(m.name, i, m.cols, param, m.layout is not None), m.rows, m.count)
              for param, (i, m) in matrices.items()], len(layers), n_expert)
    free = {param: Free(i, group_name(m.name), m, {f: Candidate(*c) for f, c in options[param].items()})
            for param, (i, m) in matrices.items() if param in options}
    return Layout(free, fixed, weights), len(layers)


def allocation_of(cfg, free: dict, fixed: dict, weights: int, costs: dict, gains) -> dict:
    """The allocation record (the report's ``allocation`` section) of measured ``costs`` under ``cfg``
    (``free``, ``fixed``, ``weights``: the run's :class:`Layout`)."""
    groups: dict = {}
    for param, (layer, name, m, names) in free.items():
        groups.setdefault((layer, name), []).append((param, m, names))
    rows = []
    for key in sorted(groups):
        members = groups[key]
        names = tuple(f for f in members[0][2] if all(f in ms for _, _, ms in members))
        gain = [float(np.mean(gains[p])) for p, _, _ in members if gains is not None and p in gains]
        rows.append({"layer": key[0], "name": key[1], "params": [p for p, _, _ in members],
                     "weights": sum(m.count * m.rows * m.cols for _, m, _ in members),
                     "gain": float(np.mean(gain)) if gain else 1.0,
                     "costs": {f: float(sum(costs[p][f].sum() for p, _, _ in members)) for f in names},
                     "bytes_by_format": {f: sum(ms[f].bits for _, _, ms in members) // 8 for f in names}})
    record = {"gain": cfg.target_gain, "weights": weights,
              "fixed": [{"param": p, "format": f, "bytes": b // 8} for p, (f, b) in sorted(fixed.items())],
              "groups": rows}
    return reallocate(record, cfg.target_bpw)


def reallocate(allocation: dict, target_bpw: float) -> dict:
    """The allocation record of the same measured costs under another ``target_bpw`` (no new measurement: a
    sweep over sizes measures once). Every size of the record is in bytes, whole for every candidate.

    Raises:
      ValueError: a target below every tensor at its cheapest candidate.
    """
    weights, rows = allocation["weights"], [dict(g) for g in allocation["groups"]]
    problem = [alloc.Group(f"{g['layer']}.{g['name']}", tuple(g["costs"]),
                           tuple(8 * g["bytes_by_format"][f] for f in g["costs"]),
                           tuple(g["costs"].values())) for g in rows]
    budget = math.floor(target_bpw * weights)
    fixed_bits = 8 * sum(f["bytes"] for f in allocation["fixed"])
    _refuse_below(target_bpw, budget, weights, fixed_bits + sum(min(g.sizes) for g in problem),
                  {g.formats[int(np.argmin(g.sizes))] for g in problem}, bool(allocation["fixed"]))
    solution = alloc.allocate(problem, budget - fixed_bits)
    for g, group, k in zip(rows, problem, solution.choice):
        g.update(format=group.formats[k], bpw=group.sizes[k] / g["weights"], bytes=group.sizes[k] // 8)
    total = solution.size + fixed_bits
    return dict(allocation, target_bpw=float(target_bpw), budget_bytes=budget // 8, total_bytes=total // 8,
                achieved_bpw=total / weights, predicted_objective=solution.cost, groups=rows)


def _refuse_below(target_bpw, budget: int, weights: int, least: int, cheapest: set, fixed: bool) -> None:
    if least > budget:
        raise ValueError(f"{option('target_bpw', float(target_bpw))} is below the {least / weights:.4g} bits per "
                         f"weight of every tensor at its cheapest candidate ({', '.join(sorted(cheapest))}"
                         f"{', and the tensors formats/exclude fix' if fixed else ''}); raise it or add cheaper "
                         f"{option('target_formats') if on_command_line() else 'target_formats'}")


def reachable(free: dict, fixed: dict, weights: int) -> tuple:
    """(least, most) bits of every decoder-layer target (``weights`` of them; ``free``, ``fixed``: the run's
    :class:`Layout`): each free matrix at its cheapest and at its largest candidate, fixed ones at their size; plus
    the sets of those cheapest and largest formats."""
    least = most = sum(b // 8 * 8 for _, b in fixed.values())
    cheapest, largest = set(), set()
    for *_, candidates in free.values():
        sizes = {f: c.bits for f, c in candidates.items()}
        small, big = min(sizes, key=sizes.get), max(sizes, key=sizes.get)
        least, most = least + sizes[small] // 8 * 8, most + sizes[big] // 8 * 8
        cheapest.add(small)
        largest.add(big)
    return least, most, cheapest, largest


def _check_reachable(cfg, free: dict, fixed: dict, weights: int) -> None:
    """Refuses a target below every tensor at its cheapest candidate, or above every tensor at its largest one
    (a run there would measure everything and then write the largest formats); both messages give the range the
    candidates reach."""
    least, most, cheapest, largest = reachable(free, fixed, weights)
    budget = math.floor(cfg.target_bpw * weights)
    if free and budget > most:
        raise ValueError(f"{option('target_bpw', float(cfg.target_bpw))} is above the {most / weights:.4g} bits per "
                         f"weight of every tensor at its largest candidate ({', '.join(sorted(largest))}"
                         f"{', and the tensors formats/exclude fix' if fixed else ''}): the candidates reach "
                         f"{least / weights:.4g} .. {most / weights:.4g} bits per weight of this model; choose a "
                         f"target in that range")
    _refuse_below(cfg.target_bpw, budget, weights, least, cheapest, bool(fixed))


def plan_line(cfg, free: dict, fixed: dict, weights: int, n_layers: int,
              stride: int = measure_mod.EXPERT_ROW_STRIDE, share: int = measure_mod.EXPERT_SHARE) -> str:
    """What the first pass of a ``target_bpw`` run is about to do, and its cost in solves, as one line: the
    number of candidate formats, the solves (each free matrix stack once per candidate, experts on a sample of
    their rows: :func:`jgptq_torch.pipeline.measure.row_stride`), their work in solved rows against the run that
    follows (which solves each stack once, whole) and the range the candidates reach."""
    least, most, _, _ = reachable(free, fixed, weights)
    per_weight = {f: c.bits / (m.count * m.rows * m.cols) for _, _, m, names in free.values()
                  for f, c in names.items()}
    formats = sorted(per_weight, key=lambda f: (per_weight[f], f))
    solves = sum(len(names) for *_, names in free.values())
    strides = sorted({measure_mod.row_stride(m, group, stride) for _, group, m, _ in free.values()} - {1}
                     if stride else set())
    rows = "" if not strides else f", experts on one row in {strides[0]}" + (
        f"-{strides[-1]}" if len(strides) > 1 else "")
    grid = sorted({f for *_, names in free.values() for f in names if measure_mod.scaled_by(f, names, share)})
    if stride and grid:
        rows += (f" ({', '.join(grid)} on one expert in {share}, scaled from a cheaper "
                 f"candidate's costs)")
    return (f"jgptq: {option('target_bpw', float(cfg.target_bpw))}: a first pass solves every layer under each of "
            f"{len(formats)} candidate formats ({', '.join(formats)}): {solves} matrix stacks over {n_layers} "
            f"layers{rows}, about {measure_mod.work_ratio(free, stride, share):.1f} times the rows the run that follows "
            f"solves; the candidates reach {least / weights:.4g} .. {most / weights:.4g} bits per weight")


@contextlib.contextmanager
def _on_run_device(model, device):
    """A model held whole in host memory goes to the run's CUDA device for the gain pass when it takes at most half
    of the free memory there, and back afterwards (``module.to`` keeps the parameter objects); otherwise it stays
    where it is."""
    device = torch.device(device)
    tensors = list(model.parameters()) + list(model.buffers())
    need = sum(t.numel() * t.element_size() for t in tensors)
    move = (device.type == "cuda" and {t.device.type for t in tensors} == {"cpu"}
            and need <= torch.cuda.mem_get_info(device)[0] // 2)
    if not move:
        yield
        return
    model.to(device)
    try:
        yield
    finally:
        model.to("cpu")
        torch.cuda.empty_cache()


def target_weights(model) -> int:
    """Weights of every decoder-layer target matrix of ``model`` (what ``target_bpw`` is counted over)."""
    _, layers = models.find_decoder_layers(model)
    return sum(m.count * m.rows * m.cols for t in map(models.layer_targets, layers) for m in t.matrices())


def assignment_of(allocation: dict) -> tuple:
    """The ``PipelineConfig.assignment`` of an allocation record: ((param, format), ...) sorted."""
    return tuple(sorted((p, g["format"]) for g in allocation["groups"] for p in g["params"]))


class FirstPass:
    """What the first pass of a ``target_bpw`` run under ``cfg`` knows before its measurement, and the allocation
    it ends with (:func:`jgptq_torch.pipeline.layerwise.choose_formats` runs the layers in between).

    Made before any work: the :class:`Layout` (the budget's reach checked, the pass said with ``progress``), the
    probe :class:`jgptq_torch.pipeline.run_setup.Run` the layers run in (``run``), and, with ``checkpoint_dir``,
    the allocation a resumed run takes over from ``allocation.json`` (``allocation``; None: to be measured).
    Arguments as :func:`jgptq.quantize_moe`; ``stride``, ``share``: as
    :class:`jgptq_torch.pipeline.measure.Measure`.

    Raises:
      ValueError: a budget below every tensor at its cheapest candidate, a matrix no candidate fits.
    """

    def __init__(self, model, calib, cfg, *, tokenizer=None, device=None, devices=None, imatrix=None,
                 checkpoint_dir=None, resume: bool = True, stride: int = measure_mod.EXPERT_ROW_STRIDE,
                 share: int = measure_mod.EXPERT_SHARE):
        from jgptq_torch.pipeline import resume as resume_mod

        self.cfg = cfg
        self.layout, n_layers = _layout(cfg, model)
        _check_reachable(cfg, *self.layout)   # before any work
        if cfg.progress:
            print(plan_line(cfg, *self.layout, n_layers, stride, share), file=sys.stderr, flush=True)
        self.saved = None if checkpoint_dir is None else Path(checkpoint_dir) / ALLOCATION_FILE
        probe = cfg.build(cfg, target_bpw=None, target_formats=(), assignment=(),
                          quant=cfg.quant.replace(format="q8_0") if cfg.quant.is_ggml else cfg.quant)
        self.run = run_setup.prepare(model, calib, probe, tokenizer, device, devices, imatrix)
        self.key, self.allocation, self.gain_seconds = None, None, 0.0
        if self.saved is not None:
            key = resume_mod.fingerprint(model, self.run.batch_list, cfg, n_layers, imatrix=imatrix)
            self.key = {k: key[k] for k in ("model", "calibration", "config")}
        if self.saved is not None and resume and self.saved.exists():
            stored = json.loads(self.saved.read_text())
            if stored.get("fingerprint") == self.key:
                self.allocation = stored["allocation"]

    def gains(self):
        """param -> per-expert gains of ``cfg.target_gain`` (:mod:`jgptq_torch.pipeline.gains`), or None
        (``"one"``); their time is kept for the allocation record."""
        from jgptq_torch.pipeline.gains import fisher_gains

        run, t0 = self.run, time.perf_counter()
        gains = None
        if self.cfg.target_gain == "fisher":
            with _on_run_device(run.result.model, run.device):
                gains = fisher_gains(run.result.model, gain_batches(run.batch_list), decoder=(run.prefix, run.layers, run.targets))
        self.gain_seconds = time.perf_counter() - t0
        return gains

    def allocate(self, costs: dict, gains) -> dict:
        """The allocation record of the measured ``costs`` (:func:`allocation_of`), with the pass's seconds; kept
        in ``allocation.json`` with ``checkpoint_dir``."""
        allocation = allocation_of(self.cfg, *self.layout, costs, gains)
        allocation["seconds"] = {"gains": self.gain_seconds, "sensitivity": sum(
            t.get("sensitivity", 0.0) for t in self.run.report.timings.values())}
        if self.saved is not None:
            self.saved.parent.mkdir(parents=True, exist_ok=True)
            self.saved.write_text(json.dumps({"fingerprint": self.key, "allocation": allocation}))
        self.allocation = allocation
        return allocation
