"""The GPTQ Hessian statistic: a float32 sum of X^T X plus a token count.

The state is kept unnormalized (``hessian_sum = sum_t x_t x_t^T``, ``token_count = N``) so that partial sums from
any number of batches or devices add exactly; :func:`finalize` applies the ``2 / N`` factor once at the end.

- :func:`init` makes an empty state; :func:`accumulate` adds a batch in place (the sum is a donated argument:
  XLA writes the result into the same buffer, no transient of the Hessian's size). Inputs may be float32 (exact
  float32 GEMM at precision HIGHEST, never TF32) or bfloat16 operands with float32 accumulation. Activations that
  arrive as bfloat16 or float16 (a half-precision model) go to the GEMM as they are, with float32 sums, under either
  setting: a product of two such numbers is exact in float32, so this is the float32 product of the same numbers
  (up to summation order) at the half-precision GEMM rate, ~15x the float32 one.
- :class:`DevicePartials` keeps one state per device for activations that live on different devices, and merges
  them onto one device in a fixed order, freeing each partial as it is added (peak = result + one partial).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jgptq import xla_options
from jgptq.finite import all_finite

INPUT_DTYPES = ("float32", "bfloat16")


class HessianState(NamedTuple):
    """Unnormalized Hessian statistic of one input space.

    Attributes:
      hessian_sum: float32 (C, C), sum over tokens of x x^T.
      token_count: int32 scalar, the number of tokens summed.
    """

    hessian_sum: jax.Array
    token_count: jax.Array


def init(num_columns: int, device=None) -> HessianState:
    """An empty state for inputs with ``num_columns`` features, optionally placed on ``device``."""
    if num_columns < 1:
        raise ValueError(f"num_columns must be positive, got {num_columns}")
    h = jnp.zeros((num_columns, num_columns), jnp.float32)
    n = jnp.zeros((), jnp.int32)
    if device is not None:
        h, n = jax.device_put(h, device), jax.device_put(n, device)
    return HessianState(h, n)


HALF_DTYPES = (jnp.bfloat16, jnp.float16)


def _operands(x: jax.Array, input_dtype: str):
    """(GEMM operand, precision) of X^T X: float32 sums of either bfloat16 operands or float32 ones at HIGHEST.
    Half-precision inputs are kept as they are: their products are exact in float32 (8 or 11 significant bits
    each, at most 22 in the product, within float32's 24)."""
    if input_dtype == "bfloat16":
        return x.astype(jnp.bfloat16), None
    if x.dtype in HALF_DTYPES:
        return x, None
    return x.astype(jnp.float32), jax.lax.Precision.HIGHEST


def _xtx(x: jax.Array, input_dtype: str) -> jax.Array:
    x, precision = _operands(x, input_dtype)
    return jax.lax.dot_general(x, x, (((0,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("input_dtype",), donate_argnums=(0,))
def _accumulate(state: HessianState, x: jax.Array, mask: Optional[jax.Array], input_dtype: str) -> HessianState:
    x = x.reshape(-1, x.shape[-1])
    if mask is None:
        count = jnp.int32(x.shape[0])
    else:
        keep = mask.reshape(-1).astype(bool)
        x = jnp.where(keep[:, None], x, jnp.zeros((), x.dtype))
        count = jnp.sum(keep, dtype=jnp.int32)
    return HessianState(state.hessian_sum + _xtx(x, input_dtype), state.token_count + count)


def _check_batch(state: HessianState, x, mask, input_dtype: str, name: str):
    if input_dtype not in INPUT_DTYPES:
        raise ValueError(f"input_dtype must be one of {INPUT_DTYPES}, got {input_dtype!r}")
    c = state.hessian_sum.shape[-1]  # (C, C) or a stack (E, C, C)
    if x.ndim < 1 or x.shape[-1] != c:
        raise ValueError(f"{name}: activations of shape {tuple(x.shape)} do not match a Hessian of {c} columns")
    if mask is not None and tuple(mask.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{name}: mask of shape {tuple(mask.shape)} does not match activations "
                         f"{tuple(x.shape)} (expected {tuple(x.shape[:-1])})")


def accumulate(state: HessianState, x, mask=None, *, input_dtype: str = "float32", check_finite: bool = True,
               name: str = "activations") -> HessianState:
    """Adds a batch of activations to the statistic; the old state's buffers are donated (do not reuse them).

    Args:
      state: the running :class:`HessianState` (C, C).
      x: activations (..., C), any float dtype; leading axes are flattened into tokens.
      mask: optional (...) boolean/0-1 array; tokens where it is false (padding) are excluded from sum and count.
      input_dtype: ``"float32"`` (float32 GEMM at HIGHEST precision) or ``"bfloat16"`` (bf16 operands, float32
        accumulation).
      check_finite: raise on NaN/Inf activations (costs one reduction; the pipeline turns it off when it checks
        upstream).
      name: what the activations are, for error messages.
    Returns:
      The new state. A batch with zero tokens returns ``state`` unchanged.
    """
    _check_batch(state, x, mask, input_dtype, name)
    if int(np.prod(x.shape[:-1])) == 0:
        return state
    x = jnp.asarray(x)
    if check_finite and not all_finite(x):
        raise ValueError(f"{name}: activations contain NaN or Inf")
    if mask is not None:
        mask = jnp.asarray(mask)
    return _accumulate(state, x, mask, input_dtype)


@jax.jit
def _finalize(state: HessianState) -> jax.Array:
    n = jnp.maximum(state.token_count, 1).astype(jnp.float32)
    return state.hessian_sum * (2.0 / n)[..., None, None]


def finalize(state: HessianState) -> jax.Array:
    """The GPTQ Hessian ``2 / N * sum x x^T`` (float32 (C, C), or (E, C, C) for a stacked state with counts (E,));
    all zeros where no token was seen."""
    return _finalize(state)


def init_stacked(num_states: int, num_columns: int, device=None) -> HessianState:
    """An empty stack of ``num_states`` statistics (e.g. one per expert): (E, C, C) sums and (E,) counts."""
    if num_states < 1 or num_columns < 1:
        raise ValueError(f"num_states and num_columns must be positive, got {num_states}, {num_columns}")
    h = jnp.zeros((num_states, num_columns, num_columns), jnp.float32)
    n = jnp.zeros((num_states,), jnp.int32)
    if device is not None:
        h, n = jax.device_put(h, device), jax.device_put(n, device)
    return HessianState(h, n)


@functools.partial(jax.jit, static_argnames=("input_dtype",), donate_argnums=(0,))
def _accumulate_at(state: HessianState, index, x, mask, input_dtype: str) -> HessianState:
    one = HessianState(jnp.zeros_like(state.hessian_sum[0]), jnp.zeros((), jnp.int32))
    add = _accumulate.__wrapped__(one, x, mask, input_dtype)
    h = jax.lax.dynamic_update_index_in_dim(state.hessian_sum, state.hessian_sum[index] + add.hessian_sum,
                                            index, 0)
    n = state.token_count.at[index].add(add.token_count)
    return HessianState(h, n)


def accumulate_at(state: HessianState, index: int, x, mask=None, *, input_dtype: str = "float32",
                  check_finite: bool = True, name: str = "activations") -> HessianState:
    """Adds a batch to entry ``index`` of a stacked state (:func:`init_stacked`), in place (donated).

    Args and return as :func:`accumulate`, with ``state`` of shapes (E, C, C) / (E,) and ``index`` in [0, E).
    """
    _check_batch(state, x, mask, input_dtype, name)
    if not 0 <= int(index) < state.hessian_sum.shape[0]:
        raise ValueError(f"{name}: index {index} outside a stack of {state.hessian_sum.shape[0]} states")
    if int(np.prod(x.shape[:-1])) == 0:
        return state
    x = jnp.asarray(x)
    if check_finite and not all_finite(x):
        raise ValueError(f"{name}: activations contain NaN or Inf")
    if mask is not None:
        mask = jnp.asarray(mask)
    return _accumulate_at(state, jnp.int32(index), x, mask, input_dtype)


def _slot_products(x, mask, input_dtype: str):
    """(masked x, per-slot X^T X float32 (G, C, C), real rows per slot (G,)) of a padded group (traced)."""
    x = jnp.where(mask[..., None], x, jnp.zeros((), x.dtype))
    xo, precision = _operands(x, input_dtype)
    h = jax.lax.dot_general(xo, xo, (((1,), (1,)), ((0,), (0,))), precision=precision,
                            preferred_element_type=jnp.float32)
    counts = jnp.sum(mask, axis=1, dtype=jnp.int32)
    return x, h, counts


def slot_squares(x):
    """float32 (G, C) per-slot column sums of squares of a group ``x`` (G, P, C) (traced), summed over P by a fixed
    pairwise tree: each slot's sums are the same bytes whatever G (a reduction over P compiles to other loops for a
    smaller group on XLA:CPU), so experts added in groups of any size agree."""
    sq = jnp.square(x.astype(jnp.float32))
    while sq.shape[1] > 1:
        if sq.shape[1] % 2:
            sq = jnp.concatenate([sq, jnp.zeros_like(sq[:, :1])], axis=1)
        half = sq.shape[1] // 2
        sq = sq[:, :half] + sq[:, half:]
    return sq[:, 0]


@functools.partial(jax.jit, static_argnames=("input_dtype",), donate_argnums=(0, 1),
                   compiler_options=xla_options.gemm_options())
def _accumulate_group(state: HessianState, sums, index, x, mask, input_dtype: str):
    x, h, counts = _slot_products(x, mask, input_dtype)
    sq = slot_squares(x)
    return (HessianState(state.hessian_sum.at[index].add(h), state.token_count.at[index].add(counts)),
            sums.at[index].add(sq))


def accumulate_group(state: HessianState, sums, index, x, mask, *, input_dtype: str = "float32",
                     name: str = "activations"):
    """Adds padded rows of a group of experts to a stacked state and its sums of squares, in one call.

    Args:
      state: stacked state (E, C, C) / (E,) (:func:`init_stacked`), donated.
      sums: float32 (E, C) per-column sums of x^2 (the importance statistic of :func:`accumulate_squares`), donated.
      index: int (G,): the expert each slot of the group adds to (a slot whose mask is all False adds nothing, so
        padding slots may name any expert).
      x: float (G, P, C): P rows per slot (padding rows anywhere, excluded by ``mask``).
      mask: bool (G, P), True for real rows.
    Returns:
      (state, sums), updated. Each expert's entries equal :func:`accumulate_at` / :func:`accumulate_squares`
      of its real rows (up to float32 summation order).
    """
    _check_batch(state, x, mask, input_dtype, name)
    e = state.hessian_sum.shape[0]
    index = np.asarray(index, np.int32)
    if x.ndim != 3 or index.shape != (x.shape[0],) or index.min() < 0 or index.max() >= e \
            or sums.shape != (e, x.shape[-1]):
        raise ValueError(f"{name}: a group of shape {tuple(x.shape)} for experts {index.tolist()} does not fit a "
                         f"stack of {e} experts (sums {tuple(sums.shape)})")
    return _accumulate_group(state, sums, jnp.asarray(index), jnp.asarray(x), jnp.asarray(mask), input_dtype)


def add_slots(state: HessianState, index, x, mask, input_dtype: str) -> HessianState:
    """The traceable body of :func:`accumulate_slots` (no checks; for use inside a jitted program)."""
    x, h, counts = _slot_products(x, mask, input_dtype)
    return HessianState(state.hessian_sum.at[index].add(h), state.token_count.at[index].add(counts))


_accumulate_slots = functools.partial(jax.jit, static_argnames=("input_dtype",), donate_argnums=(0,),
                                      compiler_options=xla_options.gemm_options())(add_slots)


def accumulate_slots(state: HessianState, index, x, mask, *, input_dtype: str = "float32",
                     name: str = "activations") -> HessianState:
    """Adds padded rows of a group of experts to a stacked state in one call: :func:`accumulate_group` without
    the sums of squares (the same Hessian sums and counts, bit for bit).

    Args:
      state: stacked state (E, C, C) / (E,) (:func:`init_stacked`), donated.
      index: int (G,): the expert each slot of the group adds to (a slot whose mask is all False adds nothing).
      x: float (G, P, C): P rows per slot; mask: bool (G, P), True for real rows.
    Returns:
      The updated state.
    """
    _check_batch(state, x, mask, input_dtype, name)
    index = check_group(state.hessian_sum.shape[0], index, x, name)
    return _accumulate_slots(state, jnp.asarray(index), jnp.asarray(x), jnp.asarray(mask), input_dtype)


def check_group(entries: int, index, x, name: str = "activations") -> np.ndarray:
    """``index`` as int32 (G,) when it names one of ``entries`` experts for each of the G slots of ``x`` (G, P, C);
    raises ValueError otherwise."""
    index = np.asarray(index, np.int32)
    if x.ndim != 3 or index.shape != (x.shape[0],) or index.min() < 0 or index.max() >= entries:
        raise ValueError(f"{name}: a group of shape {tuple(x.shape)} for experts {index.tolist()} does not fit a "
                         f"stack of {entries} experts")
    return index


def from_activations(x, mask=None, *, input_dtype: str = "float32") -> HessianState:
    """A state holding exactly the tokens of ``x`` (..., C): a convenience for tests and one-shot use."""
    return accumulate(init(x.shape[-1]), x, mask, input_dtype=input_dtype)


@jax.jit
def _add(a: HessianState, b: HessianState) -> HessianState:
    return HessianState(a.hessian_sum + b.hessian_sum, a.token_count + b.token_count)


_add_donated = jax.jit(_add.__wrapped__, donate_argnums=(0,))


def _device_of(x):
    devices = getattr(x, "devices", None)
    if devices is None:
        return jax.devices()[0]
    ds = devices()
    if len(ds) != 1:
        raise ValueError("activations sharded over several devices: pass per-device shards separately")
    return next(iter(ds))


class DevicePartials:
    """One Hessian state per device, for activations that live on different devices.

    Each batch is accumulated on the device that holds it (no transfer of activations). :meth:`merge` reduces
    the partials onto one target device in a fixed order (by device id), deleting each partial once it has been
    added, so that the peak on the target is the result plus one partial. The same tokens give the same bytes
    whatever their split over devices only up to float32 summation order; the order is fixed, so a given split
    always gives the same bytes.
    """

    def __init__(self, num_columns: int, *, input_dtype: str = "float32"):
        if input_dtype not in INPUT_DTYPES:
            raise ValueError(f"input_dtype must be one of {INPUT_DTYPES}, got {input_dtype!r}")
        self.num_columns = int(num_columns)
        self.input_dtype = input_dtype
        self._partials: dict = {}

    @property
    def devices(self) -> list:
        return sorted(self._partials, key=lambda d: (d.platform, d.id))

    def accumulate(self, x, mask=None, *, name: str = "activations"):
        """Adds a batch on the device that holds ``x``."""
        dev = _device_of(x)
        state = self._partials.get(dev)
        if state is None:
            state = init(self.num_columns, dev)
        self._partials[dev] = accumulate(state, x, mask, input_dtype=self.input_dtype, name=name)

    def merge(self, device=None) -> HessianState:
        """Sums every partial onto ``device`` (default: the first device in id order) and empties this object."""
        if not self._partials:
            return init(self.num_columns, device)
        order = self.devices
        target = device if device is not None else order[0]
        result = None
        for dev in order:
            part = self._partials.pop(dev)
            part = jax.device_put(part, target)
            if result is None:
                result = part
            else:
                result = _add_donated(result, part)
                jax.tree.map(lambda a: a.delete(), part)
        return result


@functools.partial(jax.jit, donate_argnums=(0,))
def _squares_at(sums, index, x, mask):
    x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    sq = jnp.square(x) if mask is None else jnp.where(mask.reshape(-1)[:, None], jnp.square(x), 0.0)
    return sums.at[index].add(jnp.sum(sq, axis=0))


def accumulate_squares(sums, index: int, x, mask=None):
    """Adds the per-column sums of squares of the rows of ``x`` (where ``mask`` holds) to row ``index`` of ``sums``.

    The importance statistic of llama.cpp (:mod:`jgptq.imatrix`): ``sums[index, j] += sum_t x_tj^2`` in float32.

    Args:
      sums: float32 (E, C), donated (updated in place).
      index: which row (expert) the tokens belong to.
      x: float (..., C) activations; mask: bool (...) or None (every row).
    Returns:
      The updated (E, C) sums.
    """
    return _squares_at(sums, jnp.int32(index), jnp.asarray(x), None if mask is None else jnp.asarray(mask))
