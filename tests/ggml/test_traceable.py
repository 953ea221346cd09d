"""Registered codec functions are pure and traceable: jit, vmap, lax loops, any leading shape, deterministic."""

import jax
import jax.numpy as jnp
import numpy as np

import jgptq.ggml as gg

RNG = np.random.default_rng(11)
X = RNG.standard_normal((16, 512)).astype(np.float32)
IMP = RNG.uniform(0, 2, 512).astype(np.float32)


def test_vmap_and_leading_axes_give_the_same_bytes():
    for name in ("q4_0", "iq4_nl"):
        f = gg.get_format(name)
        flat = np.asarray(f.encode(jnp.asarray(X), jnp.asarray(IMP)))
        stacked = np.asarray(f.encode(jnp.asarray(X.reshape(4, 4, 512)), jnp.asarray(IMP)))
        mapped = np.asarray(jax.vmap(lambda r: f.encode(r, jnp.asarray(IMP)))(jnp.asarray(X)))
        assert np.array_equal(stacked.reshape(flat.shape), flat)
        assert np.array_equal(mapped.reshape(flat.shape), flat)


def test_codecs_run_inside_a_jitted_loop():
    # The way a solver uses them: encode and decode a group per step of a lax loop, inside jit.
    f = gg.get_format("iq4_xs")

    @jax.jit
    def roundtrip_all(x):
        def body(i, acc):
            group = jax.lax.dynamic_slice_in_dim(x, i * 4, 4, axis=0)
            back = f.decode(f.encode(group))
            return jax.lax.dynamic_update_slice_in_dim(acc, back, i * 4, axis=0)

        return jax.lax.fori_loop(0, x.shape[0] // 4, body, jnp.zeros_like(x))

    want = np.asarray(f.decode(f.encode(jnp.asarray(X))))
    assert np.array_equal(np.asarray(roundtrip_all(jnp.asarray(X))), want)


def test_encoding_is_deterministic_and_rows_are_independent():
    f = gg.get_format("q3_k")
    a = np.asarray(f.encode(jnp.asarray(X)))
    b = np.asarray(f.encode(jnp.asarray(X)))
    assert np.array_equal(a, b)
    perm = RNG.permutation(16)
    c = np.asarray(f.encode(jnp.asarray(X[perm])))
    assert np.array_equal(c, a[perm])


def test_legacy_row_statistic_can_be_supplied():
    # Q4_0..Q5_1 weigh blocks by a statistic of the whole row; a solver that encodes only some columns passes it.
    from jgptq.ggml.legacy import row_mean_square

    f = gg.get_format("q4_0")
    full = np.asarray(f.encode(jnp.asarray(X), jnp.asarray(IMP)))
    sigma2 = row_mean_square(jnp.asarray(X))
    want = np.mean(X.astype(np.float64) ** 2, axis=1)
    assert np.allclose(np.asarray(sigma2), want, rtol=1e-5)
    part = np.asarray(f.encode(jnp.asarray(X[:, 64:128]), jnp.asarray(IMP[64:128]), row_sigma2=sigma2))
    assert np.array_equal(part, full[:, 2 * 18:4 * 18])


def test_same_bytes_when_jax_runs_in_64_bit_mode():
    from tests.ggml.helpers import identical_blocks, load_golden

    arrays, _ = load_golden()
    with jax.enable_x64(True):
        for name, path in (("q5_0", "imp1"), ("iq4_nl", "none")):
            imp = None if path == "none" else arrays["importance"][1]
            got = np.asarray(gg.encode(arrays["x"], name, imp))
            assert identical_blocks(got, arrays[f"{name}/{path}"], gg.get_format(name).type_size).all()


def test_bytes_survive_an_inexact_float64_division_and_square_root(monkeypatch):
    # div and sqrt round a float64 result to float32. A compiler may compute that float64 result a little off
    # (e.g. a division by a constant as a multiplication by its reciprocal); a few float64 ulps cannot move a
    # float32 rounding. Inject such errors and check that the encoders still write llama.cpp's bytes.
    from jgptq.ggml import common, iq4, k_quants, legacy
    from tests.ggml.helpers import identical_blocks, load_golden

    def wobble(v, seed):
        k = (jax.lax.bitcast_convert_type(seed, jnp.int64) >> 7) % 5 - 2  # -2..2 ulps, data dependent
        for step in (1, 2):
            v = jnp.where(k >= step, jnp.nextafter(v, jnp.float64(jnp.inf)), v)
            v = jnp.where(k <= -step, jnp.nextafter(v, jnp.float64(-jnp.inf)), v)
        return v

    monkeypatch.setattr(common, "_div64", lambda a, b: wobble(a / b, a + b))
    monkeypatch.setattr(common, "_sqrt64", lambda a: wobble(jnp.sqrt(a), a))
    arrays, _ = load_golden()
    x, imp = jnp.asarray(arrays["x"]), jnp.asarray(arrays["importance"][0])
    cases = [("q4_0", legacy.encode_q4_0, imp), ("q4_k", k_quants.encode_q4_k, imp),
             ("q3_k", k_quants.encode_q3_k, None), ("iq4_xs", iq4.encode_iq4_xs, imp)]
    for name, fn, w in cases:
        got = np.asarray(jax.jit(lambda a, b, fn=fn: fn(a, b))(x, w))  # a new function: a fresh trace
        want = arrays[f"{name}/{'none' if w is None else 'imp0'}"]
        assert identical_blocks(got, want, gg.get_format(name).type_size).all(), name
