"""Section-5 machinery on planted geometry: projection R^2 (plain and token-conditioned), ablations,
the generalising predictor and the Theorem-2 estimators."""

from __future__ import annotations

import math

import pytest
import torch

from taskgeom import tasks
from taskgeom.analysis.measures.shares import MIN_RELIABLE_GAIN, share_of_gain
from taskgeom.analysis.measures.subspace import complement_basis, projection_r2, task_ablation
from taskgeom.analysis.measures.task_vectors import task_subspace, token_conditioned
from taskgeom.analysis.measures.theory import participation_ratio, readout_lipschitz
from taskgeom.analysis.measures.transition import predict_generalising
from taskgeom.errors import AnalysisError


def test_projection_r2_is_one_inside_and_zero_orthogonal():
    gen = torch.Generator().manual_seed(0)
    theta = torch.zeros(3, 10)
    theta[0, 0], theta[1, 1], theta[2, :2] = 1.0, 1.0, -1.0
    basis = task_subspace(theta, torch.zeros(4, 10), slice(2, 4)).basis
    inside = torch.randn(50, 3, generator=gen) @ theta
    orthogonal = torch.zeros(50, 10)
    orthogonal[:, 2:] = torch.randn(50, 8, generator=gen)
    assert torch.allclose(projection_r2(inside, basis), torch.ones(50), atol=1e-6)
    assert projection_r2(orthogonal, basis).max() < 0.05
    mixed = projection_r2(inside * 0.1 + orthogonal, basis)
    assert 0 < mixed.mean() < 0.2


def test_projection_r2_regresses_on_exactly_k_minus_1_directions_despite_rounding_noise():
    """float32 task vectors sum to zero only up to rounding: the old lstsq on theta took that noise
    direction as a third regressor and biased R^2 upward; the rank-(K-1) basis gives the exact answer."""
    gen = torch.Generator().manual_seed(4)
    D = 32
    frame = torch.linalg.qr(torch.randn(D, D, generator=gen, dtype=torch.float64))[0]
    exact = torch.stack([frame[:, 0], frame[:, 1], -frame[:, 0] - frame[:, 1]])  # [K, D], sums to zero exactly
    # planted rounding noise along a third direction, different per task vector, so that it survives
    # re-centring and only the explicit rank cut keeps it out of the basis
    noisy = (exact + 1e-7 * torch.tensor([1.0, -0.3, 0.5], dtype=torch.float64)[:, None] * frame[:, 2]).float()
    x = torch.randn(200, D, generator=gen, dtype=torch.float64)
    fitted = x @ frame[:, :2] @ frame[:, :2].T
    truth = 1 - ((x - fitted) ** 2).sum(-1) / ((x - x.mean(-1, keepdim=True)) ** 2).sum(-1)

    new = projection_r2(x, task_subspace(noisy, torch.zeros(1, D), slice(0, 1)).basis)
    torch.testing.assert_close(new.double(), truth.clamp(0, 1), atol=1e-6, rtol=0)

    # the old estimator: least squares on the K raw vectors, default cut-off
    coef = torch.linalg.lstsq(noisy.double().T.expand(200, -1, -1), x[..., None]).solution
    old = 1 - ((x - (noisy.double().T @ coef).squeeze(-1)) ** 2).sum(-1) / ((x - x.mean(-1, keepdim=True)) ** 2).sum(-1)
    assert (old - truth).mean() > 0.01  # biased upward: the noise direction explains about 1/D more


def test_token_conditioned_projection_regresses_on_each_tokens_own_vectors():
    """Planted: task effects that rotate with the current token. The token-conditioned form finds
    states built from theta_{k,a} fully inside; the plain form, on the averaged vectors, does not."""
    gen = torch.Generator().manual_seed(5)
    D, K, V = 16, 3, 4
    raw = torch.randn(K, V, D, generator=gen, dtype=torch.float64)
    conditioned = raw - raw.mean(0)  # theta_{k,a}
    theta = conditioned.mean(1)  # the plain task effects
    subspace = task_subspace(theta, torch.zeros(1, D), slice(0, 1), conditioned)
    tokens = torch.randint(0, V, (100,), generator=gen)
    beta = torch.distributions.Dirichlet(torch.ones(K)).sample((100,)).double()
    x = torch.einsum("nk,knd->nd", beta, conditioned[:, tokens])
    token_form = projection_r2(x, subspace.conditioned_basis(tokens))
    torch.testing.assert_close(token_form, torch.ones(100), atol=1e-6, rtol=0)
    brute = torch.stack(
        [
            projection_r2(x[i : i + 1], torch.linalg.qr(conditioned[:, tokens[i]].T)[0][:, : K - 1])[0]
            for i in range(100)
        ]
    )
    torch.testing.assert_close(token_form, brute, atol=1e-6, rtol=0)
    assert projection_r2(x, subspace.basis).mean() < 0.9


def test_token_conditioned_vectors_are_centred_cell_means_with_the_plain_fallback():
    gen = torch.Generator().manual_seed(6)
    K, V, D = 3, 3, 5
    task = torch.randint(0, K, (400,), generator=gen)
    tokens = torch.randint(0, V - 1, (400,), generator=gen)  # token V-1 never appears
    h = torch.randn(400, D, generator=gen, dtype=torch.float64)
    theta = torch.randn(K, D, generator=gen, dtype=torch.float64)
    out = token_conditioned(h, task, tokens, K, V, theta)
    for a in range(V - 1):
        means = torch.stack([h[(task == k) & (tokens == a)].mean(0) for k in range(K)])
        torch.testing.assert_close(out[:, a], means - means.mean(0))
    torch.testing.assert_close(out[:, V - 1], theta - theta.mean(0))


