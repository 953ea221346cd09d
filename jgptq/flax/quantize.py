"""GPTQ of a JAX model's weights: capture Hessians, solve, write the dequantized weights back.

:func:`quantize_fn` works on any pure function ``fn(params, batch)``; :func:`quantize` wraps it for Flax NNX
modules (updated in place) and Linen modules (new variables returned). Two modes:

- ``"sequential"``: one pass over all calibration batches at once; each weight is solved the moment the model
  first reads it, and the product is computed with the quantized weight, so every later weight sees inputs
  produced by the already-quantized earlier ones. Cost: one forward of every batch (evaluated one operation at
  a time), with the activations of all batches in memory together, plus the solves. A weight read again later
  (shared by two layers) is solved from the inputs of its first read.
- ``"all_at_once"``: one forward per batch on the float model (batches one at a time; their shapes may differ),
  then every weight is solved from its summed Hessian. Cheaper in memory; errors are not propagated.
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jgptq.bucket import PLAIN_KEPT, MatrixPlan, Stack, quantize_bucket
from jgptq import methods
from jgptq.config import QuantConfig
from jgptq.imatrix import hessian_importance
from jgptq.solve_inputs import width_misfit
from jgptq.flax.capture import (DEFAULT_EXCLUDE, Collector, ModelRun, Unit, WeightInfo, capture_hessians,
                                default_filter)

log = logging.getLogger("jgptq")

MODES = ("sequential", "all_at_once")
_EXPERT_LISTS = ("no_token_experts", "plain_kept")   # figures that list experts (never squeezed)


class QuantizeResult(NamedTuple):
    """What :func:`quantize` / :func:`quantize_fn` return.

    Attributes:
      model: the NNX module (its Params updated in place), the new Linen variables, or the new params pytree.
      payloads: ``{weight name: dict}`` with ``codes`` uint8, ``scales``/``zeros`` float32 (groups), ``g_idx``
        int32 (C,), ``perm`` int32 (C,) (each with a leading expert axis when the weight has expert axes;
        ``payload`` uint8 instead of codes for GGML formats), ``info`` (the :class:`WeightInfo`), ``layout``
        (leaf axes of experts/out/in), ``index`` (the layer of a stacked leaf) and ``shape`` (E, R, C) of the
        solved matrix stack; :func:`decode` turns one back into weights.
      report: ``{"mode", "method", "batches", "weights": {name: figures}, "skipped": {path: reason}}``; figures:
        order, shape, tokens (per expert), loss, damp_used, damp_stage, fallback, dead_columns, no_token_experts
        (solved as round-to-nearest), plain_kept (GGML formats: experts whose plain encode had the lower
        Hessian-weighted loss and was kept, see :mod:`jgptq.bucket`), unmasked (a mask was given but did not apply to these inputs).
      hessians: ``{weight name: float32 (E, C, C)}`` when ``keep_hessians``, else None.
    """

    model: object
    payloads: dict
    report: dict
    hessians: Optional[dict]


def _sub_index(ndim: int, fixed) -> tuple:
    index = [slice(None)] * ndim
    for axis, i in fixed:
        index[axis] = i
    return tuple(index)


def _matrix_perm(info: WeightInfo) -> list:
    fixed_axes = {a for a, _ in info.index}
    remaining = [a for a in range(len(info.leaf_shape)) if a not in fixed_axes]
    lay = info.layout
    return [remaining.index(a) for a in lay.experts + lay.out + lay.inp]


def matrix_of(leaf, info: WeightInfo) -> jax.Array:
    """The weight as a float32 matrix stack (E, R, C) (E = 1 without expert axes)."""
    sub = jnp.asarray(leaf)[_sub_index(np.ndim(leaf), info.index)]
    return jnp.transpose(sub, _matrix_perm(info)).reshape(
        info.experts, info.out_features, info.in_features).astype(jnp.float32)


def write_matrix(leaf, info: WeightInfo, matrix) -> jax.Array:
    """``leaf`` with the weight replaced by ``matrix`` (E, R, C), cast to the leaf's dtype."""
    leaf = jnp.asarray(leaf)
    lay = info.layout
    shape = [info.leaf_shape[a] for a in lay.experts + lay.out + lay.inp]
    back = jnp.transpose(jnp.reshape(matrix, shape), np.argsort(_matrix_perm(info))).astype(leaf.dtype)
    if not info.index:
        return back
    return leaf.at[_sub_index(leaf.ndim, info.index)].set(back)


