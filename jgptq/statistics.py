"""Statistics of a layer's inputs as pairs of pure functions, chained by a capture (the optax way).

A :class:`Statistic` is ``init(columns, entries, device) -> state``, ``update(state, x, mask, index) -> state`` and
``finalize(state) -> result``. A capture (the torch one, :class:`jgptq_torch.pipeline.capture.Collector`) holds a chain of named
statistics and applies each to every input it sees; it knows nothing of what they compute.

- :func:`hessian_sum`: GPTQ's float32 sum of X^T X and token count (:mod:`jgptq.hessian`); finalized to
  ``(2 / N * sum x x^T, token counts)``; optionally each expert's token weighted by a power of its routing weight.
- :func:`importance`: llama.cpp's importance statistic (:mod:`jgptq.imatrix`): per input column the float32 sum of
  squared inputs, and the token count; finalized to an :class:`jgptq.imatrix.ImatrixEntry`. It sees the tokens a
  weight saw: for experts, the routed ones only.
- :func:`error_cross`: the error-feedback cross statistic (:mod:`jgptq.error_cross`): the float32 sum of
  ``(x~ - x) x^T`` over paired rows ``[x | x~]`` (the run's input and the float model's at the same token), finalized
  to ``2 / N * sum``; collected only for a method that declares it (:func:`of_config`).
- :func:`calibration`: the chain of the layerwise pipeline, ``{"hessian": ..., "imatrix": ...}``.

Forms of ``update`` (one state per weight input, or a stack of ``entries`` states, one per expert):

- ``index=None``: ``x`` (N, C) rows and ``mask`` (N,) of a weight with one state (``entries=None``);
- ``index=e`` (an int): the rows of expert ``e`` of a stacked state;
- ``index`` (G,) ints: a group of experts at once, ``x`` (G, P, C) and ``mask`` (G, P), P rows per slot (a slot
  whose mask is all False adds nothing, so padding slots may name any expert).

Rows where ``mask`` is False are neither summed nor counted. Updates donate the state (do not reuse the old one).
Activations are not checked for NaN/Inf here (the capture checks them upstream).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jgptq import error_cross as cross
from jgptq import hessian, xla_options
from jgptq.imatrix import ImatrixEntry

HESSIAN, IMATRIX, ERROR_CROSS = "hessian", "imatrix", "error_cross"


class Statistic(NamedTuple):
    """A statistic of a weight's inputs.

    Attributes:
      init: ``(columns, entries=None, device=None) -> state``: an empty state for C = ``columns`` input features;
        ``entries`` E stacks one state per expert (None: one state).
      update: ``(state, x, mask, index=None, name="activations") -> state`` (see the module docstring for the
        forms of ``index``; ``name`` is what the rows are, for errors).
      finalize: ``(state) -> result``.
      all_experts: for experts, the statistic sees every token (the ``all_experts`` calibration), not only the
        routed ones; the gate/up inputs are then the same for every expert and share one state.
      slots: optional traceable ``(state, index (G,), x (G, P, C), mask (G, P)) -> state``, the group form of
        ``update`` without checks: :func:`update_group` runs the group updates of a whole chain as one jitted
        program with it (one dispatch per group instead of one per statistic). Must be the same object from
        call to call (it keys the compiled program).
      router_power: for experts' routed rows, the capture hands this statistic each row times ``p ** (router_power
        / 2)``, ``p`` the routing weight the expert's output is multiplied by, so that a sum of products x x^T
        weighs each token by ``p ** router_power`` (0: the rows as they are; rows of linear modules always are).
      paired: the statistic reads paired rows ``[x | x~]`` (..., 2C): a weight's input in the run and the float
        model's input to it at the same token; ``init`` still gets C. The capture feeds it only where it has the
        float stream's inputs beside the run's, and never in one update with unpaired statistics.
    """

    init: Callable[..., Any]
    update: Callable[..., Any]
    finalize: Callable[[Any], Any]
    all_experts: bool = False
    slots: Optional[Callable[..., Any]] = None
    router_power: float = 0.0
    paired: bool = False


# -- GPTQ's Hessian -----------------------------------------------------------------------------------------------
def hessian_sum(input_dtype: str = "float32", all_experts: bool = False, router_power: float = 0.0) -> Statistic:
    """The Hessian statistic: state :class:`jgptq.hessian.HessianState` (float32 (C, C) or (E, C, C) sums of
    x x^T, int32 token counts).

    Args:
      input_dtype: ``"float32"`` (float32 products at HIGHEST precision) or ``"bfloat16"`` (bf16 operands, float32
        accumulation).
      all_experts: experts' Hessians see every token (see :class:`Statistic`).
      router_power: experts' Hessians weigh each routed token by its routing weight to this power (see
        :class:`Statistic`; 2 is the expert's share of the squared output error). Not with ``all_experts``.
    Returns:
      A :class:`Statistic` whose ``finalize`` gives ``(2 / N * sum w x x^T`` float32 (C, C) or (E, C, C), ``w``
      the token weights (1 unless ``router_power``), token counts as an int or a list of E ints).
    """
    if input_dtype not in hessian.INPUT_DTYPES:
        raise ValueError(f"input_dtype must be one of {hessian.INPUT_DTYPES}, got {input_dtype!r}")
    if router_power < 0 or (router_power and all_experts):
        raise ValueError(f"router_power={router_power!r} must be >= 0, and 0 with all_experts (a token not routed "
                         f"to an expert has routing weight 0 there)")

    def init(columns: int, entries=None, device=None):
        return hessian.init(columns, device) if entries is None else hessian.init_stacked(entries, columns, device)

    def update(state, x, mask, index=None, name: str = "activations"):
        if index is None:
            return hessian.accumulate(state, x, mask, input_dtype=input_dtype, check_finite=False, name=name)
        if np.ndim(index) == 0:
            return hessian.accumulate_at(state, index, x, mask, input_dtype=input_dtype, check_finite=False,
                                         name=name)
        return hessian.accumulate_slots(state, index, x, mask, input_dtype=input_dtype, name=name)

    def finalize(state):
        return hessian.finalize(state), state.token_count.tolist()

    return Statistic(init, update, finalize, all_experts, _hessian_slots(input_dtype), float(router_power))


@functools.lru_cache(maxsize=None)
def _hessian_slots(input_dtype: str):
    """The Hessian's group update for one operand dtype (one function object per dtype)."""
    return functools.partial(hessian.add_slots, input_dtype=input_dtype)


