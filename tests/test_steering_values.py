"""Causal steering against values computed by hand: the KL of one next-token law to another, the
target mixture of the readout, what ``steer`` measures on a real model, and the ratio of medians
that the steering claim reads."""

from __future__ import annotations

import math

import pytest
import torch

from taskgeom.analysis.retrieval import steering_rows
from taskgeom.analysis.steering import AdditiveCode, Steering, TokenReadout, dirichlet_points, kl_rows, steer
from taskgeom.config import ModelConfig
from taskgeom.hooks import intervene
from taskgeom.model import Transformer
from taskgeom.tasks import make


def kl_by_hand(p: list[float], q: list[float]) -> float:
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


def test_kl_rows_is_kl_of_the_model_to_the_target():
    p, q = [0.7, 0.2, 0.1], [0.2, 0.3, 0.5]
    kl = kl_rows(torch.tensor(p).log(), torch.tensor(q))
    assert kl.dtype == torch.float64
    assert float(kl) == pytest.approx(0.7 * math.log(0.7 / 0.2) + 0.2 * math.log(0.2 / 0.3) + 0.1 * math.log(0.1 / 0.5), rel=1e-6)
    assert float(kl) != pytest.approx(kl_by_hand(q, p), rel=1e-3)  # not the reverse direction
    # batched over leading dimensions, zero for equal laws, large but finite where the target has no mass
    logp = torch.log_softmax(torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64), -1)
    target = logp.exp().clone()
    target[1, 2] = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    kl = kl_rows(logp, target)
    assert kl.shape == (2, 3)
    for b in range(2):
        for t in range(3):
            if (b, t) != (1, 2):
                assert float(kl[b, t]) == pytest.approx(0.0, abs=1e-12)
    assert math.isfinite(kl[1, 2]) and kl[1, 2] > 100


@pytest.mark.parametrize("family", ["dice", "markov"])
def test_token_readout_measures_kl_to_the_mixture_of_the_tasks_predictions(family):
    """The target is sum_k a_k p_k(next | context): for dice the mixed face probabilities, for
    markov the mixed rows of the current state; only the positions ``late`` are read."""
    V, K, B, T = 3, 2, 2, 5
    fam = make(family, vocab_size=V)
    gen = torch.Generator().manual_seed(1)
    pool = fam.sample_pool(K, 0, seed=3)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    a = torch.tensor([[0.25, 0.75], [1.0, 0.0]], dtype=torch.float64)
    out = torch.randn(B, T, V, generator=gen)
    late = slice(3, 5)
    kl = TokenReadout(fam, tokens, pool.params).distance(a, late)(out)
    assert kl.shape == (B, 2)
    params = pool.params.tolist()
    for b in range(B):
        for i, t in enumerate(range(3, 5)):
            if family == "dice":
                target = [sum(a[b, k].item() * params[k][v] for k in range(K)) for v in range(V)]
            else:
                target = [sum(a[b, k].item() * params[k][tokens[b, t]][v] for k in range(K)) for v in range(V)]
            model = torch.softmax(out[b, t].double(), -1).tolist()
            assert float(kl[b, i]) == pytest.approx(kl_by_hand(model, target), rel=1e-6), (b, t)