def decode(payload: dict) -> jax.Array:
    """The float32 weights of an integer-grid payload: ``scales[g_idx] * (codes - zeros[g_idx])``.

    Returns (R, C), or (E, R, C) for a weight with expert axes (:func:`write_matrix` puts them back in a leaf).
    """
    if "codes" not in payload:
        raise ValueError("decode: a GGML payload is decoded by its format (jgptq.ggml.get_format(...).decode)")
    codes, g_idx = jnp.asarray(payload["codes"], jnp.float32), jnp.asarray(payload["g_idx"])
    scales, zeros = jnp.asarray(payload["scales"]), jnp.asarray(payload["zeros"])
    take = lambda t, g: jnp.take(t, g, axis=-1)  # noqa: E731
    if codes.ndim == 3:
        take = jax.vmap(take)
    return take(scales, g_idx) * (codes - take(zeros, g_idx))


def solve_weight(weights, hessians, tokens, config: QuantConfig, *, method: str = "gptq", name: str = "weight"):
    """Solves one captured weight through :func:`jgptq.bucket.quantize_bucket` (the torch pipeline's solve).

    Args:
      weights: float32 (E, R, C); hessians: float32 (E, C, C); tokens: int (E,) tokens behind each Hessian.
      config: the :class:`QuantConfig`; method: a name of :mod:`jgptq.methods` (``"gptq"``, ``"rtn"``: round to
        nearest, or the plain GGML encode, the baseline).
    Returns:
      (dequantized float32 (E, R, C), payload dict (leading E axis), report figures dict). Experts that saw no
      token are rounded to nearest (the plain encode for GGML formats) and listed in ``no_token_experts``.
    """
    tokens = np.asarray(tokens).reshape(-1)
    empty = np.flatnonzero(tokens == 0) if methods.get(method).token_threshold else np.zeros(0, np.int64)
    if empty.size:
        log.warning("%s: experts %s saw no calibration tokens; they are rounded to nearest", name, empty.tolist())
    importance = None
    if config.is_ggml:
        importance = hessian_importance(hessians, tokens, len(tokens))
    (solved,) = quantize_bucket([Stack(name, weights, hessians, tokens.tolist(), name, importance)],
                                MatrixPlan(method, config))
    payload = {k: getattr(solved, k) for k in ("codes", "scales", "zeros", "g_idx", "perm", "payload")
               if getattr(solved, k) is not None}
    figures = {k: v for k, v in solved.figures().items() if k not in ("method", "reason")}
    figures["no_token_experts"] = empty.tolist()
    figures["plain_kept"] = [e for e, why in enumerate(solved.reason) if why.startswith(PLAIN_KEPT)]
    return solved.weight, payload, figures


