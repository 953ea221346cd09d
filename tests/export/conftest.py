"""Real GPTQ results for the exporter tests, solved once per configuration and shared by every test file."""

import functools

import numpy as np
import pytest

from jgptq import QuantConfig
from jgptq.export import QuantizedWeight
from jgptq.gptq import solve, solve_experts
from tests.conftest import correlated_activations

ROWS, COLS, GROUP = 48, 96, 32  # 48 * 3 and 96 * 3 bits are not multiples of 32: 3-bit words cross boundaries


def config(bits=4, group_size=GROUP, sym=True, act_order="none", scale_dtype="float16"):
    return QuantConfig(bits=bits, group_size=group_size, sym=sym, act_order=act_order, block_size=32,
                       scale_dtype=scale_dtype)


@functools.lru_cache(maxsize=None)
def _hessian(cols):
    x = correlated_activations(np.random.default_rng(7), 4 * cols, cols)
    return (x.T @ x / x.shape[0]).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _weight(rows, cols, seed):
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


@functools.lru_cache(maxsize=None)
def solved(cfg: QuantConfig, rows=ROWS, cols=COLS, seed=0, positive_row=False):
    """(GPTQResult, QuantizedWeight) of a random weight; ``positive_row`` makes row 0 all positive (an
    asymmetric grid then has zero point 0 there)."""
    w = _weight(rows, cols, seed).copy()
    if positive_row:
        w[0] = np.abs(w[0]) + 0.1
    result = solve(w, _hessian(cols), cfg)
    return result, QuantizedWeight.from_result(result, cfg)


@functools.lru_cache(maxsize=None)
def solved_experts(cfg: QuantConfig, experts=7, rows=64, cols=64):
    """A stack of 7 weights (64, 64): fused experts, or every Linear of a one-layer model of width 64."""
    w = np.stack([_weight(rows, cols, 100 + e) for e in range(experts)])
    result = solve_experts(w, _hessian(cols), cfg)
    return result, QuantizedWeight.from_result(result, cfg)


GRIDS = [pytest.param(b, s, g, id=f"{b}bit-{'sym' if s else 'asym'}-{'g' + str(g) if g > 0 else 'channel'}")
         for b in (2, 3, 4, 8) for s in (True, False) for g in (GROUP, -1)]
