"""Column orders of the GPTQ solve (act-order) and the group each solved column belongs to.

The solve visits columns in the order ``perm`` (``perm[i]`` = original column solved at step i):

- ``none``: natural order.
- ``desc``: descending Hessian diagonal (most active inputs first); groups are formed in solve order, so the
  group index of an original column (``g_idx``) is not monotonic.
- ``static``: descending diagonal, but groups stay those of the original order, with grids fitted once from the
  original weight; ``g_idx`` is the plain ``column // group_size``.
- ``group_aware`` (GAR): columns sorted by descending diagonal inside each group, and groups ordered by their
  largest diagonal; each group stays contiguous, so ``g_idx`` is monotonic.

Ties keep the lower column index first (stable sorts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jgptq.config import QuantConfig


def uses_precomputed_grids(config: QuantConfig) -> bool:
    """True when every grid is fitted once from the original weight (static groups, static order, per channel)."""
    return config.static_groups or config.act_order == "static" or config.group_size == -1


def column_order(diag: jax.Array, config: QuantConfig) -> jax.Array:
    """The solve order ``perm`` (int32 (C,)) for a Hessian diagonal ``diag`` (C,)."""
    c = diag.shape[-1]
    if config.act_order == "none":
        return jnp.arange(c, dtype=jnp.int32)
    if config.act_order in ("desc", "static") or config.group_size == -1:
        return jnp.argsort(-diag, stable=True).astype(jnp.int32)
    gs = config.group_size
    per_group = diag.reshape(c // gs, gs)
    local = jnp.argsort(-per_group, axis=1, stable=True)
    group_order = jnp.argsort(-per_group.max(axis=1), stable=True)
    perm = local[group_order] + (group_order * gs)[:, None]
    return perm.reshape(c).astype(jnp.int32)


def solve_group_ids(perm: jax.Array, config: QuantConfig) -> jax.Array:
    """Index into the grid table of the column solved at each step (int32, same length as ``perm``)."""
    if config.group_size == -1:
        return jnp.zeros_like(perm)
    gs = config.group_size
    if config.act_order == "desc" and not uses_precomputed_grids(config):
        return jnp.arange(perm.shape[0], dtype=jnp.int32) // gs
    return perm // gs