class _Pipeline:
    def __init__(self, run: ModelRun, config, select, method, keep_hessians, input_dtype):
        self.run, self.method, self.keep = run, method, keep_hessians
        self.config_of = config if callable(config) else (lambda info: config)
        self.base_select = select
        self.payloads, self.figures, self.hessians = {}, {}, {}
        self.col = Collector(run.paths, [np.shape(x) for x in run.leaves], self.select, input_dtype)

    def select(self, info: WeightInfo) -> bool:
        if not self.base_select(info):
            return False
        config = self.config_of(info)
        if config is None:
            return False
        reason = width_misfit(config, info.in_features, "input features")
        if reason:
            log.warning("%s not quantized: %s", info.name, reason)
            self.col.skipped[info.name] = reason
            return False
        return True

    def solve(self, unit: Unit):
        info = unit.info
        leaf = info.leaf
        h, tokens = self.col.hessian(unit)
        w = matrix_of(self.run.leaves[leaf], info)
        dq, payload, figures = solve_weight(w, h, tokens, self.config_of(info), method=self.method, name=info.name)
        self.run.leaves[leaf] = write_matrix(self.run.leaves[leaf], info, dq)
        unit.solved = True
        squeeze = not info.layout.experts
        self.payloads[info.name] = {
            **{k: (v[0] if squeeze else v) for k, v in payload.items()},
            "info": info, "layout": info.layout, "index": info.index,
            "shape": (info.experts, info.out_features, info.in_features)}
        figures = {k: (v[0] if squeeze and isinstance(v, list) and k not in _EXPERT_LISTS else v)
                   for k, v in figures.items()}
        self.figures[info.name] = {"order": unit.order, "shape": self.payloads[info.name]["shape"],
                                   "tokens": tokens.tolist(), "unmasked": unit.unmasked,
                                   "primitive": info.primitive, **figures}
        if self.keep:
            self.hessians[info.name] = h

    def sequential_solve(self, unit: Unit):
        self.solve(unit)
        self.col.interpreter.changed[unit.info.leaf] = True


