"""The error-feedback cross statistic: a float32 sum over tokens of ``(x~ - x) x^T`` and a token count.

``x`` is a weight's input in the run (earlier layers quantized), ``x~`` the input the same weight gets at the same
token when every earlier layer is float. With ``H = 2 / N sum x x^T`` (:mod:`jgptq.hessian`) and this statistic
``K = 2 / N sum (x~ - x) x^T``, the weight that best gives the float model's output from the run's inputs,
``argmin_V sum ||W x~ - V x||^2``, is ``W + W K H^-1`` (:mod:`jgptq.methods.error_feedback`).

Rows arrive paired, ``[x | x~]`` on the last axis ((..., 2C) for C input features), so that the capture's row
machinery (padding, masks, grouping experts into slots) carries both halves of a token together. The state is
kept unnormalized, as the Hessian's is, so partial sums add exactly; :func:`finalize` applies ``2 / N``.

Forms: one state (C, C) / () or a stack (E, C, C) / (E,) (one per expert); rows of one state, of entry ``index``
of a stack, or a group of slots ``x`` (G, P, 2C), ``mask`` (G, P) for experts ``index`` (G,) (a slot whose mask is
all False adds nothing). Products are float32 at precision HIGHEST; half-precision rows are widened first.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jgptq import xla_options


class CrossState(NamedTuple):
    """Unnormalized cross statistic.

    Attributes:
      cross_sum: float32 (C, C) or (E, C, C): sum over tokens of ``(x~ - x) x^T`` (row index from the difference).
      token_count: int32 () or (E,): tokens summed.
    """

    cross_sum: jax.Array
    token_count: jax.Array


def init(columns: int, entries=None, device=None) -> CrossState:
    """An empty state for C = ``columns`` input features; ``entries`` E stacks one per expert (None: one)."""
    if columns < 1 or (entries is not None and entries < 1):
        raise ValueError(f"columns and entries must be positive, got {columns}, {entries}")
    shape = (columns, columns) if entries is None else (entries, columns, columns)
    s = jnp.zeros(shape, jnp.float32)
    n = jnp.zeros(() if entries is None else (entries,), jnp.int32)
    if device is not None:
        s, n = jax.device_put(s, device), jax.device_put(n, device)
    return CrossState(s, n)


def _halves(pairs, mask):
    """(x, x~ - x) float32 of paired rows (..., 2C), rows where ``mask`` is False zeroed."""
    c = pairs.shape[-1] // 2
    pairs = jnp.where(mask[..., None], pairs, jnp.zeros((), pairs.dtype)).astype(jnp.float32)
    x, xf = pairs[..., :c], pairs[..., c:]
    return x, xf - x


def _rows_product(pairs, mask):
    x, d = _halves(pairs.reshape(-1, pairs.shape[-1]), mask.reshape(-1))
    prod = jax.lax.dot_general(d, x, (((0,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
    return prod, jnp.sum(mask, dtype=jnp.int32)


@functools.partial(jax.jit, donate_argnums=(0,))
def _add_rows(state: CrossState, pairs, mask) -> CrossState:
    prod, n = _rows_product(pairs, mask)
    return CrossState(state.cross_sum + prod, state.token_count + n)


@functools.partial(jax.jit, donate_argnums=(0,))
def _add_rows_at(state: CrossState, index, pairs, mask) -> CrossState:
    prod, n = _rows_product(pairs, mask)
    return CrossState(state.cross_sum.at[index].add(prod), state.token_count.at[index].add(n))


def add_slots(state: CrossState, index, pairs, mask) -> CrossState:
    """The group update (traceable, no checks): slots ``pairs`` (G, P, 2C), ``mask`` (G, P) into experts
    ``index`` (G,) of a stacked state."""
    x, d = _halves(pairs, mask)
    prod = jax.lax.dot_general(d, x, (((1,), (1,)), ((0,), (0,))), precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
    return CrossState(state.cross_sum.at[index].add(prod),
                      state.token_count.at[index].add(jnp.sum(mask, axis=1, dtype=jnp.int32)))


_add_slots = jax.jit(add_slots, donate_argnums=(0,), compiler_options=xla_options.gemm_options())


def accumulate(state: CrossState, pairs, mask, index=None, name: str = "activations") -> CrossState:
    """Adds paired rows ``[x | x~]`` to ``state`` (donated), where ``mask`` holds.

    Args:
      state: a :class:`CrossState` of C columns.
      pairs: float (..., 2C) rows (``index`` None or an int) or (G, P, 2C) slots (``index`` (G,) ints).
      mask: bool (...) / (G, P), True for real rows.
      index: None (a single state), an int (entry of a stack) or (G,) ints (a group of experts).
      name: what the rows are, for errors.
    Raises:
      ValueError: rows whose width is not twice the state's columns, a mask of another shape, an index outside
        the stack.
    """
    c = state.cross_sum.shape[-1]
    if pairs.shape[-1] != 2 * c or tuple(mask.shape) != tuple(pairs.shape[:-1]):
        raise ValueError(f"{name}: paired rows of shape {tuple(pairs.shape)} (mask {tuple(mask.shape)}) do not fit "
                         f"a cross statistic of {c} columns (rows of {2 * c})")
    pairs, mask = jnp.asarray(pairs), jnp.asarray(mask).astype(bool)
    if index is None:
        return _add_rows(state, pairs, mask)
    entries = state.cross_sum.shape[0]
    if np.ndim(index) == 0:
        if not 0 <= int(index) < entries:
            raise ValueError(f"{name}: index {index} outside a stack of {entries} states")
        return _add_rows_at(state, jnp.int32(index), pairs, mask)
    index = np.asarray(index, np.int32)
    if pairs.ndim != 3 or index.shape != (pairs.shape[0],) or index.min() < 0 or index.max() >= entries:
        raise ValueError(f"{name}: a group of shape {tuple(pairs.shape)} for experts {index.tolist()} does not fit "
                         f"a stack of {entries} states")
    return _add_slots(state, jnp.asarray(index), pairs, mask)


@jax.jit
def finalize(state: CrossState) -> jax.Array:
    """``2 / N * sum (x~ - x) x^T``: float32 (C, C) or (E, C, C) (zeros where no token was seen), on the scale
    of :func:`jgptq.hessian.finalize`."""
    n = jnp.maximum(state.token_count, 1).astype(jnp.float32)
    return state.cross_sum * (2.0 / n)[..., None, None]