# -- llama.cpp's importance ---------------------------------------------------------------------------------------
class SquaresState(NamedTuple):
    """Per-column sums of squared inputs: float32 (E, C) ``sums`` and int32 (E,) ``token_count`` (E = 1 for a
    weight with one state)."""

    sums: jax.Array
    token_count: jax.Array


@functools.partial(jax.jit, donate_argnums=(0,))
def _squares_rows(state: SquaresState, index, x, mask) -> SquaresState:
    x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    keep = mask.reshape(-1)
    sq = jnp.where(keep[:, None], jnp.square(x), 0.0)
    return SquaresState(state.sums.at[index].add(jnp.sum(sq, axis=0)),
                        state.token_count.at[index].add(jnp.sum(keep, dtype=jnp.int32)))


def _add_squares(state: SquaresState, index, x, mask) -> SquaresState:
    x = jnp.where(mask[..., None], x, jnp.zeros((), x.dtype))
    sq = hessian.slot_squares(x)
    return SquaresState(state.sums.at[index].add(sq),
                        state.token_count.at[index].add(jnp.sum(mask, axis=1, dtype=jnp.int32)))


_squares_slots = jax.jit(_add_squares, donate_argnums=(0,))


def importance() -> Statistic:
    """The importance statistic of llama.cpp's imatrix: state :class:`SquaresState`; ``finalize`` gives an
    :class:`jgptq.imatrix.ImatrixEntry` (float32 numpy (E, C) sums, float32 (E,) counts). It never sees every
    token of an expert (``all_experts`` False): llama.cpp's statistic is over routed tokens."""

    def init(columns: int, entries=None, device=None):
        sums = jnp.zeros((entries or 1, columns), jnp.float32)
        counts = jnp.zeros((entries or 1,), jnp.int32)
        if device is not None:
            sums, counts = jax.device_put(sums, device), jax.device_put(counts, device)
        return SquaresState(sums, counts)

    def update(state, x, mask, index=None, name: str = "activations"):
        if x.shape[-1] != state.sums.shape[-1]:
            raise ValueError(f"{name}: activations of shape {tuple(x.shape)} do not match sums of "
                             f"{state.sums.shape[-1]} columns")
        if index is None or np.ndim(index) == 0:
            return _squares_rows(state, jnp.int32(index or 0), jnp.asarray(x), jnp.asarray(mask))
        index = hessian.check_group(state.sums.shape[0], index, x, name)
        return _squares_slots(state, jnp.asarray(index), jnp.asarray(x), jnp.asarray(mask))

    def finalize(state):
        return ImatrixEntry(np.asarray(state.sums, np.float32), np.asarray(state.token_count, np.float32))

    return Statistic(init, update, finalize, False, _add_squares)


