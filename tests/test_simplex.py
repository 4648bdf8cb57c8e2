"""The simplex least-squares solver and the P2 fit against SciPy and closed forms."""

import numpy as np
import pytest
import torch
from scipy.optimize import nnls

from taskgeom.analysis.measures.simplex import MAX_EXACT_K, project_simplex, residual_r2, simplex_lstsq, sum_to_one_fit
from taskgeom.errors import AnalysisError

PENALTY = 1e4  # weight of the sum-to-one row folded into NNLS


def scipy_simplex_lstsq(vertices: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Reference: NNLS with the equality constraint as a heavily weighted row finds the support;
    the equality-constrained normal equations on that support give the exact solution."""
    K = vertices.shape[0]
    A = np.vstack([vertices.T, PENALTY * np.ones((1, K))])
    support = nnls(A, np.concatenate([y, [PENALTY]]))[0] > 0
    Vs = vertices[support]
    k = int(support.sum())
    kkt = np.zeros((k + 1, k + 1))
    kkt[:k, :k], kkt[:k, k], kkt[k, :k] = Vs @ Vs.T, 1.0, 1.0
    out = np.zeros(K)
    out[support] = np.linalg.solve(kkt, np.concatenate([Vs @ y, [1.0]]))[:k]
    return out


def random_problems(seed: int, n_sets: int = 20, per_set: int = 50):
    """n_sets vertex sets (K in 2..5, D in K..12) with per_set states each (1,000 problems)."""
    rng = np.random.default_rng(seed)
    for _ in range(n_sets):
        K = int(rng.integers(2, 6))
        D = int(rng.integers(K, 13))
        vertices = rng.normal(size=(K, D))
        y = rng.normal(size=(per_set, D)) * rng.uniform(0.3, 3.0) + rng.normal(size=D)
        yield vertices, y


def test_exact_solver_matches_scipy_on_1000_problems():
    worst, count = 0.0, 0
    for vertices, y in random_problems(0):
        ours = simplex_lstsq(torch.from_numpy(y), torch.from_numpy(vertices)).numpy()
        ref = np.stack([scipy_simplex_lstsq(vertices, row) for row in y])
        worst = max(worst, np.abs(ours - ref).max())
        count += len(y)
    assert count == 1000
    assert worst <= 1e-6


def test_exact_solver_satisfies_kkt_conditions():
    """Optimality certificate: beta on the simplex, and the gradient G beta - V y equals -lambda on
    the support and is >= -lambda off it."""
    for vertices, y in random_problems(1, n_sets=10):
        V, Y = torch.from_numpy(vertices), torch.from_numpy(y)
        beta = simplex_lstsq(Y, V)
        assert (beta >= 0).all() and torch.allclose(beta.sum(-1), torch.ones(len(y), dtype=torch.float64), atol=1e-9)
        grad = beta @ (V @ V.T) - Y @ V.T  # [N, K]
        support = beta > 1e-9
        lam = -(grad * support).sum(-1) / support.sum(-1)
        assert (grad + lam[:, None])[support].abs().max() < 1e-8
        assert ((grad + lam[:, None])[~support] > -1e-8).all()


def test_projection_matches_bisection_and_the_solver_with_identity_vertices():
    v = torch.randn(500, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 2
    proj = project_simplex(v)
    # independent: bisection on tau with sum(max(v - tau, 0)) = 1
    low, high = v.min(-1).values - 1, v.max(-1).values
    for _ in range(200):
        tau = (low + high) / 2
        too_big = (v - tau[:, None]).clamp_min(0).sum(-1) < 1
        high, low = torch.where(too_big, tau, high), torch.where(too_big, low, tau)
    assert torch.allclose(proj, (v - low[:, None]).clamp_min(0), atol=1e-12)
    assert torch.allclose(proj, simplex_lstsq(v, torch.eye(5, dtype=torch.float64)), atol=1e-10)


def test_sum_to_one_fit_matches_affine_least_squares():
    rng = np.random.default_rng(3)
    vertices, y = rng.normal(size=(4, 9)), rng.normal(size=(30, 9))
    beta = sum_to_one_fit(torch.from_numpy(y), torch.from_numpy(vertices)).numpy()
    # independent: beta = e_K + sum_{k<K} gamma_k (e_k - e_K), unconstrained in gamma
    diffs = (vertices[:-1] - vertices[-1]).T  # [D, K-1]
    gamma = np.linalg.lstsq(diffs, (y - vertices[-1]).T, rcond=None)[0].T
    expected = np.concatenate([gamma, 1 - gamma.sum(1, keepdims=True)], axis=1)
    np.testing.assert_allclose(beta, expected, atol=1e-10)


def test_planted_convex_combinations_are_recovered_exactly():
    gen = torch.Generator().manual_seed(4)
    vertices = torch.randn(3, 8, generator=gen, dtype=torch.float64)
    gamma = torch._standard_gamma(torch.ones(200, 3, dtype=torch.float64), gen)
    planted = gamma / gamma.sum(-1, keepdim=True)
    y = planted @ vertices
    for fitted in (simplex_lstsq(y, vertices), project_simplex(sum_to_one_fit(y, vertices))):
        assert torch.allclose(fitted, planted, atol=1e-10)
        assert residual_r2(y, fitted @ vertices) == pytest.approx(1.0, abs=1e-12)


def test_too_many_vertices_is_a_clear_error():
    with pytest.raises(AnalysisError, match="K <= "):
        simplex_lstsq(torch.zeros(2, 20), torch.eye(MAX_EXACT_K + 1, 20))
