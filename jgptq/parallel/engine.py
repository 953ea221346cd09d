"""Map a per-expert function over same-shape experts on a Mesh: plan (room check), place, run, gather.

The engine is generic: ``fn(*args)`` works on one expert (e.g. a GPTQ solve of a (R, C) weight against its
(C, C) Hessian) and returns a pytree of arrays; each argument is either *mapped* (a leading expert axis, or a
sequence of per-expert arrays) or *shared* by every expert (``in_axes`` 0 or None, as in ``jax.vmap``).

Program: ``jit(shard_map(per_device, mesh, P("expert")))`` over a 1-D mesh whose axis ``"expert"`` (axis type
Auto: with Explicit axes, unbatched constants inside a vmapped solve fail the sharding check) holds the devices
that take work. Each device gets ``m`` consecutive experts and runs them with ``lax.map`` (a scan, no
cross-device traffic: the compiled program holds no collective). ``batch_size`` k = 1 scans the unbatched
per-expert program; k >= 2 scans ``vmap`` over k experts at a time, and ``m`` is then a multiple of k.

Same bytes on any mesh: an expert's result must not depend on the number of lax.map steps, on the vmap width k, or
on the chunking. On CPU it does not (tested with 1-8 devices, and batch 1 against batch 2). On a GPU, the
unbatched program (k = 1) compiles to other kernels than batched ones (cuSOLVER's single and batched Cholesky,
GEMMs chosen per shape), and its bytes may differ from a batched run's (``benchmarks/batch_invariance.py``
measures it). So on accelerators a bucket of two or more experts never runs at width 1 (a device's experts are
padded to two); the width is otherwise the experts per device (up to :data:`MAX_BATCH_DEFAULT`): a narrower vmap
would make the solve, whose per-column steps are latency bound, slower.

Planning (the room check, the batch width, reusing compiled programs) is :mod:`jgptq.parallel.planner`.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jgptq.parallel.planner import MAX_BATCH, MAX_BATCH_DEFAULT, Plan, _width, plan  # noqa: F401
from jgptq.parallel.programs import (AXIS, _compiled, _Spec, compiled_peaks, compiled_program,  # noqa: F401
                                     compiler_options, expert_mesh, input_bytes, io_bytes, is_sequence, make_spec,
                                     program_peak, runtime_slack)


def _block(x, idx: list, device, dtype):
    """Experts ``idx`` of ``x`` stacked on ``device``."""
    if is_sequence(x):
        return jnp.stack([jax.device_put(jnp.asarray(x[i], dtype), device) for i in idx])
    if isinstance(x, jax.Array):   # one program per shape, whether the experts are consecutive or padded
        return jax.device_put(_rows(x, np.asarray(idx, np.int32), dtype), device)
    contiguous = idx == list(range(idx[0], idx[0] + len(idx)))
    part = x[idx[0]: idx[0] + len(idx)] if contiguous else np.take(x, idx, axis=0)
    return jax.device_put(np.asarray(part, dtype), device)


def _place(spec: _Spec, args, plan_: Plan, mesh: Mesh, start: int):
    me = jax.process_index()
    shard, repl = NamedSharding(mesh, P(AXIS)), NamedSharding(mesh, P())
    local = [(j, d) for j, d in enumerate(plan_.devices) if d.process_index == me]
    m, last = plan_.per_device, plan_.num_experts - 1
    out = []
    for a, ax, aval in zip(args, spec.in_axes, spec.avals):
        if a is None:
            out.append(None)
        elif ax == 0:
            blocks = [_block(a, [min(start + j * m + i, last) for i in range(m)], d, aval.dtype) for j, d in local]
            out.append(jax.make_array_from_single_device_arrays((len(plan_.devices) * m, *aval.shape), shard,
                                                                blocks))
        else:
            blocks = [jax.device_put(jnp.asarray(a, aval.dtype), d) for _, d in local]
            out.append(jax.make_array_from_single_device_arrays(aval.shape, repl, blocks))
    return out


def gathered_bytes(spec: _Spec, num_experts: int, gather_to=None) -> Optional[dict]:
    """``{device: bytes}`` the results of ``num_experts`` experts of ``spec`` take on the device :func:`run`
    gathers them to (``gather_to`` as there), for :func:`plan`'s ``gather_bytes``; None when they go to the
    host."""
    if gather_to is None:
        gather_to = jax.local_devices()[0] if jax.process_count() == 1 else "host"
    if gather_to == "host":
        return None
    return {gather_to: num_experts * (io_bytes(spec) - input_bytes(spec))}


def run(spec: _Spec, args: Sequence, plan_: Plan, gather_to=None):
    """Runs ``plan_``: places each chunk's experts on its devices, runs the compiled program, gathers results.

    Args:
      gather_to: a device (results concatenated there), ``"host"`` (numpy), or None: the first local device in a
        one-process run, ``"host"`` (numpy on every process, via ``process_allgather``) in a multi-process run.
    Returns:
      The pytree of ``fn``'s outputs with a leading axis of ``plan_.num_experts``, in expert order.
    """
    from jgptq.parallel import multihost

    multi = jax.process_count() > 1
    if gather_to is None:
        gather_to = "host" if multi else jax.local_devices()[0]
    if multi and gather_to != "host":
        raise ValueError("a multi-process run gathers results to the host (gather_to='host')")
    mesh = expert_mesh(plan_.devices)
    program = compiled_program(spec, mesh, plan_.per_device, plan_.batch_size)
    pieces = []
    for c in range(plan_.num_chunks):
        start, stop = plan_.chunk_range(c)
        out = program(*_place(spec, args, plan_, mesh, start))
        valid = stop - start
        if multi:
            pieces.append(jax.tree.map(lambda a: multihost.allgather(a)[:valid], out))
        elif gather_to == "host":
            pieces.append(jax.tree.map(lambda a: np.asarray(a)[:valid], out))
        else:
            moved = jax.device_put(out, gather_to)
            full = len(plan_.devices) * plan_.per_device
            pieces.append(moved if valid == full else _first(moved, valid))
            del moved
        del out
    if len(pieces) == 1:
        return pieces[0]
    if gather_to == "host":
        return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *pieces)
    return _joined(pieces)


_rows = jax.jit(lambda x, idx, dtype: jnp.take(x, idx, axis=0).astype(dtype), static_argnums=2)

# A chunk's results cut to its real experts and the chunks joined, each as one program for every field at once: as
# eager operations, each field's slice and concatenation compiled one small program per new expert count, about
# twenty for a GPTQ result, seconds on a GPU whenever a bucket's count was new (a layer's last, shorter chunks).
_first = jax.jit(lambda tree, n: jax.tree.map(lambda a: a[:n], tree), static_argnums=1)
_joined = jax.jit(lambda pieces: jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *pieces))


def plan_map(fn: Callable, args: Sequence, in_axes: Sequence, *, devices=None, batch_size=None, memory_limit=None,
             reserve=0, gather_to=None) -> Plan:
    """The :class:`Plan` :func:`map_experts` follows for these arguments (compiling its programs); ``args`` may be
    ``jax.ShapeDtypeStruct`` s (only shapes and dtypes are read), so the programs of a call can be compiled ahead
    of its data."""
    spec, num = make_spec(fn, args, in_axes)
    devices = list(jax.devices() if devices is None else devices)
    return plan(spec, num, devices, batch_size=batch_size, memory_limit=memory_limit, reserve=reserve,
                gather_bytes=functools.partial(gathered_bytes, spec, num, gather_to))


def map_experts(fn: Callable, args: Sequence, in_axes: Sequence, *, devices=None, batch_size=None,
                memory_limit=None, reserve=0, gather_to=None, plan_: Optional[Plan] = None):
    """``jax.vmap(fn, in_axes)(*args)`` spread over devices, chunked to fit memory, same bytes on any mesh.

    Args:
      fn: per-expert function of jax arrays returning a pytree of arrays; hashable (programs are cached per
        ``fn``: pass a module-level function or a frozen dataclass, not a fresh lambda per call).
      args: per argument: an array (or numpy array) with a leading expert axis E, a sequence of E per-expert
        arrays (each may live on any device), a shared array (in_axes None), or None.
      in_axes: 0 (mapped) or None (shared) per argument.
      devices: devices to spread over (default: every device, ``jax.devices()``).
      batch_size: upper bound of the per-device lax.map batch (default: 1 on CPU, 256 elsewhere).
      memory_limit, reserve: simulated limit / bytes kept free (see :func:`jgptq.parallel.memory.free_bytes`).
      gather_to: see :func:`run`.
      plan_: a :class:`Plan` made earlier by :func:`plan` for the same spec (skips planning).
    Returns:
      The pytree of outputs, leading axis E, in input order.
    """
    spec, num = make_spec(fn, args, in_axes)
    if plan_ is None:
        plan_ = plan_map(fn, args, in_axes, devices=devices, batch_size=batch_size, memory_limit=memory_limit,
                         reserve=reserve, gather_to=gather_to)
    elif plan_.num_experts != num:
        raise ValueError(f"the plan is for {plan_.num_experts} experts, got {num}")
    return run(spec, args, plan_, gather_to)