def quantize_fn(fn: Callable, params, calib_batches, config: Union[QuantConfig, Callable] = QuantConfig(), *,
                mode: str = "sequential", select: Optional[Callable] = None, mask_fn: Optional[Callable] = None,
                method: str = "gptq", input_dtype: str = "float32", keep_hessians: bool = False) -> QuantizeResult:
    """GPTQ-quantizes every selected weight that the pure function ``fn(params, batch)`` reads through a matmul.

    Args:
      fn: ``fn(params, batch) -> outputs``.
      params: its parameter pytree (not modified).
      calib_batches: an iterable of batches (pytrees of arrays); equal shapes in sequential mode.
      config: a :class:`QuantConfig`, or ``config(WeightInfo) -> QuantConfig | None`` (None: keep in float).
      mode: ``"sequential"`` or ``"all_at_once"`` (see the module docs).
      select: ``select(WeightInfo) -> bool`` (default :func:`jgptq.flax.capture.default_filter`).
      mask_fn: ``mask_fn(batch) -> bool array over the token axes`` (False = padding), or None.
      method: ``"gptq"``, or ``"rtn"`` (round to nearest on the same grids, the baseline).
      input_dtype: ``"float32"`` or ``"bfloat16"`` Hessian inputs.
      keep_hessians: return the Hessians (float32 (E, C, C)) too.
    Returns:
      A :class:`QuantizeResult` whose ``model`` is the new params pytree.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: must be one of {MODES}")
    if method not in methods.names():
        raise ValueError(f"method={method!r}: must be one of {methods.names()}")
    batches = list(calib_batches)
    if not batches:
        raise ValueError("calib_batches is empty")
    run = ModelRun(fn, params)
    pipe = _Pipeline(run, config, select or default_filter(), method, keep_hessians, input_dtype)
    masks = None if mask_fn is None else [mask_fn(b) for b in batches]
    if mode == "sequential":
        pipe.col.on_unit = pipe.sequential_solve
        run.run(batches, pipe.col, masks, release_streams=True)
    else:
        for i, batch in enumerate(batches):
            run.run([batch], pipe.col, None if masks is None else [masks[i]])
        for unit in pipe.col.units.values():
            pipe.solve(unit)
    report = {"mode": mode, "method": method, "batches": len(batches), "weights": pipe.figures,
              "skipped": dict(pipe.col.skipped)}
    return QuantizeResult(run.params(), pipe.payloads, report, pipe.hessians if keep_hessians else None)


def _default_apply(module, batch):
    return module(*batch) if isinstance(batch, tuple) else module(batch)


def as_function(model, apply_fn: Optional[Callable] = None, variables=None):
    """A Flax model as ``(fn(params, batch), params, finish(new_params) -> model)``.

    NNX: ``params`` is the module's ``nnx.Param`` state and ``finish`` updates the module in place; Linen:
    ``params`` is ``variables["params"]`` and ``finish`` returns new variables.
    """
    from flax import linen, nnx

    if isinstance(model, nnx.Module):
        if variables is not None:
            raise ValueError("variables is for Linen modules; an NNX module holds its own")
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        call = apply_fn or _default_apply

        def fn(p, batch):
            return call(nnx.merge(graphdef, p, rest), batch)

        def finish(new_params):
            nnx.update(model, new_params)
            return model

        return fn, params, finish
    if isinstance(model, linen.Module):
        if variables is None or "params" not in variables:
            raise ValueError("a Linen module needs variables={'params': ..., ...}")
        others = {k: v for k, v in variables.items() if k != "params"}
        call = apply_fn or (lambda v, batch: model.apply(v, *batch) if isinstance(batch, tuple)
                            else model.apply(v, batch))

        def fn(p, batch):
            return call({**others, "params": p}, batch)

        return fn, variables["params"], lambda new_params: {**others, "params": new_params}
    raise TypeError(f"model must be a flax nnx.Module or linen.Module, got {type(model).__name__}; "
                    f"for a plain function use jgptq.flax.quantize_fn(fn, params, ...)")


def quantize(model, calib_batches, config: Union[QuantConfig, Callable] = QuantConfig(), *,
             mode: str = "sequential", apply_fn: Optional[Callable] = None, variables=None,
             exclude: Optional[str] = DEFAULT_EXCLUDE, min_in_features: int = 32, select: Optional[Callable] = None,
             mask_fn: Optional[Callable] = None, method: str = "gptq", input_dtype: str = "float32",
             keep_hessians: bool = False) -> QuantizeResult:
    """GPTQ-quantizes a Flax model (NNX or Linen) on calibration batches; no torch involved.

    Args:
      model: an ``nnx.Module`` (its ``nnx.Param`` values are replaced in place) or a ``linen.Module``.
      calib_batches: an iterable of batches.
      config: a :class:`QuantConfig`, or ``config(WeightInfo) -> QuantConfig | None``.
      mode: ``"sequential"`` (quantized activations propagated) or ``"all_at_once"``.
      apply_fn: NNX: ``apply_fn(module, batch) -> outputs`` (default ``module(batch)``, ``module(*batch)`` for a
        tuple); Linen: ``apply_fn(variables, batch)`` (default ``model.apply(variables, batch)``).
      variables: Linen only: the variables dict (with ``"params"``); only ``"params"`` are quantized.
      exclude, min_in_features: the default weight filter (path regex; smallest contraction size).
      select: ``select(WeightInfo) -> bool``, replaces the default filter.
      mask_fn, method, input_dtype, keep_hessians: as in :func:`quantize_fn`.
    Returns:
      A :class:`QuantizeResult`; ``model`` is the NNX module itself or the new Linen variables.
    """
    fn, params, finish = as_function(model, apply_fn, variables)
    result = quantize_fn(fn, params, calib_batches, config, mode=mode,
                         select=select or default_filter(exclude, min_in_features), mask_fn=mask_fn, method=method,
                         input_dtype=input_dtype, keep_hessians=keep_hessians)
    return result._replace(model=finish(result.model))


def capture(model, calib_batches, *, apply_fn: Optional[Callable] = None, variables=None,
            exclude: Optional[str] = DEFAULT_EXCLUDE, min_in_features: int = 32, select: Optional[Callable] = None,
            mask_fn: Optional[Callable] = None, input_dtype: str = "float32") -> dict:
    """Hessians of a Flax model's matmul weights on the float model (see :func:`capture_hessians`).

    Returns:
      ``{weight name: CapturedHessian}`` with float32 (C, C) or (E, C, C) Hessians and token counts.
    """
    fn, params, _ = as_function(model, apply_fn, variables)
    return capture_hessians(fn, params, calib_batches, select=select or default_filter(exclude, min_in_features),
                            mask_fn=mask_fn, input_dtype=input_dtype)