@functools.lru_cache(maxsize=None)
def _chain_program(slots: tuple):
    def group_update(states, index, x, mask):
        return tuple(f(s, index, x, mask) for f, s in zip(slots, states))

    return jax.jit(group_update, donate_argnums=(0,), compiler_options=xla_options.gemm_options())


def update_group(chain, states: list, index, x, mask, name: str = "activations") -> list:
    """Every statistic of ``chain`` updated with one group of experts (the ``index`` (G,) form of ``update``).

    Where every statistic has a ``slots`` form, the updates run as ONE jitted program (the masked rows shared);
    otherwise one ``update`` call each. ``states`` (their stacks of E entries) are donated.

    Returns:
      The updated states, in chain order.
    """
    chain = list(chain)
    if not chain or any(s.slots is None for s in chain):
        return [s.update(st, x, mask, index, name=name) for s, st in zip(chain, states)]
    entries = jax.tree_util.tree_leaves(states[0])[0].shape[0]
    index = hessian.check_group(entries, index, x, name)
    for s, st in zip(chain, states):
        cols = st.hessian_sum.shape[-1] if isinstance(st, hessian.HessianState) else \
            st.sums.shape[-1] if isinstance(st, SquaresState) else \
            st.cross_sum.shape[-1] if isinstance(st, cross.CrossState) else x.shape[-1]
        if cols * (2 if s.paired else 1) != x.shape[-1]:
            raise ValueError(f"{name}: activations of shape {tuple(x.shape)} do not match a state of {cols} columns")
    if tuple(mask.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{name}: mask of shape {tuple(mask.shape)} does not match activations {tuple(x.shape)}")
    return list(_chain_program(tuple(s.slots for s in chain))(tuple(states), jnp.asarray(index), x, mask))


_COMPILED: dict = {}     # group program key -> Event, set once compiled (or left to the caller's own first call)
_LOCK = threading.Lock()


def _aval(a):
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None))


def _group_key(slots: tuple, state_avals, x, mask, g: int, p: int) -> tuple:
    return (slots, str(state_avals), x.shape[-1], str(x.dtype), str(mask.dtype), str(_aval(x).sharding), g, p)


def _claim(key) -> tuple:
    """(the key's Event, whether the caller is the one to compile it)."""
    with _LOCK:
        event = _COMPILED.get(key)
        if event is not None:
            return event, False
        event = _COMPILED[key] = threading.Event()
        return event, True


def _compile_claimed(key, event, program, state_avals, g: int, p: int, x, mask) -> None:
    """Compiles the claimed group program of ``key``; a failure gives the key back (its first call compiles it and
    meets the error itself) before raising."""
    try:
        program.lower(state_avals, jax.ShapeDtypeStruct((g,), jnp.int32),
                      jax.ShapeDtypeStruct((g, p, x.shape[-1]), x.dtype, sharding=_aval(x).sharding),
                      jax.ShapeDtypeStruct((g, p), mask.dtype, sharding=_aval(mask).sharding)).compile()
    except BaseException:
        with _LOCK:
            _COMPILED.pop(key, None)
        raise
    finally:
        event.set()


def compile_group(chain, state_avals, g: int, p: int, x, mask) -> bool:
    """Compiles ahead the program :func:`update_group` runs for a group of ``g`` slots of ``p`` rows, from
    shapes only: ``state_avals``, the chain's stacked states as ``jax.ShapeDtypeStruct`` (with the shardings the
    states will have), ``x`` and ``mask`` avals of any leading shape giving the columns C, dtypes and shardings
    of the group's (g, p, C) rows and (g, p) mask. For a warm-up on a worker thread: a program compiled or being
    compiled (here or by :func:`compile_groups`) is not compiled again, and :func:`compile_groups` waits for one
    under way. Returns whether this call compiled it (False: claimed before, or no one-program form)."""
    chain = list(chain)
    if not chain or any(s.slots is None for s in chain):
        return False
    slots = tuple(s.slots for s in chain)
    state_avals = tuple(state_avals)
    key = _group_key(slots, state_avals, x, mask, g, p)
    event, mine = _claim(key)
    if mine:
        _compile_claimed(key, event, _chain_program(slots), state_avals, g, p, x, mask)
    return mine


