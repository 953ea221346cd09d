"""How a matmul that reads a parameter view splits the parameter into a matrix stack (E, R, C), and how the
activation's axes line up with it (:func:`dot_layout` for ``dot_general``, :func:`ragged_layout` for
``ragged_dot_general``)."""

from __future__ import annotations

import math
from typing import NamedTuple


class Layout(NamedTuple):
    """How a weight's leaf axes split into a matrix stack (E, R, C): expert, output and input (contracted) axes."""

    experts: tuple
    out: tuple
    inp: tuple



def dot_layout(view, p: int, dimension_numbers, x_ndim: int, x_shape) -> tuple:
    """(Layout, x_perm, token_shape) of a ``dot_general`` whose operand ``p`` (0 or 1) is ``view``; or a str reason."""
    (lc, rc), (lb, rb) = dimension_numbers
    pc, xc = (rc, lc) if p == 1 else (lc, rc)
    pb, xb = (rb, lb) if p == 1 else (lb, rb)
    pf = [d for d in range(len(view.axes)) if d not in pc and d not in pb]
    cpairs = sorted((view.axes[d], xd) for d, xd in zip(pc, xc) if view.axes[d] is not None)
    bpairs = sorted((view.axes[d], xd) for d, xd in zip(pb, xb) if view.axes[d] is not None)
    # x axes paired with size-1 remainders of indexed axes have size 1: they go with the tokens.
    paired = {xd for _, xd in cpairs} | {xd for _, xd in bpairs}
    xf = [d for d in range(x_ndim) if d not in paired]
    layout = Layout(tuple(a for a, _ in bpairs), tuple(sorted(view.axes[d] for d in pf if view.axes[d] is not None)),
                    tuple(a for a, _ in cpairs))
    if not layout.inp:
        return "no contracted parameter axis"
    if not layout.out:
        return "no output axis (a vector, not a matrix)"
    x_perm = tuple(xd for _, xd in bpairs) + tuple(xf) + tuple(xd for _, xd in cpairs)
    return layout, x_perm, tuple(x_shape[d] for d in xf)


def ragged_layout(view, p: int, params, x_shape) -> tuple:
    """(Layout, x_perm, token_shape) of a ``ragged_dot_general`` whose grouped right operand is ``view``, or a
    str reason."""
    rdn = params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = rdn.dot_dimension_numbers
    if p != 1 or lb or rb or params.get("group_offset") is not None:
        return "ragged_dot with the parameter on the left, batch axes or a group offset"
    if len(rdn.lhs_ragged_dimensions) != 1 or len(rdn.rhs_group_dimensions) != 1:
        return "ragged_dot without one ragged row axis and one group axis"
    m, g = rdn.lhs_ragged_dimensions[0], rdn.rhs_group_dimensions[0]
    xf = [d for d in range(len(x_shape)) if d not in lc]
    if xf != [m] or view.axes[g] is None:
        return "ragged_dot whose left operand has free axes besides the ragged rows"
    cpairs = sorted((view.axes[d], xd) for d, xd in zip(rc, lc) if view.axes[d] is not None)
    out = tuple(sorted(a for d, a in enumerate(view.axes) if d != g and d not in rc and a is not None))
    if not cpairs or not out:
        return "ragged_dot without contracted or output parameter axes"
    layout = Layout((view.axes[g],), out, tuple(a for a, _ in cpairs))
    return layout, (m,) + tuple(xd for _, xd in cpairs), (x_shape[m],)


def flat_size(shape, axes) -> int:
    """Elements of ``shape`` over its ``axes`` (1 for none)."""
    return int(math.prod(shape[a] for a in axes))
