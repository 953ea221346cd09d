"""Hessians of every weight a JAX model reads through a matmul, captured by interpreting its jaxpr.

A *weight* is a parameter leaf, or one layer of it when a stacked leaf is indexed (``W[i]``, ``scan``). Each
matmul that reads it gives a layout (:class:`jgptq.flax.interpret.Layout`): the leaf axes it contracts are the
weight's input features C, the leaf axes paired with the activation's batch axes (``einsum('ecd,edf->ecf')``)
or the group axis of ``ragged_dot`` are experts E, the rest are output features R. The weight is solved as a
stack of E matrices (R, C) with one Hessian per expert:

- ``dot_general``: expert ``e`` sees the activation rows of batch index ``e``; all token axes are flattened;
- ``ragged_dot``: expert ``e`` sees its ``group_sizes[e]`` consecutive rows (rows past the groups are ignored).

Hessians are :mod:`jgptq.hessian` states (float32 sum of x x^T and a token count) kept per *stream*: an
activation value read in one way. Weights that read the same value (q, k and v; gate and up) share one stream,
so its x^T x is computed once. A weight read by several matmuls with different inputs (a weight shared by two
layers) sums their streams: ``H = 2 / (N1 + N2) * (X1^T X1 + X2^T X2)``. Padding masks apply to matmuls whose
token axes have the mask's shape; routed expert rows are not masked (the weight's report says so).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jgptq import hessian
from jgptq.flax import interpret
from jgptq.flax.interpret import Layout, Site, View, flat_size

# Matched against a weight's path (keys joined by "/"): routers and embeddings (also when read by a matmul, as a
# tied output head) and output heads stay in float.
DEFAULT_EXCLUDE = r"(^|/)(router|gate|lm_head|embed[^/]*|wte|wpe)(/|$)"


@dataclasses.dataclass(frozen=True)
class WeightInfo:
    """What a captured weight is (given to filters and config functions).

    Attributes:
      name: ``path`` plus ``[i, ...]`` when it is one layer of a stacked leaf.
      path: the parameter leaf's path, keys joined by ``"/"``.
      leaf_shape: the leaf's shape.
      index: ((leaf_axis, index), ...) for one layer of a stacked leaf, else ().
      layout: its :class:`Layout` (leaf axes of experts, outputs, inputs).
      experts, out_features, in_features: E, R, C of the matrix stack (E = 1 without expert axes).
      primitive: ``"dot_general"`` or ``"ragged_dot_general"`` (of its first read).
      leaf: the leaf's index in the flattened parameters.
    """

    name: str
    path: str
    leaf_shape: tuple
    index: tuple
    layout: Layout
    experts: int
    out_features: int
    in_features: int
    primitive: str
    leaf: int


def default_filter(exclude: Optional[str] = DEFAULT_EXCLUDE, min_in_features: int = 32) -> Callable:
    """A weight filter: in_features >= ``min_in_features`` and the path not matching the ``exclude`` regex."""
    pattern = re.compile(exclude) if exclude else None

    def select(info: WeightInfo) -> bool:
        return info.in_features >= min_in_features and not (pattern and pattern.search(info.path))

    return select


def path_string(keypath) -> str:
    """A pytree key path as ``"a/b/0/kernel"`` (NNX ``.value`` attributes dropped)."""
    parts = []
    for k in keypath:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            if k.name != "value":
                parts.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return "/".join(parts)


@dataclasses.dataclass
class Unit:
    """A weight being captured: its info, the streams it reads, and bookkeeping for the report."""

    info: WeightInfo
    streams: list = dataclasses.field(default_factory=list)
    order: int = 0
    unmasked: bool = False
    solved: bool = False


@functools.partial(jax.jit, static_argnames=("size",))
def _rows(x, start, count, size: int):
    """Rows ``start .. start+count`` of ``x`` (T, C) padded to ``size`` rows, and the (size,) mask of real ones."""
    padded = jnp.pad(x, ((0, size), (0, 0)))
    rows = jax.lax.dynamic_slice_in_dim(padded, start, size, axis=0)
    return rows, jnp.arange(size) < count


_take = jax.jit(lambda x, e: x[e])


def _bucket(n: int) -> int:
    """Row counts are padded to powers of two (>= 16) so that few shapes are compiled."""
    return max(16, 1 << (int(n) - 1).bit_length())


class Collector:
    """Receives :class:`Site` s from the interpreter and keeps the Hessians of the selected weights.

    Args:
      paths, shapes: per flat parameter leaf.
      select: ``select(WeightInfo) -> bool``.
      input_dtype: ``"float32"`` or ``"bfloat16"`` (see :func:`jgptq.hessian.accumulate`).
      masks: one padding mask per lane, or None.
      on_unit: called with a :class:`Unit` after its Hessian received the site's tokens (sequential solving).
    """

    def __init__(self, paths, shapes, select: Callable, input_dtype: str = "float32", on_unit=None):
        self.paths, self.shapes = list(paths), list(shapes)
        self.select, self.input_dtype, self.on_unit = select, input_dtype, on_unit
        self.masks = None
        self.release_streams = False
        self.streams: dict = {}
        self.by_value: dict = {}
        self.units: dict = {}
        self.rejected: dict = {}
        self.skipped: dict = {}
        self.interpreter = None  # the interpreter of the current pass (set by ModelRun.run)
        self._done: set = set()

    def new_pass(self, masks=None, release_streams: bool = False):
        """Starts a pass over a new set of lanes (batches) with their masks (list of arrays or None)."""
        self.masks, self.release_streams, self._done = masks, release_streams, set()

    def skip(self, leaf: int, reason: str):
        self.skipped.setdefault(self.paths[leaf], reason)

    def release(self, value_key):
        if self.release_streams:
            for key in self.by_value.pop(value_key, ()):
                self.streams.pop(key, None)

    def _unit(self, site: Site) -> Optional[Unit]:
        v = site.view
        key = (v.leaf, v.fixed)
        unit = self.units.get(key)
        if unit is None:
            if key in self.rejected:
                return None
            shape, lay = self.shapes[v.leaf], site.layout
            path = self.paths[v.leaf]
            name = path + (f"[{', '.join(str(i) for _, i in v.fixed)}]" if v.fixed else "")
            info = WeightInfo(name, path, tuple(shape), v.fixed, lay, flat_size(shape, lay.experts),
                              flat_size(shape, lay.out), flat_size(shape, lay.inp), site.primitive, v.leaf)
            if not self.select(info):
                self.rejected[key] = info
                return None
            unit = self.units[key] = Unit(info, order=len(self.units))
        elif unit.info.layout != site.layout:
            raise ValueError(f"weight {unit.info.name}: read by matmuls with different layouts "
                             f"{unit.info.layout} and {site.layout}; exclude it or read it one way")
        return unit

    def site(self, site: Site):
        unit = self._unit(site)
        if unit is None or unit.solved:
            return
        if site.stream not in self._done:
            self._accumulate(site, unit.info)
            self._done.add(site.stream)
        if site.stream not in unit.streams:
            unit.streams.append(site.stream)
        if self.masks is not None and (site.group_sizes is not None or any(
                m is not None and tuple(np.shape(m)) != site.token_shape for m in self.masks)):
            unit.unmasked = True
        if self.on_unit is not None:
            self.on_unit(unit)

    def _accumulate(self, site: Site, info: WeightInfo):
        e_count, c = info.experts, info.in_features
        states = self.streams.get(site.stream)
        if states is None:
            states = [hessian.init(c) for _ in range(e_count)]
            self.by_value.setdefault(site.stream[:2], []).append(site.stream)
        name = f"inputs of {info.name}"
        for lane, x in enumerate(site.x):
            x = jnp.transpose(jnp.asarray(x), site.x_perm)
            if not bool(jnp.isfinite(x).all()):
                raise ValueError(f"{name}: activations contain NaN or Inf")
            if site.group_sizes is None:
                mask = None if self.masks is None else self.masks[lane]
                if mask is not None and tuple(np.shape(mask)) != site.token_shape:
                    mask = None
                xs = x.reshape(e_count, -1, c)
                for e in range(e_count):
                    xe = xs[0] if e_count == 1 else _take(xs, e)
                    states[e] = hessian.accumulate(states[e], xe, None if mask is None else jnp.ravel(mask),
                                                   input_dtype=self.input_dtype, check_finite=False, name=name)
            else:
                rows = x.reshape(-1, c)
                sizes = np.asarray(site.group_sizes[lane]).astype(np.int64)
                if sizes.shape != (e_count,) or (sizes < 0).any() or sizes.sum() > rows.shape[0]:
                    raise ValueError(f"{name}: group_sizes {sizes.tolist()} do not split {rows.shape[0]} rows "
                                     f"over {e_count} experts")
                starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
                for e in np.flatnonzero(sizes):
                    xe, keep = _rows(rows, jnp.int32(starts[e]), jnp.int32(sizes[e]), _bucket(sizes[e]))
                    states[e] = hessian.accumulate(states[e], xe, keep, input_dtype=self.input_dtype,
                                                   check_finite=False, name=name)
        self.streams[site.stream] = states

    def hessian(self, unit: Unit):
        """(H float32 (E, C, C) = 2/N sum x x^T over the unit's streams, tokens int (E,))."""
        parts = [self.streams[k] for k in unit.streams if k in self.streams]
        if len(parts) != len(unit.streams):
            raise RuntimeError(f"weight {unit.info.name}: a Hessian stream was released before the weight was solved")
        hs, counts = [], []
        for e in range(unit.info.experts):
            states = [p[e] for p in parts]
            state = states[0] if len(states) == 1 else hessian.HessianState(
                sum(s.hessian_sum for s in states), sum(s.token_count for s in states))
            hs.append(hessian.finalize(state))
            counts.append(int(state.token_count))
        return jnp.stack(hs), np.asarray(counts, np.int64)


class Traced(NamedTuple):
    closed: object
    treedef: object


class ModelRun:
    """A pure function ``fn(params, batch)`` with its flat parameters, traced once per batch shape."""

    def __init__(self, fn: Callable, params):
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        self.paths = [path_string(p) for p, _ in flat]
        self.leaves = [leaf for _, leaf in flat]
        self.fn, self._cache = fn, {}

    def params(self):
        return jax.tree_util.tree_unflatten(self.treedef, self.leaves)

    def jaxpr(self, batch):
        leaves, tdef = jax.tree.flatten(batch)
        key = (tdef, tuple((np.shape(x), jnp.result_type(x)) for x in leaves))
        if key not in self._cache:
            self._cache[key] = jax.make_jaxpr(self.fn)(self.params(), batch)
        return self._cache[key]

    def run(self, batches: list, collector: Collector, masks=None, release_streams: bool = False):
        """Interprets the model on ``batches`` (equal shapes) as lanes, reporting sites to ``collector``."""
        closed = self.jaxpr(batches[0])
        lanes = len(batches)
        for b in batches[1:]:
            if self.jaxpr(b) is not closed:
                raise ValueError("calibration batches of one pass must have the same structure and shapes "
                                 "(pad them and pass a mask)")
        collector.new_pass(masks, release_streams)
        interp = interpret.Interpreter(self.leaves, collector.site, collector.skip, collector.release)
        collector.interpreter = interp
        args = []
        for i, leaf in enumerate(self.leaves):
            tag = View(i, tuple(range(np.ndim(leaf)))) if jnp.issubdtype(jnp.result_type(leaf), jnp.floating) \
                and np.ndim(leaf) >= 1 else None
            args.append(([leaf] * lanes, tag))
        flat_batches = [jax.tree.leaves(b) for b in batches]
        args += [([fb[k] for fb in flat_batches], None) for k in range(len(flat_batches[0]))]
        consts = [([c] * lanes, None) for c in closed.consts]
        outs = interp.run(closed.jaxpr, consts, args, lanes)
        return [vals for vals, _ in outs]


class CapturedHessian(NamedTuple):
    """A captured weight: ``hessian`` float32 (E, C, C) (or (C, C) without expert axes), ``tokens`` (E,)."""

    info: WeightInfo
    hessian: jax.Array
    tokens: np.ndarray


def capture_hessians(fn: Callable, params, calib_batches, *, select: Optional[Callable] = None,
                     mask_fn: Optional[Callable] = None, input_dtype: str = "float32") -> dict:
    """GPTQ Hessians of every selected weight that ``fn`` reads through a matmul, on the float model.

    Args:
      fn: ``fn(params, batch) -> outputs``, a pure JAX function.
      params: its parameter pytree.
      calib_batches: an iterable of batches (one pass each).
      select: ``select(WeightInfo) -> bool`` (default :func:`default_filter`).
      mask_fn: ``mask_fn(batch) -> bool array of the token axes`` (padding excluded), or None.
      input_dtype: Hessian accumulation input dtype.
    Returns:
      ``{name: CapturedHessian}`` in the order the weights are first read.
    """
    run = ModelRun(fn, params)
    col = Collector(run.paths, [np.shape(x) for x in run.leaves], select or default_filter(), input_dtype)
    for batch in calib_batches:
        run.run([batch], col, None if mask_fn is None else [mask_fn(batch)])
    out = {}
    for unit in col.units.values():
        h, n = col.hessian(unit)
        if not unit.info.layout.experts:
            h = h[0]
        out[unit.info.name] = CapturedHessian(unit.info, h, n)
    return out
