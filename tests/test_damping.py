import jax.numpy as jnp
import numpy as np

from jgptq import damping
from tests.conftest import correlated_activations


def spd(rng, c, tokens=None):
    x = correlated_activations(rng, tokens or 4 * c, c).astype(np.float64)
    return 2 / x.shape[0] * x.T @ x


def test_factor_matches_float64_inverse(rng):
    h = spd(rng, 40)
    res = damping.hessian_factor(jnp.asarray(h, jnp.float32), 0.01)
    hd = h + 0.01 * np.mean(np.diag(h)) * np.eye(40)
    t = np.asarray(res.upper, np.float64)
    assert np.allclose(np.triu(t), t) and np.all(np.diag(t) > 0)
    assert np.max(np.abs(t @ t.T - hd)) < 1e-5 * np.max(np.abs(hd))
    # its inverse is GPTQ's U: the upper Cholesky factor of the inverse Hessian (float64 reference)
    u_ref = np.linalg.cholesky(np.linalg.inv(hd)).T
    u = np.linalg.inv(t)
    assert np.max(np.abs(u - u_ref)) < 1e-4 * np.max(np.abs(u_ref))
    assert int(res.stage) == 0 and not bool(res.fallback)
    assert np.isclose(float(res.damp_used), 0.01)


def test_rank_deficient_hessian_is_rescued_by_the_first_damping(rng):
    # fewer tokens than columns: singular, but damping makes it positive definite
    h = spd(rng, 64, tokens=16)
    res = damping.hessian_factor(jnp.asarray(h, jnp.float32), 0.01)
    assert int(res.stage) == 0 and not bool(res.fallback)


def test_ladder_engages_on_an_indefinite_hessian_and_reports_it(rng):
    h = spd(rng, 32)
    lam_min = np.linalg.eigvalsh(h).min()
    # shift so that the smallest eigenvalue is -5% of mean(diag): 1% and 3.2% damping fail, 10% succeeds
    h = h - (lam_min + 0.05 * np.mean(np.diag(h))) * np.eye(32)
    h = h * (np.mean(np.diag(spd(rng, 32))) / np.mean(np.diag(h)))
    res = damping.hessian_factor(jnp.asarray(h, jnp.float32), 0.01)
    assert int(res.stage) == 2
    assert np.isclose(float(res.damp_used), 0.1)
    assert not bool(res.fallback)
    hd = h + 0.1 * np.mean(np.diag(h)) * np.eye(32)
    t = np.asarray(res.upper, np.float64)
    assert np.max(np.abs(t @ t.T - hd)) < 1e-5 * np.max(np.abs(hd))


def test_negative_diagonal_needs_a_floor():
    res = damping.hessian_factor(-jnp.eye(8), 0.01)
    damps, floors = damping.ladder(0.01)
    assert floors[int(res.stage)] >= 1 and not bool(res.fallback)
    assert float(res.floor_used) > 0


def test_hopeless_hessian_falls_back_to_identity_and_says_so(rng):
    a = rng.standard_normal((16, 16))
    h = 1e4 * (a + a.T)  # off-diagonal mass no damping or floor of the diagonal can dominate
    np.fill_diagonal(h, 1.0)
    res = damping.hessian_factor(jnp.asarray(h, jnp.float32), 0.01)
    assert bool(res.fallback)
    assert np.array_equal(np.asarray(res.upper), np.eye(16, dtype=np.float32))
    assert np.isnan(float(res.damp_used))


def test_dead_columns(rng):
    h = spd(rng, 12)
    h[3, :] = h[:, 3] = 0.0
    h[7, :] = h[:, 7] = 0.0
    w = rng.standard_normal((5, 12)).astype(np.float32)
    h2, w2, dead = damping.fix_dead_columns(jnp.asarray(h, jnp.float32), jnp.asarray(w))
    assert np.asarray(dead).tolist() == [i in (3, 7) for i in range(12)]
    assert np.all(np.asarray(w2)[:, [3, 7]] == 0) and np.array_equal(np.asarray(w2)[:, 0], w[:, 0])
    assert np.asarray(h2)[3, 3] == 1 and np.asarray(h2)[7, 7] == 1
    _, w3, _ = damping.fix_dead_columns(jnp.asarray(h, jnp.float32), jnp.asarray(w), zero_weight=False)
    assert np.array_equal(np.asarray(w3), w)
    # an all-zero Hessian (an expert that saw no token) becomes the identity: solvable, no NaN
    h0, _, dead0 = damping.fix_dead_columns(jnp.zeros((6, 6)), jnp.asarray(w[:, :6]))
    assert np.array_equal(np.asarray(h0), np.eye(6)) and bool(np.all(np.asarray(dead0)))
    assert not bool(damping.hessian_factor(h0, 0.01).fallback)


def test_diagonal_block_inverses_are_the_blocks_of_the_inverse(rng):
    h = spd(rng, 48)
    t = np.asarray(damping.hessian_factor(jnp.asarray(h, jnp.float32), 0.01).upper, np.float64)
    blocks = np.asarray(damping.diagonal_block_inverses(jnp.asarray(t, jnp.float32), 16), np.float64)
    u = np.linalg.inv(t)
    assert blocks.shape == (3, 16, 16)
    for b in range(3):
        ref = u[16 * b:16 * b + 16, 16 * b:16 * b + 16]
        assert np.max(np.abs(blocks[b] - ref)) < 1e-4 * np.max(np.abs(ref))
