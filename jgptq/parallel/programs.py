"""The compiled programs of the engine (:mod:`jgptq.parallel.engine`): a call's static description, its
``jit(shard_map(...))`` program over the expert mesh for ``m`` experts a device at vmap width ``k``, compiled once
and cached, and what its memory analysis predicts.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jgptq import xla_options
from jgptq.parallel import memory, program_store

AXIS = "expert"


def compiler_options(platform: str) -> Optional[dict]:
    """XLA options of the engine's programs on ``platform``: on GPUs, GEMMs from cuBLAS rather than Triton
    (:mod:`jgptq.xla_options`); nothing elsewhere."""
    return xla_options.gemm_options() if platform == "gpu" else None


def runtime_slack(platform: str, io: int, k: int) -> int:
    """Bytes a program allocates at run time beyond its memory analysis (measured on GPUs; none on CPU)."""
    return 0 if platform == "cpu" else k * 2 * io + (1 << 20)


def expert_mesh(devices: Sequence) -> Mesh:
    """A 1-D Mesh over ``devices`` (in the given order) with the axis ``"expert"`` (Auto axis type)."""
    return _mesh(tuple(devices))


@functools.lru_cache(maxsize=64)
def _mesh(devices: tuple) -> Mesh:
    return Mesh(np.asarray(devices, dtype=object), (AXIS,), axis_types=(AxisType.Auto,))


class _Spec(NamedTuple):
    """Static description of a call: per-expert avals of mapped args, full avals of shared ones."""

    fn: Callable
    in_axes: tuple
    avals: tuple      # per argument: ShapeDtypeStruct of ONE expert (mapped), of the whole arg (shared), or None


def _per_device(fn, in_axes, k):
    def body(*args):
        mapped = tuple(a for a, ax in zip(args, in_axes) if ax == 0 and a is not None)

        def one(xs):
            it = iter(xs)
            return fn(*(next(it) if ax == 0 and a is not None else a for a, ax in zip(args, in_axes)))

        if k == 1:
            return jax.lax.map(one, mapped)
        return jax.lax.map(one, mapped, batch_size=k)

    return body


_lock = threading.Lock()
_compiled: dict = {}
_compiling: dict = {}     # key -> Event set when the thread compiling that program is done (or failed)


def compiled_program(spec: _Spec, mesh: Mesh, per_device: int, k: int):
    """The compiled program for ``per_device`` experts on each device of ``mesh`` (cached per process).

    Compiled once per process: a thread asking for a program that another thread is compiling (a warm-up on a
    worker thread, :func:`jgptq_torch.pipeline.solve.warm_solves`) waits for that compile and takes its
    executable; if that compile failed, the waiting thread compiles the program itself (and meets the error)."""
    key = (spec, mesh, per_device, k)
    while True:
        with _lock:
            hit = _compiled.get(key)
            if hit is not None:
                return hit
            busy = _compiling.get(key)
            if busy is None:
                _compiling[key] = done = threading.Event()
                break
        busy.wait()
    try:
        return _compile(key, spec, mesh, per_device, k)
    finally:
        with _lock:
            _compiling.pop(key, None)
        done.set()


def _compile(key, spec: _Spec, mesh: Mesh, per_device: int, k: int):
    n = mesh.devices.size
    shard, repl = NamedSharding(mesh, P(AXIS)), NamedSharding(mesh, P())
    in_specs, structs = [], []
    for aval, ax in zip(spec.avals, spec.in_axes):
        if aval is None:
            in_specs.append(None)
            structs.append(None)
        elif ax == 0:
            in_specs.append(P(AXIS))
            structs.append(jax.ShapeDtypeStruct((n * per_device, *aval.shape), aval.dtype, sharding=shard))
        else:
            in_specs.append(P())
            structs.append(jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=repl))
    program = jax.jit(jax.shard_map(_per_device(spec.fn, spec.in_axes, k), mesh=mesh, in_specs=tuple(in_specs),
                                    out_specs=P(AXIS), check_vma=False))
    device = mesh.devices.flat[0]
    options = compiler_options(device.platform)
    parts = (spec.in_axes, tuple(None if a is None else (tuple(a.shape), str(a.dtype)) for a in spec.avals), n,
             device.platform, getattr(device, "device_kind", ""), per_device, k, sorted((options or {}).items()))
    lowered = program_store.lower(program, structs, spec.fn, parts, out_shardings=shard)
    compiled = lowered.compile(compiler_options=options)
    out = sum(math.prod(o.shape) * o.dtype.itemsize for o in jax.tree.leaves(compiled.out_info))
    with _lock:
        _compiled[key] = compiled
        _io_compiled.setdefault(spec, input_bytes(spec) + out // (n * per_device))
    return compiled


def program_peak(spec: _Spec, mesh: Mesh, per_device: int, k: int) -> int:
    """Predicted per-device peak bytes of :func:`compiled_program`: its memory analysis (cached: reading it is not
    free) plus :func:`runtime_slack`."""
    key = (spec, mesh, per_device, k, "peak")
    with _lock:
        hit = _compiled.get(key)
    if hit is None:
        hit = memory.program_peak(compiled_program(spec, mesh, per_device, k))
        hit += runtime_slack(mesh.devices.flat[0].platform, io_bytes(spec), k)
        with _lock:
            _compiled[key] = hit
    return hit


def compiled_peaks(spec: _Spec) -> list:
    """[(mesh, per_device, k, predicted peak)] of the programs of ``spec`` compiled in this process whose peak
    :func:`program_peak` has read."""
    with _lock:
        return [(key[1], key[2], key[3], peak) for key, peak in _compiled.items()
                if len(key) == 5 and key[0] == spec]


_io_compiled: dict = {}   # spec -> io bytes read from a compiled program's outputs


def input_bytes(spec: _Spec) -> int:
    """Bytes of one expert's mapped inputs of ``spec``."""
    return sum(math.prod(a.shape) * a.dtype.itemsize for a, ax in zip(spec.avals, spec.in_axes)
               if a is not None and ax == 0)


