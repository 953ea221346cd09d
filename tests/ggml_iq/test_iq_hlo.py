"""IQ encoders and decoders: no float-conversion chains in their optimized HLO (XLA:GPU would collapse them).

See tests/ggml/hlo_chains.py. The encoder compilations are those of test_iq_golden.py (same inputs), so this
costs little when both run in one session.
"""

import os

import jax
import numpy as np
import pytest

from tests.ggml.hlo_chains import convert_chains
from tests.ggml_iq.common import FORMATS, modes

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "ggml_iq", "golden.npz")


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as data:
        return {k: data[k] for k in data.files}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_no_float_conversion_chains(golden, name):
    fmt = FORMATS[name]
    mode = modes(fmt)[0]
    hlo = fmt.encode.lower(golden["x"], golden[f"imp_{mode}"]).compile().as_text()
    assert convert_chains(hlo) == []
    payload = golden[f"payload_{name}_{mode}"]
    assert convert_chains(jax.jit(fmt.decode).lower(payload).compile().as_text()) == []
