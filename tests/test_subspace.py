"""Section-5 machinery on planted geometry: projection R^2, ablations, the orthogonal search,
the generalising predictor and the Theorem-2 estimators."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from taskgeom import tasks
from taskgeom.analysis.subspace import complement_basis, direction_ablation, gain_removed, orthogonal_search, projection_r2, task_ablation
from taskgeom.hooks import intervene
from taskgeom.analysis.task_vectors import TaskVectors
from taskgeom.analysis.theory import participation_ratio, readout_lipschitz
from taskgeom.analysis.transition import predict_generalising
from taskgeom.model import HookPoint


def test_projection_r2_is_one_inside_and_zero_orthogonal():
    gen = torch.Generator().manual_seed(0)
    theta = torch.zeros(3, 10)
    theta[0, 0], theta[1, 1], theta[2, :2] = 1.0, 1.0, -1.0
    inside = torch.randn(50, 3, generator=gen) @ theta
    orthogonal = torch.zeros(50, 10)
    orthogonal[:, 2:] = torch.randn(50, 8, generator=gen)
    assert torch.allclose(projection_r2(inside, theta), torch.ones(50), atol=1e-6)
    assert projection_r2(orthogonal, theta).max() < 0.05
    mixed = projection_r2(inside * 0.1 + orthogonal, theta)
    assert 0 < mixed.mean() < 0.2


def test_task_ablation_removes_exactly_the_centred_task_component():
    gen = torch.Generator().manual_seed(1)
    theta = torch.randn(3, 6, generator=gen)
    theta -= theta.mean(0)
    mu = torch.randn(5, 6, generator=gen)
    vectors = TaskVectors(theta, mu, slice(3, 5))
    h = torch.randn(2, 5, 6, generator=gen)
    edited = task_ablation(vectors)(h)
    basis = vectors.basis
    assert basis.shape == (6, 2)
    torch.testing.assert_close((edited - mu) @ basis, torch.zeros(2, 5, 2), atol=1e-5, rtol=0)
    complement = complement_basis(basis)
    torch.testing.assert_close(edited @ complement, h @ complement, atol=1e-5, rtol=0)
    torch.testing.assert_close(complement.T @ complement, torch.eye(4), atol=1e-5, rtol=0)


def test_gain_removed_formula():
    clean = torch.tensor([2.0, 1.5, 1.0, 1.0])
    ablated = torch.tensor([2.0, 1.8, 1.5, 1.5])
    assert gain_removed(ablated, clean, slice(2, 4)) == pytest.approx(50.0)


class PlantedModel(nn.Module):
    """Binary tokens that mostly repeat; the state carries the token along ``planted`` (the only
    direction the readout reads), a task-subspace component and token-independent noise along
    ``noise_dirs``."""

    def __init__(self, planted: torch.Tensor, noise_dirs: torch.Tensor, task_dirs: torch.Tensor):
        super().__init__()
        self.planted, self.noise_dirs, self.task_dirs = planted, noise_dirs, task_dirs
        self.state = HookPoint()

    def site(self, layer: int, name: str) -> HookPoint:
        return self.state

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        sign = (2.0 * tokens - 1.0)[..., None]
        gen = torch.Generator().manual_seed(0)
        noise = 0.3 * torch.randn(*tokens.shape, self.noise_dirs.shape[1], generator=gen) @ self.noise_dirs.T
        h = self.state(sign * (self.planted + self.task_dirs.sum(1)) + noise)
        score = math.log(9.0) * h @ self.planted  # calibrated: tokens repeat with probability 0.9
        return torch.stack([-score, score], dim=-1) / 2


def cross_entropy(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 2), tokens[:, 1:].reshape(-1))


def test_orthogonal_search_recovers_a_planted_direction():
    gen = torch.Generator().manual_seed(2)
    D = 12
    frame = torch.linalg.qr(torch.randn(D, D, generator=gen))[0]
    task_basis, planted, noise_dirs = frame[:, :2], frame[:, 2], frame[:, 3:]
    model = PlantedModel(planted, noise_dirs, task_basis)
    first = torch.randint(0, 2, (200, 1), generator=gen)
    flips = (torch.rand(200, 15, generator=gen) < 0.1).long()
    tokens = torch.cat([first, (first + flips.cumsum(1)) % 2], dim=1)
    found = orthogonal_search(model, lambda m: cross_entropy(m, tokens), (0, "state"), task_basis, rank=1, steps=300, lr=0.05)
    assert found.shape == (D, 1)
    assert (found.T @ task_basis).abs().max() < 1e-5
    assert abs(float(found[:, 0] @ planted)) >= 0.95
    with torch.no_grad(), intervene(model, (0, "state"), direction_ablation(found)):
        ablated = cross_entropy(model, tokens)
    assert ablated > cross_entropy(model, tokens) + 0.3


def test_generalising_predictor_interpolates_majors_and_the_prior():
    fam = tasks.make("dice", vocab_size=4)
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
