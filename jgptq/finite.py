"""NaN/Inf checks of arrays before a solve or an accumulation: one compiled program per shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_all = jax.jit(lambda a: jnp.isfinite(a).all())


def all_finite(a) -> bool:
    """Whether every element of ``a`` (a JAX or numpy array) is finite. One jitted program per shape and dtype
    (the eager ``jnp.isfinite(a).all()`` compiles two, which a bucket of a new size meets again); reading the
    answer waits for the array (one device sync)."""
    return bool(_all(a))
