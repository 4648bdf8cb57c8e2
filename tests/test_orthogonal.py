"""The study's orthogonal search (docs/protocol.md) on a planted problem, and its subspaces."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from taskgeom.analysis.measures.orthogonal import (
    avoid_basis,
    initial_coordinates,
    orthogonal_searches,
    token_subspace,
)
from taskgeom.analysis.measures.subspace import complement_basis
from taskgeom.analysis.protocol import STUDY
from taskgeom.analysis.reading.states import LayerStreams
from taskgeom.models.transformer import HookPoint, Transformer
from taskgeom.rng import generator
from taskgeom.settings.config import ModelConfig
from taskgeom.tasks import make

D, T = 16, 4
SITE = (0, "state")


class PlantedReadout(nn.Module):
    """h: [B, T, D] -> h . w through a hook point; w = u + 2 s reads the free direction u and the
    avoided direction s, so the ablation the search may use that hurts most is u's."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.state = HookPoint()
        self.readout = nn.Linear(D, 1, bias=False)
        with torch.no_grad():
            self.readout.weight.copy_(w[None])

    def site(self, layer: int, name: str) -> HookPoint:
        return self.state

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.readout(self.state(h))[..., 0]


def searching(model: nn.Module, loss_fn):
    """The search's loss_fn(step, site) for a loss of (model, step)."""
    return lambda step, site: loss_fn(model, step)


@pytest.fixture
def planted():
    """(model, avoid [D, 4], u [D], loss_fn, steps seen by loss_fn)."""
    frame = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(0)))[0]
    avoid, u, s = frame[:, :4], frame[:, 4], frame[:, 0]
    model = PlantedReadout(u + 2 * s)
    target = u + 2 * s
    seen: list[int] = []

    def loss_fn(m: nn.Module, step: int) -> torch.Tensor:
        seen.append(step)
        h = torch.randn(STUDY.search_batch, T, D, generator=generator(0, step, "search"))
        return ((m(h) - h @ target) ** 2).mean()

    return model, avoid, u, loss_fn, seen


def test_search_moves_toward_the_planted_direction(planted):
    """The kept V is the moving average (0.995) of the raw parameter from its start, at the step of
    the best smoothed loss (docs/protocol.md), so it lags the iterates that find u: it holds more of
    u than the start does, and the loss rises."""
    model, avoid, u, loss_fn, _ = planted
    result = orthogonal_searches(model, searching(model, loss_fn), [(SITE, avoid, 1)])[0]
    start = complement_basis(avoid.double()) @ initial_coordinates(D - 4, 1, seed=0)
    assert result.directions.shape == (D, 1)
    assert abs(float(result.directions[:, 0] @ u)) > abs(float(start[:, 0].float() @ u)) + 0.2
    assert result.steps == len(result.losses) <= 200
    assert result.losses[-1] > result.losses[0] + 0.5  # ascent: ablating u costs ||u||^2 = 1


def test_the_kept_direction_is_the_average_at_the_best_smoothed_loss(planted):
    """By hand from the losses: the smoothed loss (weight 0.1 on the newest, started at the first),
    its best step and the stop 30 steps without a new best; the same search cut at the best step
    (where the average is simply the last one) keeps the very same V."""
    model, avoid, _, loss_fn, _ = planted
    result = orthogonal_searches(model, searching(model, loss_fn), [(SITE, avoid, 1)])[0]
    smoothed, best, best_step, stale, stop = None, -float("inf"), None, 0, None
    for step, loss in enumerate(result.losses):
        smoothed = loss if smoothed is None else 0.1 * loss + 0.9 * smoothed
        if smoothed > best:
            best, best_step, stale = smoothed, step, 0
        else:
            stale += 1
            if stale == 30 and stop is None:
                stop = step + 1
    assert result.best_step == best_step and result.steps == (stop or 200)
    assert result.steps < 200  # the planted search stops early: the rule above was exercised
    cut = orthogonal_searches(model, searching(model, loss_fn), [(SITE, avoid, 1)], steps=best_step + 1)[0]
    assert cut.best_step == best_step and cut.losses == result.losses[: best_step + 1]
    torch.testing.assert_close(cut.directions, result.directions, atol=1e-6, rtol=0)


def test_result_is_orthonormal_and_orthogonal_to_avoid(planted):
    model, avoid, _, loss_fn, _ = planted
    result = orthogonal_searches(model, searching(model, loss_fn), [(SITE, avoid, 3)], steps=40)[0]
    v = result.directions
    assert v.shape == (D, 3)
    torch.testing.assert_close(v.T @ v, torch.eye(3), atol=1e-5, rtol=0)
    assert (v.T @ avoid).abs().max() < 1e-5


def test_each_step_draws_a_fresh_batch(planted):
    model, avoid, _, loss_fn, seen = planted
    result = orthogonal_searches(model, searching(model, loss_fn), [(SITE, avoid, 1)], steps=25)[0]
    assert seen == list(range(result.steps))