def io_bytes(spec: _Spec) -> int:
    """Input + output bytes of one expert of ``spec`` (mapped inputs only; shared inputs are in every program's
    peak). Read from a program of ``spec`` compiled earlier when there is one; otherwise ``fn`` is traced for its
    output shapes (a GGML solve's trace takes seconds, so the planner compiles first where it can)."""
    with _lock:
        hit = _io_compiled.get(spec)
    return hit if hit is not None else _io_traced(spec)


@functools.lru_cache(maxsize=256)
def _io_traced(spec: _Spec) -> int:
    args = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype) for a in spec.avals]
    out = jax.eval_shape(spec.fn, *args)
    return input_bytes(spec) + sum(math.prod(o.shape) * o.dtype.itemsize for o in jax.tree.leaves(out))


def is_sequence(x) -> bool:
    """Whether a mapped argument is a sequence of per-expert arrays (a list or tuple) rather than one array with
    a leading expert axis."""
    return isinstance(x, (list, tuple))


def _expert_aval(x):
    if is_sequence(x):
        if not x:
            raise ValueError("an empty sequence of per-expert arrays")
        x = x[0]
        return jax.ShapeDtypeStruct(tuple(x.shape), jax.dtypes.canonicalize_dtype(x.dtype))
    return jax.ShapeDtypeStruct(tuple(x.shape[1:]), jax.dtypes.canonicalize_dtype(x.dtype))


def make_spec(fn, args: Sequence, in_axes: Sequence) -> tuple[_Spec, int]:
    """The static spec of ``fn`` over ``args`` (arrays, ShapeDtypeStructs or per-expert sequences) and E."""
    if len(args) != len(in_axes):
        raise ValueError(f"{len(args)} arguments but {len(in_axes)} in_axes")
    avals, counts = [], set()
    for a, ax in zip(args, in_axes):
        if a is None:
            avals.append(None)
        elif ax == 0:
            avals.append(_expert_aval(a))
            counts.add(len(a) if is_sequence(a) else a.shape[0])
        elif ax is None:
            avals.append(jax.ShapeDtypeStruct(tuple(a.shape), jax.dtypes.canonicalize_dtype(a.dtype)))
        else:
            raise ValueError(f"in_axes entries must be 0 or None, got {ax!r}")
    if len(counts) != 1:
        raise ValueError(f"mapped arguments disagree on the number of experts: {sorted(counts)}")
    return _Spec(fn, tuple(in_axes), tuple(avals)), counts.pop()