def compile_groups(chain, states: list, shapes, x, mask, workers: Optional[int] = None) -> int:
    """Compiles, side by side on threads, the programs :func:`update_group` will run for groups of experts of
    each ``(G, P)`` in ``shapes`` (G slots of P rows, the columns and dtypes of ``x`` and ``mask``), so that a
    forward meeting several new group shapes waits for about the slowest compile instead of their sum (a MoE
    layer's first forwards meet a few dozen; XLA compiles each on one core). The jitted program then finds them
    compiled: the results are those of compiling on first use. Programs another thread is compiling
    (:func:`compile_group`, a warm-up) are waited for, not compiled again.

    ``states`` are the chain's (initialized) states; nothing is run or donated. Returns the number compiled (0
    where the chain has no one-program form, or fewer than two shapes are new: a lone new one is left to its
    first call).
    """
    import concurrent.futures
    import os

    chain = list(chain)
    if not chain or any(s.slots is None for s in chain):
        return 0
    slots = tuple(s.slots for s in chain)
    state_avals = jax.tree.map(_aval, tuple(states))
    keys = {gp: _group_key(slots, state_avals, x, mask, *gp) for gp in dict.fromkeys(shapes)}
    with _LOCK:
        new = [gp for gp, key in keys.items() if key not in _COMPILED]
        under_way = [_COMPILED[key] for key in keys.values() if key in _COMPILED]
        for gp in new:
            _COMPILED[keys[gp]] = threading.Event()
        if len(new) < 2:   # left to the first call, right after this one; no one else compiles it
            for gp in new:
                _COMPILED[keys[gp]].set()
    if len(new) >= 2:
        program = _chain_program(slots)

        def compile_one(gp):
            key = keys[gp]
            _compile_claimed(key, _COMPILED[key], program, state_avals, *gp, x, mask)

        workers = workers or max(1, min(len(new), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jgptq-compile") as pool:
            list(pool.map(compile_one, new))
    for event in under_way:
        event.wait()
    return len(new) if len(new) >= 2 else 0


# -- error feedback's cross statistic -----------------------------------------------------------------------------
def error_cross(router_power: float = 0.0) -> Statistic:
    """The error-feedback cross statistic: state :class:`jgptq.error_cross.CrossState`; rows paired ``[x | x~]``
    (``paired``); ``finalize`` gives ``2 / N * sum (x~ - x) x^T`` float32 (C, C) or (E, C, C).

    Args:
      router_power: experts' paired rows weighted as the Hessian's are (both halves scaled, so each token's product
        is weighted by ``p ** router_power``), to stay on the scale of a router-weighted Hessian.
    """
    if router_power < 0:
        raise ValueError(f"router_power={router_power!r} must be >= 0")

    def update(state, x, mask, index=None, name: str = "activations"):
        return cross.accumulate(state, x, mask, index, name=name)

    return Statistic(cross.init, update, cross.finalize, False, cross.add_slots, float(router_power), True)


def calibration(input_dtype: str = "float32", all_experts: bool = False, router_power: float = 0.0) -> dict:
    """The statistics of the layerwise pipeline, in the order the capture applies them: ``{"hessian":``
    :func:`hessian_sum` ``(input_dtype, all_experts, router_power), "imatrix":`` :func:`importance` ``()}``."""
    return {HESSIAN: hessian_sum(input_dtype, all_experts, router_power), IMATRIX: importance()}


def of_config(cfg) -> dict:
    """The statistics a layer's solve needs under ``cfg`` (a :class:`jgptq.config.PipelineConfig`):
    :func:`calibration` with the Hessian sum in ``cfg.hessian_dtype``, of every token at every expert with
    ``moe.calibration="all_experts"``, experts' tokens weighted by a power of their routing weight with
    ``moe.router_weighting``, and :func:`error_cross` (the same router weighting) when ``cfg.method`` declares it.
    The torch pipeline collects what this returns; an option that changes what is collected is read here.

    Raises:
      ValueError: ``cfg.method`` declares a statistic (:attr:`jgptq.methods.Method.statistics`) not collected;
        the cross statistic with ``moe.calibration="all_experts"`` (its pairs are routed tokens only).
    """
    from jgptq.methods import registry

    every = cfg.moe.calibration == "all_experts"
    chain = calibration(cfg.hessian_dtype, all_experts=every, router_power=cfg.moe.router_power)
    declared = registry.get(cfg.method).statistics
    if ERROR_CROSS in declared:
        if every:
            raise ValueError(f"method {cfg.method!r} reads the error-feedback statistic, which pairs each routed "
                             f"token's inputs; it cannot be combined with calibration='all_experts'")
        chain[ERROR_CROSS] = error_cross(cfg.moe.router_power)
    missing = [s for s in declared if s not in chain]
    if missing:
        raise ValueError(f"method {cfg.method!r} reads the statistics {missing}, which the pipeline does not "
                         f"collect (it collects {list(chain)})")
    return chain
