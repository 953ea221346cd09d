"""Public encode/decode: validation errors name the tensor and the rule; good input round-trips."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jgptq.ggml as gg
from tests.ggml.helpers import FORMATS

X = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32)  # the golden shape: compiled once


def test_every_family_of_this_package_is_registered():
    assert set(FORMATS) <= set(gg.format_names())
    for name in FORMATS:
        f = gg.get_format(name)
        assert f.encode is not None and f.decode is not None and not f.requires_importance


def test_unknown_format_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown GGML format 'q9_9'.*q4_k"):
        gg.encode(X, "q9_9")
    with pytest.raises(ValueError, match="unknown GGML format"):
        gg.decode(np.zeros((1, 18), np.uint8), "nope")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_refused(bad):
    x = X.copy()
    x[1, 7] = bad
    with pytest.raises(ValueError, match="x contains 1 NaN or Inf"):
        gg.encode(x, "q4_0")


def test_row_length_must_be_a_multiple_of_the_block():
    with pytest.raises(ValueError, match=r"shape \(16, 96\).*not a multiple of the q4_k block size 256"):
        gg.encode(X[:, :96], "q4_k")
    with pytest.raises(ValueError, match=r"shape \(16, 40\).*q8_0 block size 32"):
        gg.encode(X[:, :40], "q8_0")
    with pytest.raises(ValueError, match="non-zero length"):
        gg.encode(np.zeros((16, 0), np.float32), "q8_0")


def test_x_must_be_float():
    with pytest.raises(ValueError, match="x must be a float array"):
        gg.encode(np.ones((1, 32), np.int32), "q8_0")


@pytest.mark.parametrize(
    "imp, rule",
    [
        (np.ones(511, np.float32), r"importance must have shape \(512,\)"),
        (np.ones((2, 512), np.float32), r"importance must have shape \(512,\)"),
        (np.r_[np.ones(511), -1.0].astype(np.float32), "negative"),
        (np.r_[np.ones(511), np.nan].astype(np.float32), "NaN or Inf"),
        (np.r_[np.ones(511), np.inf].astype(np.float32), "NaN or Inf"),
    ],
)
def test_bad_importance_is_refused(imp, rule):
    with pytest.raises(ValueError, match=rule):
        gg.encode(X, "q4_k", imp)


def test_format_that_requires_importance_refuses_to_run_without():
    base = gg.get_format("q4_k")
    strict = dataclasses.replace(base, requires_importance=True)
    with pytest.raises(ValueError, match="requires importance"):
        gg.encode(X, strict)
    assert np.array_equal(np.asarray(gg.encode(X, strict, np.ones(512, np.float32))),
                          np.asarray(gg.encode(X, "q4_k", np.ones(512, np.float32))))


def test_payload_must_be_whole_uint8_blocks():
    with pytest.raises(ValueError, match="payload must be uint8"):
        gg.decode(np.zeros((1, 18), np.int8), "q4_0")
    with pytest.raises(ValueError, match=r"shape \(1, 20\).*q4_0 block size in bytes \(18\)"):
        gg.decode(np.zeros((1, 20), np.uint8), "q4_0")


def test_case_insensitive_names_and_format_objects():
    p1 = np.asarray(gg.encode(X, "Q6_K"))
    p2 = np.asarray(gg.encode(jnp.asarray(X), gg.get_format("q6_k")))
    assert p1.dtype == np.uint8 and p1.shape == (16, 420) and np.array_equal(p1, p2)
    back = gg.decode(p1, "q6_k")
    assert back.dtype == jnp.float32 and back.shape == X.shape
    assert float(jnp.max(jnp.abs(back - X))) < 0.1


def test_other_float_dtypes_are_converted():
    x16 = X.astype(np.float16)
    assert np.array_equal(np.asarray(gg.encode(x16, "q8_0")), np.asarray(gg.encode(x16.astype(np.float32), "q8_0")))
