import jax.numpy as jnp
import numpy as np

from jgptq import damping
from tests.conftest import correlated_activations


def spd(rng, c, tokens=None):
    x = correlated_activations(rng, tokens or 4 * c, c).astype(np.float64)
    return 2 / x.shape[0] * x.T @ x


def test_factor_matches_float64_inverse(rng):
    h = spd(rng, 40)
    res = damping.inverse_factor(jnp.asarray(h, jnp.float32), 0.01)
    hd = h + 0.01 * np.mean(np.diag(h)) * np.eye(40)
    u = np.asarray(res.upper, np.float64)
    assert np.allclose(np.triu(u), u)
    assert np.max(np.abs(u.T @ u - np.linalg.inv(hd))) < 1e-4 * np.max(np.abs(np.linalg.inv(hd)))
    assert int(res.stage) == 0 and not bool(res.fallback)
    assert np.isclose(float(res.damp_used), 0.01)


def test_rank_deficient_hessian_is_rescued_by_the_first_damping(rng):
    # fewer tokens than columns: singular, but damping makes it positive definite
    h = spd(rng, 64, tokens=16)
    res = damping.inverse_factor(jnp.asarray(h, jnp.float32), 0.01)
    assert int(res.stage) == 0 and not bool(res.fallback)


def test_ladder_engages_on_an_indefinite_hessian_and_reports_it(rng):
    h = spd(rng, 32)
    lam_min = np.linalg.eigvalsh(h).min()
    # shift so that the smallest eigenvalue is -5% of mean(diag): 1% and 3.2% damping fail, 10% succeeds
    h = h - (lam_min + 0.05 * np.mean(np.diag(h))) * np.eye(32)
    h = h * (np.mean(np.diag(spd(rng, 32))) / np.mean(np.diag(h)))
    res = damping.inverse_factor(jnp.asarray(h, jnp.float32), 0.01)
    assert int(res.stage) == 2
    assert np.isclose(float(res.damp_used), 0.1)
    assert not bool(res.fallback)
    hd = h + 0.1 * np.mean(np.diag(h)) * np.eye(32)
    u = np.asarray(res.upper, np.float64)
    assert np.max(np.abs(u.T @ u - np.linalg.inv(hd))) < 1e-3 * np.max(np.abs(np.linalg.inv(hd)))


def test_negative_diagonal_needs_a_floor():
    res = damping.inverse_factor(-jnp.eye(8), 0.01)
    damps, floors = damping.ladder(0.01)
    assert floors[int(res.stage)] >= 1 and not bool(res.fallback)
    assert float(res.floor_used) > 0


def test_hopeless_hessian_falls_back_to_identity_and_says_so(rng):
    a = rng.standard_normal((16, 16))
    h = 1e4 * (a + a.T)  # off-diagonal mass no damping or floor of the diagonal can dominate
    np.fill_diagonal(h, 1.0)
    res = damping.inverse_factor(jnp.asarray(h, jnp.float32), 0.01)
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
    assert not bool(damping.inverse_factor(h0, 0.01).fallback)
