"""An eager jaxpr interpreter that sees every matmul reading a model parameter.

The model's function ``fn(params, batch)`` is traced once to a jaxpr; :class:`Interpreter` then evaluates that
jaxpr equation by equation on concrete arrays, for several calibration batches at once ("lanes": every value is
a list with one array per batch). Each value that is a parameter, or a *view* of one, carries a tag
(:class:`View`): which flat parameter leaf it comes from, which leaf axis each of its axes is, which leaf axes
were indexed away (a layer of a stacked parameter), and the operations that rebuild it from the leaf.

Views pass through dtype casts, transposes, size-1 slices and squeezes (``W[i]`` of a stacked parameter,
``scan`` over layers), and calls (``jit``, ``custom_jvp``/``custom_vjp``, ``checkpoint``). ``scan`` is unrolled
(so each layer of a scanned stack is its own weight), ``cond`` runs the branch that its concrete index picks;
``while``, ``shard_map`` and ``pmap`` run whole, and parameters entering them are reported as not captured.
A parameter that reaches a matmul through any other operation (a reshape that merges axes, an arithmetic op)
is reported as skipped with the operation's name, never silently.

At every ``dot_general`` or ``ragged_dot_general`` with exactly one parameter operand the interpreter calls
``on_site(Site)`` before computing the product; the callback may replace the parameter leaf (sequential
quantization), and the product is then computed from the new leaf through the view's operations.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Optional

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from jgptq.flax.layouts import Layout, dot_layout, flat_size, ragged_layout  # noqa: F401 - Layout, flat_size: public here

# Primitives that leave a parameter's values unchanged (up to dtype): views pass through them.
_CASTS = frozenset({"convert_element_type", "copy", "copy_p", "sharding_constraint", "pvary"})
_MATMULS = frozenset({"dot_general", "ragged_dot_general"})
# Run whole, never entered: their bodies see per-iteration or per-shard values. Parameters read inside them are
# reported as not captured.
_OPAQUE = frozenset({"while", "shard_map", "xla_pmap"})


@dataclasses.dataclass(frozen=True)
class View:
    """A value that is a parameter leaf seen through cheap, replayable operations.

    Attributes:
      leaf: index of the leaf in the flat parameter list.
      axes: for each axis of the value, the leaf axis it is, or None for a size-1 remainder of an indexed axis.
      fixed: ((leaf_axis, index), ...) axes indexed away, sorted by axis (one layer of a stacked parameter).
      ops: functions that rebuild the value from the leaf array, applied in order.
    """

    leaf: int
    axes: tuple
    fixed: tuple = ()
    ops: tuple = ()

    def then(self, op, axes, fixed=None) -> "View":
        return View(self.leaf, tuple(axes), self.fixed if fixed is None else tuple(sorted(fixed)), self.ops + (op,))

    def replay(self, leaf_value):
        for op in self.ops:
            leaf_value = op(leaf_value)
        return leaf_value


@dataclasses.dataclass(frozen=True)
class Lost:
    """A value computed from a parameter by an operation that is not a view (``how`` names it)."""

    leaf: int
    how: str


class Site(NamedTuple):
    """One matmul that reads a parameter.

    Attributes:
      view: the parameter operand's :class:`View`.
      layout: its :class:`Layout` (leaf axes, each group sorted).
      x: the activation operand, one array per lane.
      x_perm: permutation of the activation's axes to (expert axes, token axes, contracted axes), the contracted
        axes paired with ``layout.inp`` in order.
      token_shape: sizes of the token axes (for padding masks).
      group_sizes: for ``ragged_dot``, the (E,) int32 group sizes, one array per lane; else None.
      stream: a key equal for sites that read the same activation value the same way (their Hessians coincide).
      primitive: ``"dot_general"`` or ``"ragged_dot_general"``.
    """

    view: View
    layout: Layout
    x: list
    x_perm: tuple
    token_shape: tuple
    group_sizes: Optional[list]
    stream: tuple
    primitive: str


def _sub_jaxpr(eqn):
    """(jaxpr, consts) of a call-like equation whose inputs and outputs map one-to-one to its body, or None."""
    if eqn.primitive.name in _OPAQUE or eqn.primitive.name in ("scan", "cond"):
        return None
    for key in ("jaxpr", "call_jaxpr"):
        sub = eqn.params.get(key)
        if isinstance(sub, jcore.ClosedJaxpr):
            jaxpr, consts = sub.jaxpr, list(sub.consts)
        elif isinstance(sub, jcore.Jaxpr):
            jaxpr, consts = sub, []
        else:
            continue
        if len(jaxpr.invars) == len(eqn.invars) and len(jaxpr.outvars) == len(eqn.outvars):
            return jaxpr, consts
    return None


def _last_uses(jaxpr) -> dict:
    """For each var, the index of the last equation that reads it (outputs are never released)."""
    last = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, jcore.Var):
                last[v] = i
    for v in jaxpr.outvars:
        if isinstance(v, jcore.Var):
            last[v] = len(jaxpr.eqns)
    return last


def _bind(prim, params, *args):
    found = prim.get_bind_params(params)
    if isinstance(found, tuple):  # older JAX: (subfunctions, params)
        subfuns, found = found
        args = (*subfuns, *args)
    out = prim.bind(*args, **found)
    return list(out) if prim.multiple_results else [out]


def _bind_lanes(eqn, ins, lanes: int) -> list:
    """Binds ``eqn`` once per lane; returns one list of lane values per output."""
    per_lane = [_bind(eqn.primitive, eqn.params, *[vals[lane] for vals, _ in ins]) for lane in range(lanes)]
    return [list(o) for o in zip(*per_lane)]


def _index_op(axis: int, index: int, keep: bool):
    return lambda v: lax.index_in_dim(v, index, axis, keepdims=keep)


def _slice_view(view: View, shape, starts, sizes, op) -> View | Lost:
    """The view after a (static or dynamic) slice; length-1 slices of leaf axes become fixed indices."""
    axes, fixed = list(view.axes), list(view.fixed)
    for d, (n, s, k) in enumerate(zip(shape, starts, sizes)):
        if s == 0 and k == n:
            continue
        if k != 1 or axes[d] is None:
            return Lost(view.leaf, "slice")
        fixed.append((axes[d], int(s)))
        axes[d] = None
    return view.then(op, axes, fixed)


def _squeeze_view(view: View, shape, dims, op) -> View | Lost:
    dims = set(dims)
    fixed = list(view.fixed) + [(view.axes[d], 0) for d in dims if view.axes[d] is not None]  # size-1 leaf axes
    return view.then(op, [a for d, a in enumerate(view.axes) if d not in dims], fixed)


def view_after(eqn, view: View, in_shape, lane_args) -> View | Lost:
    """The tag of the output of ``eqn`` whose first operand is ``view`` (other operands untagged)."""
    name, p = eqn.primitive.name, eqn.params
    op = functools.partial(_apply_prim, eqn.primitive, p)
    if name in _CASTS:
        return view.then(op, view.axes)
    if name == "transpose":
        return view.then(op, [view.axes[d] for d in p["permutation"]])
    if name == "squeeze":
        return _squeeze_view(view, in_shape, [d % len(in_shape) for d in p["dimensions"]], op)
    if name == "slice" and p.get("strides") in (None, (1,) * len(in_shape)):
        sizes = [b - a for a, b in zip(p["start_indices"], p["limit_indices"])]
        return _slice_view(view, in_shape, p["start_indices"], sizes, op)
    if name == "dynamic_slice":
        starts = [int(np.asarray(vals[0])) for vals, _ in lane_args[1:]]
        if any(not all(np.array_equal(vals[0], x) for x in vals) for vals, _ in lane_args[1:]):
            return Lost(view.leaf, "dynamic_slice with batch-dependent start")
        sizes = p["slice_sizes"]
        starts = [int(np.clip(s, 0, n - k)) for s, n, k in zip(starts, in_shape, sizes)]
        static = functools.partial(lax.slice, start_indices=starts,
                                   limit_indices=[s + k for s, k in zip(starts, sizes)])
        return _slice_view(view, in_shape, starts, sizes, static)
    if name == "reshape" and p.get("dimensions") is None:
        dropped = _dropped_unit_axes(in_shape, tuple(p["new_sizes"]))
        if dropped is not None:
            return _squeeze_view(view, in_shape, dropped, op)
    return Lost(view.leaf, name)


def _dropped_unit_axes(shape, new_sizes):
    """The size-1 axes of ``shape`` whose removal gives ``new_sizes``, or None if the reshape does more."""
    dropped, j = [], 0
    for d, n in enumerate(shape):
        if j < len(new_sizes) and new_sizes[j] == n:
            j += 1
        elif n == 1:
            dropped.append(d)
        else:
            return None
    return dropped if j == len(new_sizes) else None


def _apply_prim(prim, params, value):
    return _bind(prim, params, value)[0]


class Interpreter:
    """Evaluates a jaxpr over lanes of concrete values, reporting parameter matmuls to ``on_site``.

    Args:
      leaves: the flat parameter leaves (a list the callback may update in place; set ``changed[i]`` when it does).
      on_site: ``on_site(site)``, called before each parameter matmul is computed.
      on_skip: ``on_skip(leaf, reason)``, called for parameters that reach a matmul in a form not captured.
      on_release: ``on_release(stream)``, called when an activation value is no longer used (its streams may go).
    """

    def __init__(self, leaves: list, on_site: Callable, on_skip: Callable, on_release: Callable = lambda key: None):
        self.leaves = leaves
        self.changed = [False] * len(leaves)
        self.on_site, self.on_skip, self.on_release = on_site, on_skip, on_release

    def run(self, jaxpr, consts: list, args: list, lanes: int, frame: tuple = ()) -> list:
        """Evaluates ``jaxpr``; ``consts``/``args`` are (lane values, tag) pairs; returns the outputs likewise."""
        env = {}
        last = _last_uses(jaxpr)

        def read(v):
            if isinstance(v, jcore.Literal):
                return [v.val] * lanes, None
            return env[v]

        for v, a in zip(list(jaxpr.constvars) + list(jaxpr.invars), list(consts) + list(args)):
            env[v] = a
        for i, eqn in enumerate(jaxpr.eqns):
            ins = [read(v) for v in eqn.invars]
            outs = self._eqn(eqn, ins, lanes, frame + (i,), frame)
            for v, o in zip(eqn.outvars, outs):
                if not isinstance(v, jcore.DropVar):
                    env[v] = o
            for v in set(v for v in eqn.invars if isinstance(v, jcore.Var)):
                if last.get(v) == i:
                    del env[v]
                    self.on_release((frame, v))
        return [read(v) for v in jaxpr.outvars]

    def _eqn(self, eqn, ins, lanes, where, frame):
        name = eqn.primitive.name
        tags = [t for _, t in ins]
        if name in _MATMULS and any(isinstance(t, (View, Lost)) for t in tags[:2]):
            return self._matmul(eqn, ins, lanes, frame)
        sub = _sub_jaxpr(eqn)
        if sub is not None:
            jaxpr, consts = sub
            return self.run(jaxpr, [([c] * lanes, None) for c in consts], ins, lanes, where)
        if name == "scan":
            return self._scan(eqn, ins, lanes, where)
        if name == "cond":
            return self._cond(eqn, ins, lanes, where)
        if name in _OPAQUE:
            for t in tags:
                if isinstance(t, (View, Lost)):
                    self.on_skip(t.leaf, f"read inside {name} (not captured)")
        outs = _bind_lanes(eqn, ins, lanes)
        out_tags = [None] * len(outs)
        tagged = [k for k, t in enumerate(tags) if t is not None]
        if tagged:
            first = tags[tagged[0]]
            arrays = [k for k, v in enumerate(eqn.invars) if not isinstance(v, jcore.Literal)]
            if len(outs) == 1 and tagged == [0] and isinstance(first, View) and (
                    len(arrays) == 1 or name == "dynamic_slice"):
                out_tags[0] = view_after(eqn, first, np.shape(ins[0][0][0]), ins)
            elif len(arrays) == 1:  # a unary op of a parameter: not a view of it
                out_tags = [Lost(first.leaf, name)] * len(outs)
        return list(zip(outs, out_tags))

    def _matmul(self, eqn, ins, lanes, frame):
        name = eqn.primitive.name
        tags = [ins[0][1], ins[1][1]]
        views = [k for k in (0, 1) if isinstance(tags[k], View)]
        lost = [t for t in tags if isinstance(t, Lost)]
        if len(views) != 1 or lost:
            for t in tags:
                if isinstance(t, (View, Lost)):
                    why = f"reaches {name} through {t.how}" if isinstance(t, Lost) else f"{name} of two parameters"
                    self.on_skip(t.leaf, why)
            return self._plain(eqn, ins, lanes)
        p = views[0]
        view = tags[p]
        x_vals = ins[1 - p][0]
        x_shape = np.shape(x_vals[0])
        if name == "dot_general":
            found = dot_layout(view, p, eqn.params["dimension_numbers"], len(x_shape), x_shape)
            groups = None
        else:
            found = ragged_layout(view, p, eqn.params, x_shape)
            groups = ins[2][0]
        if isinstance(found, str):
            self.on_skip(view.leaf, f"{name}: {found}")
            return self._plain(eqn, ins, lanes)
        layout, x_perm, token_shape = found
        x_var = eqn.invars[1 - p]
        key = (frame, x_var if isinstance(x_var, jcore.Var) else id(eqn), x_perm, name,
               eqn.invars[2] if groups is not None else None)
        self.on_site(Site(view, layout, x_vals, x_perm, token_shape, groups, key, name))
        if self.changed[view.leaf]:
            new = view.replay(self.leaves[view.leaf])
            ins = list(ins)
            ins[p] = ([new] * lanes, view)
        return self._plain(eqn, ins, lanes)

    def _plain(self, eqn, ins, lanes):
        outs = _bind_lanes(eqn, ins, lanes)
        return [(o, None) for o in outs]

    def _scan(self, eqn, ins, lanes, where):
        p = eqn.params
        body, nc, ncar, n = p["jaxpr"], p["num_consts"], p["num_carry"], p["length"]
        consts, carry, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
        body_consts = [([c] * lanes, None) for c in body.consts]
        ys = [None] * n
        for it in (range(n - 1, -1, -1) if p["reverse"] else range(n)):
            x_it = []
            for vals, tag in xs:
                shape = np.shape(vals[0])
                if isinstance(tag, View):
                    tag = _slice_view(tag, shape, [it] + [0] * (len(shape) - 1), (1,) + shape[1:],
                                      _index_op(0, it, True))
                    tag = _squeeze_view(tag, (1,) + shape[1:], [0], _index_op(0, 0, False)) \
                        if isinstance(tag, View) else tag
                x_it.append(([lax.index_in_dim(v, it, 0, keepdims=False) for v in vals], tag))
            outs = self.run(body.jaxpr, body_consts, consts + carry + x_it, lanes, where + (it,))
            carry = [(vals, None) for vals, _ in outs[:ncar]]
            ys[it] = [vals for vals, _ in outs[ncar:]]
        stacked = [([jnp.stack([ys[it][k][lane] for it in range(n)]) for lane in range(lanes)], None)
                   for k in range(len(eqn.outvars) - ncar)]
        return carry + stacked

    def _cond(self, eqn, ins, lanes, where):
        index = [int(np.asarray(v)) for v in ins[0][0]]
        branches = eqn.params["branches"]
        if len(set(index)) == 1:
            br = branches[min(max(index[0], 0), len(branches) - 1)]
            return self.run(br.jaxpr, [([c] * lanes, None) for c in br.consts], ins[1:], lanes, where)
        raise NotImplementedError(
            "lax.cond whose branch depends on the calibration batch: use mode='all_at_once', which runs one "
            "batch at a time")
