"""The M1 geometry for E2 (in-context regression): the token effect is a linear map of x_t."""

import pytest
import torch

from taskgeom.analysis.properties import alignment, interpolation, stability_linear
from taskgeom.analysis.steering import AdditiveCode, PredictionReadout, code_from_regression, steer_edit
from conftest import planted_paths
from taskgeom.analysis.task_vectors import late_window
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
    assert torch.allclose(geometry.vectors.theta.double(), theta, atol=1e-5)
    assert torch.allclose(geometry.nu.double(), A, atol=1e-5)
    fit = interpolation(geometry.residual(h, x), geometry.vectors.theta, n_random=4)
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
    design = torch.cat([torch.nn.functional.one_hot(task[:, None].expand(-1, late_h.shape[1]).reshape(-1), K).double()[:, :, None]
                        * torch.cat([torch.ones(len(flat), 1, dtype=torch.float64), late_x.reshape(-1, DX)], 1)[:, None]], 0)
    design = design.reshape(len(flat), -1)
    resid = flat - design @ torch.linalg.lstsq(design, flat).solution
    expected = float((resid**2).sum() / ((flat - flat.mean(0)) ** 2).sum())
    layout = stability_linear(noisy, task, late_x, K, slice(None)).layout
    assert 0.01 < expected < 0.99
    assert layout.within_share == pytest.approx(expected, abs=1e-8)


def test_continuous_code_edits_and_regression_recover_planted_states():
    gen = torch.Generator().manual_seed(3)
    W, U = torch.randn(K, D, generator=gen, dtype=torch.float64), torch.randn(DX, D, generator=gen, dtype=torch.float64)
    gamma = torch._standard_gamma(torch.ones(400, K, dtype=torch.float64), gen)
    alpha = gamma / gamma.sum(-1, keepdim=True)
    x = torch.randn(400, DX, generator=gen, dtype=torch.float64)
    code = code_from_regression(alpha @ W + x @ U, alpha, x, None)
    a = torch.tensor([[0.1, 0.6, 0.3]])
    probe = torch.randn(1, 5, DX, generator=gen, dtype=torch.float64)
    assert torch.allclose(code.state(a, probe).double(), (a.double() @ W)[:, None] + probe @ U, atol=1e-4)

    basis = torch.linalg.qr(torch.randn(D, K - 1, generator=gen))[0]
    code = AdditiveCode(W.float(), U.float())
    h = torch.randn(1, 5, D, generator=gen)
    out = steer_edit(basis, code, a, probe)(h)
    project = basis @ basis.T
    assert torch.allclose(out @ project, ((a @ code.centre)[:, None] + probe.float() @ code.token) @ project, atol=1e-5)


def test_prediction_readout_scores_the_mixture_prediction_at_prediction_positions():
    family = Regression(d=2, noise=0.5)
    params = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-1.0, -1.0]], dtype=torch.float64)
    batch = family.make_batch(params[torch.tensor([0, 1])], torch.tensor([0, 1]), 12, torch.Generator().manual_seed(0))
    readout = PredictionReadout(family, batch, params)
    a = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]], dtype=torch.float64)
    window = late_window(12, 0.5)  # positions 6..11: examples 2 and 3, predicted at positions 7 and 10
    out = torch.zeros(2, 12, 1)
    out[:, 7, 0], out[:, 10, 0] = 1.0, -1.0
    target = torch.stack([batch.x[0, 2:] @ params[1], batch.x[1, 2:] @ (0.5 * params[0] + 0.5 * params[2])])
    expected = (torch.tensor([1.0, -1.0], dtype=torch.float64) - target) ** 2
    assert torch.allclose(readout.distance(a, window)(out), expected)
