"""The solve step of the layerwise pipeline: a calibrated layer's matrices, bucketed, through
:func:`jgptq.bucket.quantize_bucket`.

The torch side only gathers what the solve needs (each :class:`jgptq_torch.models.Matrix` as a
:class:`jgptq.bucket.Stack`: its weight viewed through DLPack, its Hessian, token counts and importance) and
groups matrices of one shape and one plan into a bucket. Experts and linear modules are bucketed apart, so each
kind has the same buckets in every layer and the compiled solves are reused from layer to layer. Every decision
and fallback is :mod:`jgptq.bucket`'s.

:func:`warm_solves` compiles a layer's solve programs ahead, on worker threads, while it calibrates.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jgptq_torch.models import UnsupportedModelError
from jgptq_torch.pipeline import importance
from jgptq_torch.dlpack import to_jax
from jgptq import methods, parallel
from jgptq import statistics as stats_mod
from jgptq.bucket import Stack, compiled_decode, quantize_bucket
from jgptq.imatrix import ImatrixEntry, hessian_importance

log = logging.getLogger(__name__)

ENV_WARM_UP = "JGPTQ_WARM_UP"
WARM_WORKERS = 8     # most solve programs compiled ahead at once (each compile runs on one core; at most half the
                     # host's cores, the rest left to the calibration beside them)


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
        pre-scaling method's, :attr:`jgptq_torch.pipeline.step.LayerStep.scales`): their stacks carry it as
        ``input_scale`` (the solve's Hessian is ``diag(s)^-1 H diag(s)^-1``; the weights, read from the model, are
        scaled already; the importance of GGML encoders stays the unscaled Hessian's).

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
            imp = importance_of(cfg, stats.get(param), h, tokens, hi - lo)
        weight = m.weight()
        weight = to_jax(weight if (lo, hi) == (0, m.count) else weight[lo:hi], name=m.name)
        hkey = "" if key is None else f"{base}.{key if m.layout is None else m.module_name + '.' + key[1]}"
        others = [s for s in methods.get(plan.matrices[param].method).statistics
                  if s not in (stats_mod.HESSIAN, stats_mod.IMATRIX) and s in collector.statistics]
        extra = {s: None if key is None else collector.result(s, key) for s in others} or None
        s = None if not scales or key is None else scales.get(key)
        out.append((m, param, Stack(f"{base}.{m.name}", weight, h, tokens, hkey, imp, extra, s)))
    return out


def importance_of(cfg, entry: Optional[ImatrixEntry], hessian, tokens, n: int):
    """float32 (N, C) importance of a part for the GGML encoders, or None (``importance="none"``).

    Args:
      entry: the weight's imatrix entry (collected or given); hessian: the part's Hessian (C, C), (N, C, C) or
        None; tokens: the N token counts; n: N.
    """
    if cfg.importance == "none":
        return None
    if cfg.importance == "imatrix":
        values = entry.values()
        return np.broadcast_to(values.reshape(-1, values.shape[-1]), (n, values.shape[-1])).astype(np.float32)
    if hessian is None:   # never reached: llama.cpp's 1.0 everywhere
        return None if entry is None else np.ones((n, entry.sums.shape[-1]), np.float32)
    return hessian_importance(hessian, tokens, n)


def solve_pass(run, step, stats: dict) -> list:
    """One pass of layer ``step.index``'s step (:class:`jgptq_torch.pipeline.step.LayerStep`): the hooks'
    ``before_solve``, the pass's expert coverage into the report, then one quantize call per bucket
    (:func:`solve_layer`) within the device's grant (:func:`solve_limit`), with ``stats`` (parameter name ->
    importance statistic: :func:`jgptq_torch.pipeline.importance.pass_statistics`). Returns the solved [(Matrix,
    parameter name, Stack, Solved)]; the pass's collector is released.

    Raises:
      UnsupportedModelError: an experts module whose forward never reached the capture."""
    t0 = time.perf_counter()
    i, collector, target, report = step.index, step.collector, step.target, run.report
    base = f"{run.prefix}.{i}"
    threshold = run.cfg.moe.threshold(collector.batch_tokens)
    run.hooks.before_solve(run, step)   # before the matrices are read: a pre-scaling method folds its scales in
    limit = solve_limit(run.placement, i)   # the solves' bytes on the device: torch's share stays torch's
    stacks = layer_stacks(collector, target, base, run.plan, run.cfg, stats, step.span, step.scales)
    for name, counts in collector.routed.items():
        if collector.batch_tokens and not sum(counts):
            raise UnsupportedModelError(f"{base}.{name}: the experts forward never reached jgptq's capture "
                                        f"implementation; its routed tokens cannot be seen")
        report.coverage[f"{base}.{name}"] = list(counts)
        report.thresholds[f"{base}.{name}"] = threshold
    solved = solve_layer(stacks, run.plan, threshold, devices=run.devices, memory_limit=limit)
    collector.release()
    report.add_time(i, "solve", time.perf_counter() - t0)
    return solved


def solve_layer(stacks: list, plan, threshold: int, *, devices=None, memory_limit=None) -> list:
    """Quantizes a layer's (Matrix, parameter name, Stack) triples, one :func:`quantize_bucket` call per bucket
    (experts or linear, rows, columns, plan; routed experts below the layer's expert ``threshold`` of tokens fall
    back, other matrices only when never reached: :meth:`jgptq.bucket.MatrixPlan.threshold`), each within
    ``memory_limit`` (:func:`solve_limit`); returns [(Matrix, parameter name, Stack, :class:`jgptq.bucket.Solved`)]
    in bucket order."""
    out = []
    for key, group in buckets(stacks, plan):
        solved = quantize_bucket([s for _, _, s in group], key[3], threshold=key[3].threshold(threshold),
                                 devices=devices, memory_limit=memory_limit)
        out += [(m, param, s, r) for (m, param, s), r in zip(group, solved)]
    return out


def solve_limit(placement, i: int):
    """The memory limit of layer ``i``'s solves (:func:`jgptq.bucket.quantize_bucket`'s ``memory_limit``): {the run
    device's JAX device: bytes} on an accelerator under a budget or a room, None on the CPU (host memory is one
    pool, and JAX's arrays there include the torch tensors it reads without a copy) or without a plan.

    The bytes are those the plan leaves to the layer's Hessians and solves
    (:attr:`jgptq_torch.pipeline.budget.Verdict.solve_room`), and on CUDA never more than the budget (or room) less
    what torch holds there now (``memory_reserved``: its tensors, which the estimate may not count in full, and its
    cache). When torch's holding would cut the plan's room, its cache gives its free blocks (the calibration
    forwards' intermediates, a chunk's write-back) back to the device first, so that only its tensors count. The
    run's least grant is recorded (``memory["solve_granted_least"]``)."""
    room = placement.solve_room.get(i)
    if room is None or placement.device.type == "cpu":
        return None
    if placement.device.type == "cuda":
        def beside_torch():
            return max(0, placement.budget.target - torch.cuda.memory_reserved(placement.device))

        if beside_torch() < room:    # only when they stand in the way: torch mallocs them again after
            torch.cuda.empty_cache()
        room = min(room, beside_torch())
    placement.memory["solve_granted_least"] = min(room, placement.memory.get("solve_granted_least", room))
    return {placement.jax_device: room}


def buckets(items, plan) -> list:
    """[(key, members)]: ``items`` (tuples that start with a Matrix and its parameter name) by bucket (experts or
    linear, rows, columns, plan), in the order :func:`solve_layer` solves them; members in their given order."""
    out: dict = {}
    for item in items:
        m, param = item[:2]
        out.setdefault((m.layout is not None, m.rows, m.cols, plan.matrices[param]), []).append(item)
    return [(key, out[key]) for key in sorted(out, key=lambda k: k[:3] + (k[3].format,))]


def _jax_dtype(dtype):
    return jnp.dtype(str(dtype).replace("torch.", ""))


def solve_buckets(target, base: str, plan, chunk=None) -> set:
    """The buckets a layer with targets ``target`` (qualified name ``base``) is solved in, under the run's plan:
    (experts?, rows, columns, routed experts per chunk or None, :class:`jgptq.bucket.MatrixPlan`) of its
    matrices (``chunk``: the routed experts go ``chunk`` at a time). A layer whose buckets were all seen before
    compiles nothing new; a later layer with a format of its own (a llama.cpp mix) does."""
    return {(m.layout is not None, m.rows, m.cols, chunk if chunk and m.layout is not None else None,
             plan.matrices[m.param_name(base)]) for m in target.matrices()}


def warm_jobs(target, base: str, plan, cfg, chunk=None) -> list:
    """The solve programs :func:`solve_layer` will compile for a layer with targets ``target`` (qualified name
    ``base``, the run's :class:`jgptq.plan.Plan` ``plan``), as (what, compile function) pairs, known from shapes
    before the layer is calibrated: one per GPTQ bucket and Hessian layout (and, for GGML formats, the decode of
    its payload). Largest buckets first, the second guesses (below) last.

    Which matrices share a Hessian is known only after the calibration forward; a bucket of several linear
    modules is compiled for both cases. ``chunk``: the routed experts are solved ``chunk`` at a time.
    """
    from jgptq.ggml import get_format
    from jgptq.methods.gptq import plan_guarded

    sds = jax.ShapeDtypeStruct
    buckets: dict = {}
    up_tie = "shared" if cfg.moe.calibration == "all_experts" else "own"
    for m in target.matrices():
        mplan = plan.matrices[m.param_name(base)]
        if mplan.method != "gptq":
            continue
        tie = up_tie if m.kind == "expert_gate_up" else "own"
        count = min(m.count, chunk) if chunk and m.layout is not None else m.count
        buckets.setdefault((m.layout is not None, m.rows, m.cols, mplan), []).append(
            (count, _jax_dtype(m.parameter.dtype), tie))
    jobs, guesses = [], []
    for (expert, rows, cols, mplan), members in sorted(buckets.items(), key=lambda kv: -kv[0][1] * kv[0][2]
                                                       * sum(c for c, _, _ in kv[1])):
        n, dtype, quant = sum(c for c, _, _ in members), members[0][1], mplan.quant
        weights = sds((n, rows, cols), dtype)
        if expert:
            shapes = [(cols, cols)] if members[0][2] == "shared" and len(members) == 1 else [(n, cols, cols)]
        else:
            shapes = [(cols, cols)] + ([(n, cols, cols)] if len(members) > 1 else [])
        what = f"{base} {rows}x{cols} x{n} {quant.format}"
        if quant.is_ggml:   # the guarded solve, with the importance of its encoder
            imp = None if cfg.importance == "none" else sds((n, cols), jnp.float32)
            solve = functools.partial(plan_guarded, importance=imp, quant=quant)
        else:
            solve = functools.partial(parallel.plan_solve, config=quant)
        calls = [(what, functools.partial(solve, weights, sds(h, jnp.float32))) for h in shapes]
        jobs.append(calls[0])
        guesses += calls[1:]
        fmt = get_format(quant.format) if quant.is_ggml else None
        if fmt is not None and hasattr(fmt.decode, "lower"):   # the decode of the kept bytes (bucket.decode_payload)
            jobs.append((what, functools.partial(_warm_decode, fmt, (n, rows, cols // fmt.block_size
                                                                    * fmt.type_size))))
    return jobs + guesses


def _warm_decode(fmt, shape: tuple, devices=None) -> None:
    """Compiles the decode of a uint8 payload of ``shape`` on the device the solve gathers its results to (the
    program :func:`jgptq.bucket.decode_payload` then runs)."""
    compiled_decode(fmt.name, shape, (devices or jax.local_devices())[0])


class Warming:
    """Compiles of :func:`warm_jobs` running on up to ``workers`` daemon threads (XLA compiles without holding
    Python's lock, so independent programs compile in parallel); :meth:`join` waits for those under way. A
    compile that fails is logged and skipped: the solve compiles what it needs and meets the error itself."""

    def __init__(self, jobs: list, devices=None, workers: Optional[int] = None):
        self.jobs, self.devices, self.failed = list(jobs), devices, []
        self._lock = threading.Lock()
        workers = min(len(self.jobs), workers or WARM_WORKERS, max(1, (os.cpu_count() or 1) // 2))
        self.threads = [threading.Thread(target=self._work, name=f"jgptq-warm-solves-{i}", daemon=True)
                        for i in range(max(workers, 1 if self.jobs else 0))]
        for t in self.threads:
            t.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self.jobs:
                    return
                what, compile_one = self.jobs.pop(0)
            try:
                compile_one(devices=self.devices)
            except Exception as exc:  # noqa: BLE001 - a warm-up only
                self.failed.append(what)
                log.warning("compiling a solve program ahead failed (%s: %s: %s); the solve compiles it itself",
                            what, type(exc).__name__, exc)

    def join(self) -> list:
        """Waits for the compiles under way; those not started yet are dropped (the solve compiles what it needs
        of them itself: on a host with few cores the second guesses, last in line, are not compiled for nothing).
        Returns what was dropped."""
        with self._lock:
            dropped, self.jobs = [what for what, _ in self.jobs], []
        for t in self.threads:
            t.join()
        return dropped


def warm_solves(target, base: str, plan, cfg, *, devices=None, chunk=None,
                force: bool = False) -> Optional[Warming]:
    """Starts compiling the solve programs of a layer (:func:`warm_jobs`) on worker threads, so that the first
    layer's compiles overlap its calibration and one another. Returns the :class:`Warming` (join it before
    solving, so that nothing compiles twice), or None when nothing is compiled ahead: a method other than GPTQ, or
    the CPU unless ``force`` or ``JGPTQ_WARM_UP`` says otherwise (:func:`warm_wanted`).
    """
    if not (force or warm_wanted(devices)):
        return None
    jobs = warm_jobs(target, base, plan, cfg, chunk)
    return Warming(jobs, devices) if jobs else None


def warm_wanted(devices=None) -> bool:
    """Whether solves are compiled ahead: ``JGPTQ_WARM_UP`` (``1``/``0``) when set, else on accelerators only,
    where a layer's programs take seconds to compile (on the CPU the calibration already has every core)."""
    value = os.environ.get(ENV_WARM_UP, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return (devices or jax.devices())[0].platform != "cpu"