def test_task_ablation_removes_exactly_the_centred_task_component():
    gen = torch.Generator().manual_seed(1)
    theta = torch.randn(3, 6, generator=gen)
    mu = torch.randn(5, 6, generator=gen)
    subspace = task_subspace(theta, mu, slice(3, 5))
    h = torch.randn(2, 5, 6, generator=gen)
    edited = task_ablation(subspace)(h)
    basis = subspace.basis.float()
    assert basis.shape == (6, 2)
    torch.testing.assert_close((edited - mu) @ basis, torch.zeros(2, 5, 2), atol=1e-5, rtol=0)
    complement = complement_basis(basis)
    torch.testing.assert_close(edited @ complement, h @ complement, atol=1e-5, rtol=0)
    torch.testing.assert_close(complement.T @ complement, torch.eye(4), atol=1e-5, rtol=0)


def test_a_degenerate_task_subspace_is_refused():
    theta = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]])  # rank 1 after centring, K - 1 = 2
    with pytest.raises(AnalysisError, match="span fewer than 2"):
        task_subspace(theta, torch.zeros(1, 2), slice(0, 1))


def test_share_of_gain_averages_every_prediction_after_the_first_and_carries_its_parts():
    clean = torch.tensor([2.0, 1.5, 1.0, 1.0], dtype=torch.float64)
    ablated = torch.tensor([2.0, 1.8, 1.5, 1.5], dtype=torch.float64)
    late, late_ablated = (1.5 + 1.0 + 1.0) / 3, (1.8 + 1.5 + 1.5) / 3
    share = share_of_gain(ablated, clean)
    assert share.value == pytest.approx(100 * (late_ablated - late) / (2.0 - late))
    assert (share.gain, share.clean, share.ablated, share.first) == pytest.approx((2.0 - late, late, late_ablated, 2.0))
    assert share.unreliable is False and share.reason is None
    windowed = share_of_gain(ablated, clean, slice(2, None))  # the late window of the sensitivity analysis
    assert windowed.value == pytest.approx(100 * (1.5 - 1.0) / (2.0 - 1.0))


def test_a_share_of_a_gain_that_is_not_positive_is_null_with_its_reason_and_a_small_one_unreliable():
    clean = torch.tensor([1.0, 1.2, 1.1], dtype=torch.float64)  # the loss rises in context: gain -0.15
    share = share_of_gain(clean + 0.1, clean)
    assert share.value is None and share.gain == pytest.approx(-0.15) and share.unreliable is True
    assert "not positive" in share.reason and "-0.15" in share.reason
    assert share_of_gain(clean, torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)).value is None  # zero gain
    small = torch.tensor([1.0, 1.0 - MIN_RELIABLE_GAIN / 2, 1.0 - MIN_RELIABLE_GAIN / 2], dtype=torch.float64)
    shaky = share_of_gain(small + 0.01, small)
    assert (
        shaky.value == pytest.approx(100 * 0.01 / (MIN_RELIABLE_GAIN / 2))
        and shaky.unreliable is True
        and shaky.reason is None
    )


def test_generalising_predictor_interpolates_majors_and_the_prior():
    fam = tasks.make("dice", vocab_size=4, majors="prior")
    pool = fam.sample_pool(3, 0, seed=0)
    batch = fam.sample_ood(8, 12, seed=1)
    majors_only = predict_generalising(fam, batch.tokens, pool, p_new=1e-12)
    torch.testing.assert_close(majors_only, fam.predict_id(batch.tokens, pool), atol=1e-9, rtol=0)
    prior_only = predict_generalising(fam, batch.tokens, pool, p_new=1 - 1e-12)
    torch.testing.assert_close(prior_only, fam.predict_ood(batch.tokens), atol=1e-9, rtol=0)
    both = predict_generalising(fam, batch.tokens, pool, p_new=0.1)
    torch.testing.assert_close(both.sum(-1), torch.ones(8, 12, dtype=torch.float64))
    # brute force at t = 0: weights proportional to prior x likelihood of the first token
    x0 = batch.tokens[:, 0]
    joint = torch.cat([0.9 / 3 * pool.params[:, x0].T, 0.1 * torch.full((8, 1), 0.25, dtype=torch.float64)], dim=1)
    w = joint / joint.sum(1, keepdim=True)
    counts = torch.nn.functional.one_hot(x0, 4).double() + 1.0
    expected = w[:, :3] @ pool.params + w[:, 3:] * counts / counts.sum(1, keepdim=True)
    torch.testing.assert_close(both[:, 0], expected, atol=1e-12, rtol=0)


def test_participation_ratio_and_lipschitz_estimators():
    gen = torch.Generator().manual_seed(3)
    isotropic = torch.randn(20000, 5, generator=gen)
    assert participation_ratio(isotropic) == pytest.approx(5.0, rel=0.02)
    assert participation_ratio(isotropic * torch.tensor([1.0, 0, 0, 0, 0])) == pytest.approx(1.0, rel=1e-6)
    weight = torch.randn(4, 7, generator=gen)
    lipschitz = readout_lipschitz(lambda h: h @ weight.T, torch.randn(10, 7, generator=gen))
    centred = weight - weight.mean(0)
    assert lipschitz == pytest.approx(float(torch.linalg.matrix_norm(centred, ord=2)), rel=1e-5)
    assert math.isfinite(lipschitz)