def test_early_stopping_fires_on_a_flat_loss():
    model = PlantedReadout(torch.zeros(D))
    avoid = torch.eye(D)[:, :2]
    calls: list[int] = []

    def flat(m: nn.Module, step: int) -> torch.Tensor:
        calls.append(step)
        h = torch.ones(1, T, D)
        return m(h).sum() * 0 + 1.0 - 1e-3 * step  # the loss only falls: no step improves on the first

    result = orthogonal_searches(model, searching(model, flat), [(SITE, avoid, 1)], steps=200, patience=30)[0]
    assert result.steps == 31 == len(calls)


def test_parameters_are_restored_even_when_loss_fn_raises(planted):
    model, avoid, _, loss_fn, _ = planted
    extra = nn.Parameter(torch.ones(3), requires_grad=False)
    model.register_parameter("extra", extra)
    before = {name: (p.detach().clone(), p.requires_grad) for name, p in model.named_parameters()}
    assert before["readout.weight"][1] and not before["extra"][1]

    def failing(m: nn.Module, step: int) -> torch.Tensor:
        assert not any(p.requires_grad for p in m.parameters())  # frozen during the search
        if step == 3:
            raise RuntimeError("boom")
        return loss_fn(m, step)

    with pytest.raises(RuntimeError, match="boom"):
        orthogonal_searches(model, searching(model, failing), [(SITE, avoid, 1)])
    orthogonal_searches(model, searching(model, loss_fn), [(SITE, avoid, 1)], steps=10)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name][0], atol=0, rtol=0)
        assert p.requires_grad == before[name][1]
        assert p.grad is None
    assert not model.state._forward_hooks


def test_token_subspace_finds_the_planted_token_directions():
    gen = torch.Generator().manual_seed(1)
    frame = torch.linalg.qr(torch.randn(D, D, generator=gen))[0]
    scores = torch.randn(50, 2, generator=gen) * torch.tensor([3.0, 2.0])
    offset = 10 * frame[:, 5]  # common to every token: centring removes it
    nu = scores @ frame[:, :2].T + offset + 0.01 * torch.randn(50, D, generator=gen)
    basis = token_subspace(nu)
    assert basis.shape == (D, 2)
    torch.testing.assert_close(basis @ basis.T, frame[:, :2] @ frame[:, :2].T, atol=1e-2, rtol=0)
    assert token_subspace(nu, share=0.5).shape == (D, 1)
    # E2: the map A [d, D] is used uncentred; its rows span exactly three directions
    a = torch.randn(3, 3, generator=gen) @ frame[:, 6:9].T + 5 * frame[:, 9]
    span = token_subspace(a, share=1.0, centre=False)
    assert span.shape == (D, 3)
    torch.testing.assert_close(span @ span.T @ a.T, a.T, atol=1e-4, rtol=0)


def test_avoid_basis_joins_overlapping_spans_once():
    frame = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(2)))[0]
    task, token = frame[:, :3], frame[:, 2:5]  # share frame[:, 2]
    basis = avoid_basis(task, token)
    assert basis.shape == (D, 5)
    torch.testing.assert_close(basis.T @ basis, torch.eye(5), atol=1e-5, rtol=0)
    torch.testing.assert_close(basis @ basis.T, frame[:, :5] @ frame[:, :5].T, atol=1e-5, rtol=0)
    assert avoid_basis(task, torch.zeros(D, 0)).shape == (D, 3)


