"""GPTQ solves and plain encodes of many experts over every device: the functions the pipeline calls.

- :func:`solve_experts`: drop-in for :func:`jgptq.gptq.solve_experts` (same :class:`~jgptq.gptq.GPTQResult`,
  leading expert axis, input order, same bytes), spread over a Mesh and chunked to fit memory.
- :func:`plan_solve`: the plan (devices, chunks, batch) for given shapes, before the Hessians exist; with
  :func:`merge_partials` each expert's Hessian partials are reduced straight onto the device that solves it.
- :func:`bucket_by_shape` / :func:`solve_named`: a dict of named weights of several shapes, one sharded call per
  shape.
- :func:`encode_experts` / :func:`encode_on_devices`: the imatrix-only path (no GPTQ), generic over an encode
  function ``fn(weight (R, C), importance (C,)) -> pytree``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp

from jgptq import gptq
from jgptq.config import QuantConfig
from jgptq.hessian import DevicePartials, HessianState
from jgptq.parallel import engine


@dataclasses.dataclass(frozen=True)
class _Solver:
    """The per-expert GPTQ program (hashable, so compiled programs are cached per config)."""

    config: QuantConfig
    codec: Optional[gptq.GroupCodec] = None

    def __call__(self, weight, hessian, importance):
        return gptq.solve_unchecked(weight, hessian, importance, self.config, self.codec)


def _axes(hessians, importance):
    h_ax = None if (not engine.is_sequence(hessians) and len(hessians.shape) == 2) else 0
    i_ax = None if importance is None or (not engine.is_sequence(importance) and len(importance.shape) == 1) else 0
    return (0, h_ax, i_ax)


def _pick(x, i: int, full_ndim: int):
    if x is None:
        return None
    return jnp.asarray(x[i] if engine.is_sequence(x) or x.ndim == full_ndim else x)


def _check(weights, hessians, importance, config, name):
    if engine.is_sequence(weights) or engine.is_sequence(hessians) or engine.is_sequence(importance):
        for i in range(len(weights)):
            gptq.check_inputs(_pick(weights, i, 3), _pick(hessians, i, 3), _pick(importance, i, 2), config,
                              f"{name}[{i}]", batched=False)
    else:
        gptq.check_inputs(jnp.asarray(weights), jnp.asarray(hessians),
                          None if importance is None else jnp.asarray(importance), config, name, batched=True)


def plan_solve(weights, hessians, config: QuantConfig = QuantConfig(), *, importance=None, devices=None,
               batch_size=None, memory_limit=None, reserve=0, gather_to=None, codec=None) -> engine.Plan:
    """The :class:`~jgptq.parallel.engine.Plan` that :func:`solve_experts` would follow.

    Arguments as :func:`solve_experts`; any array may be a ``jax.ShapeDtypeStruct`` (only shapes and dtypes are
    read), so the plan can be made before the Hessians are accumulated.
    """
    args = (weights, hessians, importance)
    spec, num = engine.make_spec(_Solver(config, codec), args, _axes(hessians, importance))
    devices = list(jax.devices() if devices is None else devices)
    return engine.plan(spec, num, devices, batch_size=batch_size, memory_limit=memory_limit, reserve=reserve,
                       gather_bytes=functools.partial(engine.gathered_bytes, spec, num, gather_to))


def solve_experts(weights, hessians, config: QuantConfig = QuantConfig(), *, importance=None, devices=None,
                  batch_size=None, memory_limit=None, reserve=0, gather_to=None, plan=None,
                  name: str = "experts", check: bool = True, codec=None) -> gptq.GPTQResult:
    """GPTQ-quantizes same-shape experts over every device; the result equals :func:`jgptq.gptq.solve_experts`.

    Args:
      weights: float (E, R, C) (jax or numpy), or a sequence of E (R, C) arrays on any devices.
      hessians: float32 (E, C, C), a sequence of E (C, C) arrays, or one (C, C) shared by every expert.
      config: a :class:`QuantConfig`.
      importance: None, (C,) shared, (E, C), or a sequence of E (C,) arrays (GGML formats).
      devices: devices to use (default ``jax.devices()``: every local device, or every device of a
        multi-process run).
      batch_size: upper bound of the experts vmapped together on a device (default: 1 on CPU, 8 on GPU).
      memory_limit: simulated per-device memory limit (bytes, ``"512M"``, or a dict device -> limit); default
        the environment variable ``JGPTQ_DEVICE_MEMORY_LIMIT``.
      reserve: bytes to leave free per device (int or dict device -> bytes), e.g. torch's reserved memory.
      gather_to: where results go: a device, ``"host"`` (numpy), default the first local device (``"host"`` in
        a multi-process run, on every process).
      plan: a plan from :func:`plan_solve` (e.g. the one :func:`merge_partials` followed).
      name: what the experts are, for error messages.
      check: validate shapes and finiteness first.
      codec: a custom :class:`~jgptq.gptq.GroupCodec` (as :func:`jgptq.gptq.solve`).
    Returns:
      A :class:`~jgptq.gptq.GPTQResult` whose every field has a leading expert axis E, in input order; the same
      bytes whatever the devices, chunks and batch (and the same as :func:`jgptq.gptq.solve_experts`).
    """
    if check:
        _check(weights, hessians, importance, config, name)
    if plan is None:
        plan = plan_solve(weights, hessians, config, importance=importance, devices=devices,
                          batch_size=batch_size, memory_limit=memory_limit, reserve=reserve, gather_to=gather_to,
                          codec=codec)
    return engine.map_experts(_Solver(config, codec), (weights, hessians, importance), _axes(hessians, importance),
                              gather_to=gather_to, plan_=plan)


def merge_partials(partials: Sequence[DevicePartials], plan: engine.Plan) -> list[HessianState]:
    """Reduces each expert's per-device Hessian partials onto the device that will solve it.

    Args:
      partials: one :class:`~jgptq.hessian.DevicePartials` per expert (accumulated where the activations
        lived), in expert order; each is emptied.
      plan: the plan the solve will follow (:func:`plan_solve`).
    Returns:
      One :class:`~jgptq.hessian.HessianState` per expert, on ``plan.device_of(i)``; pass
      ``[hessian.finalize(s) for s in states]`` and ``plan=plan`` to :func:`solve_experts` and nothing moves.
    """
    if len(partials) != plan.num_experts:
        raise ValueError(f"{len(partials)} Hessian partials for a plan of {plan.num_experts} experts")
    me = jax.process_index()
    return [p.merge(plan.device_of(i) if plan.device_of(i).process_index == me else None)
            for i, p in enumerate(partials)]


def bucket_by_shape(named: Mapping[str, object]) -> dict:
    """Groups named arrays by (shape, dtype): {(shape, dtype name): [names in input order]}."""
    buckets: dict = {}
    for key, arr in named.items():
        buckets.setdefault((tuple(arr.shape), str(jnp.dtype(arr.dtype))), []).append(key)
    return buckets


def solve_named(weights: Mapping[str, object], hessians: Mapping[str, object],
                config: QuantConfig = QuantConfig(), *, importance: Optional[Mapping] = None,
                **kwargs) -> dict:
    """GPTQ-quantizes named weights of any shapes: one sharded :func:`solve_experts` per shape bucket.

    Args:
      weights: name -> float (R, C); hessians: name -> float32 (C, C); importance: name -> (C,) or None.
      kwargs: passed to :func:`solve_experts` (devices, batch_size, memory_limit, gather_to, ...).
    Returns:
      name -> :class:`~jgptq.gptq.GPTQResult` of that weight (no expert axis).
    """
    missing = [k for k in weights if k not in hessians]
    if missing:
        raise ValueError(f"no Hessian for weights {missing}")
    out = {}
    for names in bucket_by_shape(weights).values():
        imp = None if importance is None else [importance[k] for k in names]
        res = solve_experts([weights[k] for k in names], [hessians[k] for k in names], config, importance=imp,
                            name=f"bucket of {names[0]}", **kwargs)
        for i, k in enumerate(names):
            out[k] = jax.tree.map(lambda a: a[i], res)
    return out


@dataclasses.dataclass(frozen=True)
class _Encoder:
    fn: Callable

    def __call__(self, weight, importance):
        return self.fn(weight, importance)


def encode_experts(fn: Callable, weights, importance=None, **kwargs):
    """``vmap(fn)(weights, importance)`` spread over the devices (imatrix-only path: no GPTQ).

    Args:
      fn: ``fn(weight (R, C), importance (C,) or None) -> pytree of arrays``, traceable; keep the same function
        object across calls (compiled programs are cached per function).
      weights: (E, R, C) or a sequence of E (R, C) arrays; importance: None, (C,) shared, (E, C) or a sequence.
      kwargs: devices, batch_size, memory_limit, reserve, gather_to (see :func:`solve_experts`).
    Returns:
      ``fn``'s pytree with a leading expert axis E, in input order.
    """
    i_ax = None if importance is None or (not engine.is_sequence(importance) and len(importance.shape) == 1) else 0
    return engine.map_experts(_Encoder(fn), (weights, importance), (0, i_ax), **kwargs)


_encode_jit = jax.jit(lambda fn, w, i: fn(w, i), static_argnums=0)


def encode_on_devices(fn: Callable, weights: Mapping[str, jax.Array], importance: Optional[Mapping] = None) -> dict:
    """Encodes every named weight on the device that holds it, all devices at once (asynchronous dispatch).

    Args:
      fn: ``fn(weight (R, C), importance (C,) or None) -> pytree``, traceable (jitted; compiled per shape and
        device).
      weights: name -> (R, C) jax array, each committed to its device (e.g. where torch keeps the layer).
      importance: name -> (C,) or None; moved to its weight's device.
    Returns:
      name -> ``fn``'s pytree, on the weight's device; nothing crosses devices. Call
      ``jax.block_until_ready`` on the dict to wait.
    """
    out = {}
    for k, w in weights.items():
        w = jnp.asarray(w)
        imp = None if importance is None or importance.get(k) is None else jax.device_put(
            jnp.asarray(importance[k]), next(iter(w.devices())))
        out[k] = _encode_jit(fn, w, imp)
    return out