def test_steer_measures_the_model_with_and_without_the_edit_against_the_same_target():
    """On a small transformer: ``unsteered`` is the KL of the plain model's next-token law to the
    target mixture of the drawn ``a``; ``steered`` that of the model whose resid_mid at the late
    positions is replaced by h - P h + P (sum_k a_k centre_k + token[x_t]), applied here by hand."""
    V, K, D, B, T = 4, 3, 16, 6, 10
    torch.manual_seed(0)
    model = Transformer(ModelConfig(n_layers=2, d_model=D, n_heads=2, d_mlp=32, max_len=T), V).eval()
    fam = make("dice", vocab_size=V, majors="prior")
    pool = fam.sample_pool(K, 0, seed=0)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    basis = torch.linalg.qr(torch.randn(D, K - 1, generator=gen))[0]
    code = AdditiveCode(torch.randn(K, D, generator=gen), torch.randn(V, D, generator=gen))
    late, site = slice(7, 10), (1, "resid_mid")
    a = dirichlet_points(B, K, torch.Generator().manual_seed(5))
    result = steer(model, TokenReadout(fam, tokens, pool.params), tokens, tokens[:, late], site, late, late, basis.double(), code, a,
                   torch.Generator().manual_seed(5))
    a = result.a
    assert a.shape == (B, K) and torch.allclose(a.sum(-1), torch.ones(B, dtype=torch.float64)) and (a >= 0).all()
    params = pool.params.tolist()
    target = [[sum(a[b, k].item() * params[k][v] for k in range(K)) for v in range(V)] for b in range(B)]
    projector = basis @ basis.T

    def by_hand(h: torch.Tensor) -> torch.Tensor:  # [B, 3, D]
        wanted = (a.float() @ code.centre)[:, None] + code.token[tokens[:, late]]
        return h - h @ projector + wanted @ projector

    with torch.no_grad():
        plain = torch.softmax(model(tokens).double(), -1)
        with intervene(model, site, by_hand, late):
            edited = torch.softmax(model(tokens).double(), -1)
    for b in range(B):
        for i, t in enumerate(range(7, 10)):
            assert float(result.unsteered[b, i]) == pytest.approx(kl_by_hand(plain[b, t].tolist(), target[b]), rel=1e-5, abs=1e-9)
            assert float(result.steered[b, i]) == pytest.approx(kl_by_hand(edited[b, t].tolist(), target[b]), rel=1e-4, abs=1e-7)
    assert not torch.allclose(result.steered, result.unsteered)
    assert result.random.shape == result.steered.shape and not torch.allclose(result.random, result.steered)


def test_steering_rows_are_medians_with_quartile_bands_and_the_ratio_of_medians():
    """Five values each, so that medians and quartiles are values of the data: the ratio is
    median(unsteered) / median(steered) = 0.5 / 0.04, neither the median of the ratios (15) nor
    the ratio of means (7.8)."""
    unsteered = torch.tensor([[0.9, 0.1, 0.5, 0.7, 0.3]], dtype=torch.float64)
    steered = torch.tensor([[0.01, 0.2, 0.05, 0.04, 0.02]], dtype=torch.float64)
    random = torch.tensor([[0.6, 0.8, 0.4, 1.0, 0.2]], dtype=torch.float64)
    rows = steering_rows((1, "resid_mid"), Steering(torch.full((1, 3), 1 / 3), unsteered, steered, random))
    by_metric = {r["metric"]: r for r in rows}
    assert list(by_metric) == ["steering.kl_unsteered", "steering.kl_steered", "steering.kl_random", "steering.ratio"]
    expected = {"steering.kl_unsteered": (0.5, [0.3, 0.7]), "steering.kl_steered": (0.04, [0.02, 0.05]),
                "steering.kl_random": (0.6, [0.4, 0.8]), "steering.ratio": (12.5, None)}
    for metric, (value, band) in expected.items():
        row = by_metric[metric]
        assert row["value"] == pytest.approx(value, rel=1e-12), metric
        assert row["band"] == (band if band is None else pytest.approx(band, rel=1e-12)), metric
        assert (row["batch"], row["layer"], row["site"], row["position"], row["task"]) == ("measure", 1, "resid_mid", None, None)
    sq = steering_rows((0, "resid_post"), Steering(torch.full((1, 3), 1 / 3), unsteered, steered, random, measure="sq"))
    assert [r["metric"] for r in sq] == ["steering.sq_unsteered", "steering.sq_steered", "steering.sq_random", "steering.ratio"]
    assert sq[-1]["value"] == pytest.approx(12.5, rel=1e-12)
