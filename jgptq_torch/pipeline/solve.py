"""The solve step of the layerwise pipeline: a calibrated layer's matrices, bucketed, through
:func:`jgptq.bucket.quantize_bucket`.

The torch side only gathers what the solve needs (each :class:`jgptq_torch.models.Matrix` as a
:class:`jgptq.bucket.Stack`: its weight viewed through DLPack, its Hessian, token counts and importance) and
groups matrices of one shape and one plan into a bucket. Experts and linear modules are bucketed apart, so each
kind has the same buckets in every layer and the compiled solves are reused from layer to layer. Every decision
and fallback is :mod:`jgptq.bucket`'s.

:func:`warm_solves` compiles a layer's solve programs ahead, on a background thread, while it calibrates.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

import jax
import jax.numpy as jnp

from jgptq_torch.pipeline import importance
from jgptq_torch.dlpack import to_jax
from jgptq import methods, parallel
from jgptq import statistics as stats_mod
from jgptq.bucket import Stack, quantize_bucket
from jgptq.methods.awq import scaled_hessian

log = logging.getLogger(__name__)


def layer_stacks(collector, target, base: str, plan, cfg, stats: dict, span=None, scales=None) -> list:
    """(Matrix, model parameter name, Stack) for every target matrix of a calibrated layer.

    Args:
      collector: the layer's :class:`jgptq_torch.pipeline.capture.Collector` after calibration.
      target: its :class:`jgptq_torch.models.LayerTargets`; base: the layer's qualified name (``model.layers.3``).
      plan: the run's :class:`jgptq.plan.Plan`; cfg: the run's config.
      stats: model parameter name -> :class:`jgptq.imatrix.ImatrixEntry` (the importance of GGML encoders; for
        experts, the rows of ``span``).
      span: (lo, hi): experts stacks take experts ``lo <= e < hi`` only (the collector's span: a chunk).
      scales: Hessian key -> float32 scale (C,) folded into the inputs of the matrices read under that key (a
        pre-scaling method's, :attr:`jgptq_torch.pipeline.step.LayerStep.scales`): their stacks' Hessians are
        ``diag(s)^-1 H diag(s)^-1`` (:func:`jgptq.methods.awq.scaled_hessian`; the weights, read from the model,
        are scaled already; the importance of GGML encoders stays the unscaled Hessian's).

    A stack's ``statistics`` hold the other statistics its method declares (e.g. the error-feedback cross
    statistic), finalized from the collector under the Hessian's key (None where never fed).
    """
    out = []
    for m in target.matrices():
        lo, hi = importance.expert_rows(m, span)
        if hi == lo:
            continue
        key = collector.tie.get(m.hessian_key) if m.layout is None else m.hessian_key
        got = None if key is None else collector.hessian(key)
        h, tokens = (None, 0) if got is None else got
        tokens = tokens if isinstance(tokens, list) else [tokens] * (hi - lo)
        param = m.param_name(base)
        imp = None
        if plan.matrices[param].quant.is_ggml:
            imp = importance.importance_of(cfg, stats.get(param), h, tokens, hi - lo)
        weight = m.weight()
        weight = to_jax(weight if (lo, hi) == (0, m.count) else weight[lo:hi], name=m.name)
        hkey = "" if key is None else f"{base}.{key if m.layout is None else m.module_name + '.' + key[1]}"
        others = [s for s in methods.get(plan.matrices[param].method).statistics
                  if s not in (stats_mod.HESSIAN, stats_mod.IMATRIX) and s in collector.statistics]
        extra = {s: None if key is None else collector.result(s, key) for s in others} or None
        s = None if not scales or key is None else scales.get(key)
        if s is not None and h is not None:
            h = scaled_hessian(h, s)
        out.append((m, param, Stack(f"{base}.{m.name}", weight, h, tokens, hkey, imp, extra)))
    return out


def solve_layer(stacks: list, plan, threshold: int, *, devices=None) -> list:
    """Quantizes a layer's (Matrix, parameter name, Stack) triples, one :func:`quantize_bucket` call per bucket
    (experts or linear, rows, columns, plan; routed experts below the layer's expert ``threshold`` of tokens fall
    back, other matrices only when never reached: :meth:`jgptq.bucket.MatrixPlan.threshold`); returns
    [(Matrix, parameter name, Stack, :class:`jgptq.bucket.Solved`)] in bucket order."""
    out = []
    for key, group in buckets(stacks, plan):
        solved = quantize_bucket([s for _, _, s in group], key[3], threshold=key[3].threshold(threshold),
                                 devices=devices)
        out += [(m, param, s, r) for (m, param, s), r in zip(group, solved)]
    return out


def buckets(items, plan) -> list:
    """[(key, members)]: ``items`` (tuples that start with a Matrix and its parameter name) by bucket (experts or
    linear, rows, columns, plan), in the order :func:`solve_layer` solves them; members in their given order."""
    out: dict = {}
    for item in items:
        m, param = item[:2]
        out.setdefault((m.layout is not None, m.rows, m.cols, plan.matrices[param]), []).append(item)
    return [(key, out[key]) for key in sorted(out, key=lambda k: k[:3] + (k[3].format,))]


def _warm_on(devices) -> bool:
    """Whether solves are compiled ahead (:func:`warm_solves`): on accelerators, where a layer's programs take
    seconds to compile; on the CPU the calibration already has every core."""
    return (devices or jax.devices())[0].platform != "cpu"


def _jax_dtype(dtype):
    return jnp.dtype(str(dtype).replace("torch.", ""))


def solve_shapes(target, chunk=None) -> set:
    """The buckets a layer with targets ``target`` is solved in: (experts?, rows, columns) of its matrices, and
    the routed experts per chunk ``chunk`` of experts buckets when they go in chunks."""
    return {(m.layout is not None, m.rows, m.cols) + ((chunk,) if chunk and m.layout is not None else ())
            for m in target.matrices()}


def warm_solves(target, cfg, *, devices=None, chunk=None) -> Optional[threading.Thread]:
    """Starts compiling, on a background thread, the solve programs that :func:`solve_layer` will run for a layer
    with targets ``target``, so that the first layer's compiles overlap its calibration (XLA compiles without
    holding Python's lock). Returns the thread (join it before solving, so that nothing compiles twice), or None
    when nothing is to be compiled (round-to-nearest, GGML formats).

    Which matrices share a Hessian is known only after the calibration forward; a bucket of several linear
    modules is compiled for both cases. A guess that misses costs background compile time, never a result.
    ``chunk``: the routed experts are solved ``chunk`` at a time (:mod:`jgptq_torch.pipeline.expert_chunks`).
    """
    if cfg.method != "gptq" or cfg.quant.is_ggml or not _warm_on(devices):
        return None
    sds = jax.ShapeDtypeStruct
    buckets: dict = {}
    up_tie = "shared" if cfg.moe.calibration == "all_experts" else "own"
    for m in target.matrices():
        tie = up_tie if m.kind == "expert_gate_up" else "own"
        dtype = _jax_dtype(m.parameter.dtype)
        count = min(m.count, chunk) if chunk and m.layout is not None else m.count
        buckets.setdefault((m.layout is not None, m.rows, m.cols), []).append((count, dtype, tie))
    jobs = []
    for (expert, rows, cols), members in buckets.items():
        n, dtype = sum(c for c, _, _ in members), members[0][1]
        weights = sds((n, rows, cols), dtype)
        if expert:
            shapes = [(cols, cols)] if members[0][2] == "shared" and len(members) == 1 else [(n, cols, cols)]
        else:
            shapes = [(cols, cols)] + ([(n, cols, cols)] if len(members) > 1 else [])
        jobs += [(weights, sds(h, jnp.float32)) for h in shapes]

    def compile_all():
        for weights, hessians in jobs:
            try:
                parallel.plan_solve(weights, hessians, cfg.quant, devices=devices)
            except Exception as exc:  # noqa: BLE001 - a warm-up only: the solve compiles what it needs
                log.debug("warming a solve program for %s failed: %s", weights.shape, exc)

    thread = threading.Thread(target=compile_all, name="jgptq-warm-solves", daemon=True)
    thread.start()
    return thread
