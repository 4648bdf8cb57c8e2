"""The M1 geometry for E2 (in-context regression): the token effect is a linear map of x_t."""

import pytest
import torch
from conftest import planted_paths

from taskgeom.analysis.measures.properties import alignment, interpolation, stability_linear
from taskgeom.analysis.measures.task_vectors import late_window
from taskgeom.tasks import Regression

K, DX, D, T, GROUPS = 3, 4, 12, 16, 16


def planted(seed: int = 0):
    """States h = mu_t + A x_t + sum_k beta_k theta_k with beta on the simplex, one-hot on the
    sequence's task over the late window (where mu_t is constant). Each group of K sequences shares
    a Dirichlet path of beta, rolled so sequence k leans to task k; the second half of the groups
    repeats the first with x negated, so x averages to zero per task and position."""
    gen = torch.Generator().manual_seed(seed)
    theta, mu, beta, task, window = planted_paths(gen, GROUPS, K, D, T)
    A = torch.randn(DX, D, generator=gen, dtype=torch.float64)
    half = torch.randn(GROUPS // 2 * K, T, DX, generator=gen, dtype=torch.float64)
    x = torch.cat([half, -half])
    h = mu + x @ A + beta @ theta
    return h, x, task, beta, theta, A, window


def test_planted_linear_effect_gives_r2_one_and_the_planted_coefficients():
    h, x, task, beta, theta, A, window = planted()
    geometry = stability_linear(h, task, x, K, window)
    assert geometry.layout.within_share == pytest.approx(0.0, abs=1e-10)
    assert geometry.layout.cell_r2 == pytest.approx(1.0, abs=1e-10)
    assert geometry.layout.additive_share == pytest.approx(1.0, abs=1e-10)
    assert torch.allclose(geometry.subspace.theta.double(), theta, atol=1e-5)
    assert torch.allclose(geometry.nu.double(), A, atol=1e-5)
    fit = interpolation(geometry.residual(h, x), geometry.subspace.theta, window, n_random=4)
    assert fit.r2_task == pytest.approx(1.0, abs=1e-6)
    assert fit.r2_exact == pytest.approx(1.0, abs=1e-6)
    assert torch.allclose(fit.beta.double(), beta, atol=1e-5)
    assert (fit.r2_random < 0.9).all()
    tv, _ = alignment(fit.beta, beta)
    assert tv.max() < 1e-5


def test_planted_task_by_x_interaction_lowers_p1_and_noise_raises_the_within_share():
    h, x, task, _, _, _, window = planted(1)
    late_h, late_x = h[:, window], x[:, window]
    gen = torch.Generator().manual_seed(4)
    B = 0.5 * torch.randn(K, DX, D, generator=gen, dtype=torch.float64)  # per-task maps: interaction
    bent = late_h + torch.einsum("ntd,nde->nte", late_x, B[task])
    layout = stability_linear(bent, task, late_x, K, slice(None)).layout
    assert layout.within_share == pytest.approx(0.0, abs=1e-10)  # the full model still fits exactly
    assert 0.0 < layout.additive_share < 0.99
    noisy = late_h + 0.5 * torch.randn(late_h.shape, generator=gen, dtype=torch.float64)
    flat = noisy.reshape(-1, D)
    design = torch.cat(
        [
            torch.nn.functional.one_hot(task[:, None].expand(-1, late_h.shape[1]).reshape(-1), K).double()[:, :, None]
            * torch.cat([torch.ones(len(flat), 1, dtype=torch.float64), late_x.reshape(-1, DX)], 1)[:, None]
        ],
        0,
    )
    design = design.reshape(len(flat), -1)
    resid = flat - design @ torch.linalg.lstsq(design, flat).solution
    expected = float((resid**2).sum() / ((flat - flat.mean(0)) ** 2).sum())
    layout = stability_linear(noisy, task, late_x, K, slice(None)).layout
    assert 0.01 < expected < 0.99
    assert layout.within_share == pytest.approx(expected, abs=1e-8)


def test_paired_batch_gives_every_task_the_same_x_and_fresh_noise():
    family = Regression(d=3, noise=0.5, layout="separator")
    pool = family.sample_pool(3, 0, seed=0)
    batch = family.sample_paired(pool, 13, 15, seed=1)  # 13 // 3 = 4 x sequences per task
    assert batch.task.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    x = batch.x.view(3, 4, 5, 3)
    assert torch.equal(x[1], x[0]) and torch.equal(x[2], x[0])
    noise = batch.y - torch.einsum("bnd,bd->bn", batch.x, pool.params[batch.task])
    assert not torch.allclose(noise[:4], noise[4:8])
    assert torch.equal(batch.tokens, family.encode(batch.x, batch.y))
    with pytest.raises(ValueError, match="at least one sequence per task"):
        family.sample_paired(pool, 2, 15)


def test_paired_design_cancels_a_nonlinear_x_effect_in_the_task_vectors():
    """States = tanh(x W) + theta_task: the additive model's linear x term misses the curvature,
    but with shared x sequences it misses it equally for every task, so theta comes out exact."""
    gen = torch.Generator().manual_seed(7)
    family = Regression(d=DX, noise=0.5, layout="separator")
    pool = family.sample_pool(K, 0, seed=2)
    theta = torch.randn(K, D, generator=gen, dtype=torch.float64)
    theta -= theta.mean(0)
    W = torch.randn(DX, D, generator=gen, dtype=torch.float64)

    def fitted_theta(batch):
        h = torch.tanh(batch.x @ W) + theta[batch.task][:, None]
        return stability_linear(h, batch.task, batch.x, K, late_window(batch.x.shape[1])).subspace.theta

    paired = family.sample_paired(pool, 30, 3 * 16, seed=3)
    torch.testing.assert_close(fitted_theta(paired), theta, atol=1e-10, rtol=0)
    unpaired = family.sample(pool, 30, 3 * 16, seed=3)
    assert (fitted_theta(unpaired) - theta).abs().max() > 1e-3


def test_e2_inputs_read_the_separators_with_the_posterior_before_y():
    from taskgeom.analysis.reading.heldout import family_inputs

    family = Regression(d=2, noise=0.5, layout="separator")
    pool = family.sample_pool(3, 0, seed=0)
    batch = family.sample_paired(pool, 6, 3 * 5, seed=1)
    inputs = family_inputs(family, batch, pool)
    assert inputs.positions.tolist() == [1, 4, 7, 10, 13]
    assert torch.equal(batch.tokens[:, inputs.positions, -1], torch.ones(6, 5))  # the separator flag
    torch.testing.assert_close(inputs.alpha, family.log_posterior(batch, pool).exp())
    assert torch.equal(inputs.current, batch.x)
    marker = torch.arange(15.0)[None, :, None].expand(6, 15, 1)
    assert inputs.select(marker)[0, :, 0].tolist() == [1.0, 4.0, 7.0, 10.0, 13.0]
    assert inputs.model_positions(slice(3, 5)).tolist() == [10, 13]


def test_ancova_per_position_equals_numpy_least_squares_at_each_position():
    """E2's P0/P1 per position: the full model (per-task intercept and slope on x_t) and the
    additive one (task intercepts and one map of x_t) fitted by numpy at each position alone."""
    import numpy as np

    from taskgeom.analysis.measures.anova import task_linear_by_position

    gen = torch.Generator().manual_seed(9)
    N, T_ = 45, 4
    task = torch.arange(N) % K
    x = torch.randn(N, T_, DX, generator=gen, dtype=torch.float64)
    slopes = torch.randn(K, DX, D, generator=gen, dtype=torch.float64)
    drift = 3 * torch.randn(T_, D, generator=gen, dtype=torch.float64)
    h = (
        drift
        + torch.einsum("ntd,nde->nte", x, slopes[task])
        + 0.5 * torch.randn(N, T_, D, generator=gen, dtype=torch.float64)
    )
    shares = task_linear_by_position(h, task, x, K)
    onehot = np.eye(K)[task.numpy()]
    for t in range(T_):
        y, xt = h[:, t].numpy(), x[:, t].numpy()
        full = np.concatenate([onehot[:, [m]] * np.concatenate([np.ones((N, 1)), xt], 1) for m in range(K)], 1)
        additive = np.concatenate([onehot, xt], 1)
        res = {
            name: ((y - design @ np.linalg.lstsq(design, y, rcond=None)[0]) ** 2).sum()
            for name, design in (("full", full), ("additive", additive))
        }
        total = ((y - y.mean(0)) ** 2).sum()
        assert 0.01 < res["full"] / total < 0.99
        assert float(shares.within_share[t]) == pytest.approx(res["full"] / total, rel=1e-9), t
        assert float(shares.additive_share[t]) == pytest.approx(
            1 - (res["additive"] - res["full"]) / (total - res["full"]), rel=1e-9
        ), t


def test_r2_additive_equals_numpy_least_squares_and_is_one_on_planted_states():
    """r2_additive: what beta @ theta leaves is regressed on x_t at each position (numpy lstsq);
    1 - SS_res / SS_tot of h - mu_t, per position and over the window."""
    import numpy as np

    from taskgeom.analysis.measures.properties import additive_r2

    h, x, task, beta, theta, A, window = planted()
    gen = torch.Generator().manual_seed(2)
    maps = torch.randn(T, DX, D, generator=gen, dtype=torch.float64)  # a different map of x_t at each position
    y = beta @ theta + torch.einsum("ntd,tde->nte", x, maps)
    r2, by_position = additive_r2(y, beta @ theta, x, window)
    assert r2 == pytest.approx(1.0, abs=1e-10) and torch.allclose(
        by_position, torch.ones(T, dtype=torch.float64), atol=1e-10
    )

    noisy = y + 0.7 * torch.randn(y.shape, generator=gen, dtype=torch.float64)
    task_part = (beta + 0.1 * torch.randn(beta.shape, generator=gen, dtype=torch.float64)) @ theta
    r2, by_position = additive_r2(noisy, task_part, x, window)
    Y, P, X = noisy.numpy(), task_part.numpy(), x.numpy()
    residual = np.zeros(T)
    for t in range(T):
        rest = Y[:, t] - P[:, t]
        residual[t] = ((rest - X[:, t] @ np.linalg.lstsq(X[:, t], rest, rcond=None)[0]) ** 2).sum()
        assert float(by_position[t]) == pytest.approx(
            1 - residual[t] / ((Y[:, t] - Y[:, t].mean(0)) ** 2).sum(), rel=1e-9
        ), t
    late = Y[:, window].reshape(-1, D)
    expected = 1 - residual[window].sum() / ((late - late.mean(0)) ** 2).sum()
    assert 0.05 < expected < 0.99
    assert r2 == pytest.approx(expected, rel=1e-9)