def test_search_starts_from_unit_norm_columns(planted):
    a = initial_coordinates(12, 3, seed=4)
    torch.testing.assert_close(a.norm(dim=0), torch.ones(3, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(a, initial_coordinates(12, 3, seed=4), atol=0, rtol=0)
    assert not torch.allclose(a, initial_coordinates(12, 3, seed=5))


def test_the_kept_direction_is_the_moving_average_of_the_raw_parameter_by_hand(planted):
    """The study's ``optimal_orth.py`` loop written out on the planted readout: Adam (lr 0.01) ascends
    the loss under the ablation by V = QR(C A), A's gradient clipped at norm 1; the moving average
    (0.995) of the raw A starts at A_0 and follows each step, no bias correction; V is QR(C times
    the average at the best smoothed loss). An average of the orthonormalised iterates, or a
    bias-corrected one, keeps another V."""
    model, avoid, _, loss_fn, _ = planted
    result = orthogonal_searches(model, searching(model, loss_fn), [(SITE, avoid, 1)], steps=80, seed=3)[0]

    w = model.readout.weight.detach()[0]
    C = complement_basis(avoid.double())
    a = initial_coordinates(D - 4, 1, seed=3).float().requires_grad_(True)
    opt = torch.optim.Adam([a], lr=0.01)
    average = a.detach().double().clone()
    kept, best, smoothed, stale, losses = average, -float("inf"), None, 0, []
    for step in range(80):
        v = torch.linalg.qr(C.float() @ a)[0]
        h = torch.randn(STUDY.search_batch, T, D, generator=generator(0, step, "search"))
        loss = (((h - h @ v @ v.T) @ w - h @ w) ** 2).mean()
        opt.zero_grad()
        (-loss).backward()
        torch.nn.utils.clip_grad_norm_([a], 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        average = 0.995 * average + 0.005 * a.detach().double()
        smoothed = losses[-1] if smoothed is None else 0.1 * losses[-1] + 0.9 * smoothed
        if smoothed > best:
            kept, best, stale = average, smoothed, 0
        else:
            stale += 1
            if stale >= 30:
                break
    by_hand = torch.linalg.qr(C @ kept)[0]
    assert result.steps == len(losses)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(losses), atol=1e-5, rtol=1e-5)
    assert abs(float(result.directions[:, 0].double() @ by_hand[:, 0])) > 1 - 1e-6


def test_the_rank_curve_recovers_the_planted_dimensions():
    """The rank curve of the dual analysis repeats the search for r = 1, 2, ...: with three outputs
    reading three free directions with weights 3, 2, 1, ablating the rank-r V costs the top r of
    (9, 4, 1) in squared error (closed form ||V^T W||_F^2), and a fourth direction adds nothing.
    At lr 0.1 the iterates settle within a few steps, and with a short moving average (0.5, where
    the protocol's 0.995 lags far behind, ``test_search_moves_toward_the_planted_direction``) the
    kept V is the settled one."""
    frame = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(1)))[0]
    avoid = frame[:, :4]
    W = frame[:, 4:7] * torch.tensor([3.0, 2.0, 1.0])  # [D, 3]: one output per planted direction

    class ThreeReadouts(nn.Module):
        def __init__(self):
            super().__init__()
            self.state = HookPoint()

        def site(self, layer: int, name: str) -> HookPoint:
            return self.state

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.state(h) @ W

    def loss_fn(m: nn.Module, step: int) -> torch.Tensor:
        h = torch.randn(STUDY.search_batch, T, D, generator=generator(1, step, "rank"))
        return ((m(h) - h @ W) ** 2).sum(-1).mean()

    costs = []
    for rank in range(1, 5):
        model = ThreeReadouts()
        v = orthogonal_searches(model, searching(model, loss_fn), [(SITE, avoid, rank)], lr=0.1, average=0.5)[
            0
        ].directions
        costs.append(float(((v.T @ W) ** 2).sum()))
    assert costs == pytest.approx([9.0, 13.0, 14.0, 14.0], rel=0.05)


def test_searches_in_lockstep_are_the_searches_alone(planted):
    """Several searches over one stream of batches: each result is what it is alone, though they
    stop at different steps, and each step's batch is asked for by the searches in turn."""
    model, avoid, u, loss_fn, seen = planted
    blind = torch.cat(
        [avoid, u[:, None]], 1
    )  # nothing left to ablate that the readout sees: a flat loss, stopped early
    searches = [(SITE, avoid, 1), (SITE, blind, 3), (SITE, avoid[:, :2], 2)]
    together = orthogonal_searches(model, searching(model, loss_fn), searches, steps=60, patience=5)
    assert together[1].steps < 30 < together[2].steps and together[0].steps == 60
    order = list(seen)
    for search, result in zip(searches, together):
        alone = orthogonal_searches(model, searching(model, loss_fn), [search], steps=60, patience=5)[0]
        assert torch.equal(result.directions, alone.directions) and result.losses == alone.losses
    assert order == sorted(order)  # lockstep: every search still running reads step s before any reads s + 1


def test_a_search_from_cached_layer_streams_equals_the_whole_model_search():
    """The dual analysis runs each search step from the stream entering the searched layer, kept
    once per batch for every search; V and the losses equal those of whole forward passes."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(n_layers=3, d_model=16, n_heads=2, d_mlp=32, max_len=12), vocab_size=5).eval()
    family = make("dice", vocab_size=5, majors="prior")
    batches = {step: family.sample_ood(STUDY.search_batch, 12, 0, step, "search") for step in range(15)}
    streams = {step: LayerStreams(model, batch.tokens) for step, batch in batches.items()}
    searches = [((layer, "resid_mid"), avoid_basis(torch.eye(16)[:, layer : layer + 2]), 2) for layer in range(3)]

    def whole(step, site):
        return family.training_loss(model, batches[step])

    def cached(step, site):
        return family.training_loss(streams[step].model_from(site), batches[step])

    for plain, reused in zip(
        orthogonal_searches(model, whole, searches, steps=15), orthogonal_searches(model, cached, searches, steps=15)
    ):
        torch.testing.assert_close(reused.directions, plain.directions, atol=1e-5, rtol=0)
        assert reused.losses == pytest.approx(plain.losses, abs=1e-5)
    assert all(
        sorted(s.streams) == [0, 1, 2] for s in streams.values()
    )  # each prefix computed once, to the deepest search
