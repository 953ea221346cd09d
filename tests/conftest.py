import os
import sys

# Tests run on the CPU backend unless a test opts into a GPU; keep JAX from grabbing GPU memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# No persistent compilation cache in the suite (tests/test_xla_options.py checks it apart): xdist workers then never
# share compiled programs through a folder, and every run compiles what it tests.
os.environ.setdefault("JGPTQ_COMPILATION_CACHE", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def correlated_activations(rng, tokens, cols, *, dtype=np.float32):
    """Activations with correlated, unequally scaled features (as real layer inputs have)."""
    mix = rng.standard_normal((cols, cols)) / np.sqrt(cols) + np.eye(cols)
    scale = np.exp(rng.uniform(-1.5, 1.5, cols))
    return ((rng.standard_normal((tokens, cols)) @ mix) * scale).astype(dtype)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
