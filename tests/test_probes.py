"""Linear probes: the ridge fit against numpy least squares, scores against closed forms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from taskgeom.analysis.measures.linear_probes import _split, linear_probe, ridge
from taskgeom.rng import generator

torch.set_num_threads(1)


def test_ridge_without_penalty_is_least_squares():
    gen = generator(0, 0, "t")
    x = torch.randn(200, 5, generator=gen, dtype=torch.float64)
    y = torch.randn(200, 2, generator=gen, dtype=torch.float64)
    weights, bias = ridge(x, y, 0.0)
    design = np.hstack([x.numpy(), np.ones((200, 1))])
    expected = np.linalg.lstsq(design, y.numpy(), rcond=None)[0]
    np.testing.assert_allclose(weights.numpy(), expected[:5], atol=1e-10)
    np.testing.assert_allclose(bias.numpy(), expected[5], atol=1e-10)


def test_regression_r2_matches_signal_share_and_control_is_near_zero():
    """y = x.w + noise with var(x.w) = 4 and noise variance 1: the population R^2 is 0.8."""
    gen = generator(1, 0, "t")
    x = torch.randn(20_000, 8, generator=gen, dtype=torch.float64)
    w = torch.zeros(8, dtype=torch.float64)
    w[:4] = 1.0
    y = x @ w + torch.randn(20_000, generator=gen, dtype=torch.float64)
    result = linear_probe(x, y, "regression")
    assert result.metric == "r2"
    assert result.score == pytest.approx(0.8, abs=0.01)
    assert abs(result.control) < 0.01


def test_classification_accuracy_matches_closed_form():
    """Labels are the sign of x_0 + noise with noise sd 1: the best linear rule (sign of x_0) is
    right with probability 1/2 + arctan(1)/pi = 0.75; shuffled labels give chance, 0.5."""
    gen = generator(2, 0, "t")
    x = torch.randn(40_000, 3, generator=gen, dtype=torch.float64)
    labels = (x[:, 0] + torch.randn(40_000, generator=gen, dtype=torch.float64) > 0).long()
    result = linear_probe(x, labels, "classification")
    assert result.metric == "accuracy"
    assert result.score == pytest.approx(0.75, abs=0.01)
    assert result.control == pytest.approx(0.5, abs=0.015)


def test_split_keeps_groups_together():
    groups = torch.arange(100).repeat_interleave(7)
    test = _split(groups, 0.25, generator(3, 0, "t"))
    per_group = test.view(100, 7)
    assert (per_group.all(1) | (~per_group).all(1)).all()
    assert per_group[:, 0].sum() == 25


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="kind"):
        linear_probe(torch.zeros(4, 2), torch.zeros(4), "ranking")
    with pytest.raises(ValueError, match="samples"):
        linear_probe(torch.zeros(4, 2), torch.zeros(5), "regression")
