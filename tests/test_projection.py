"""Projection R^2 as the study's Fig. 4 measures it (``analysis.projection``): the statistic of a
trained model against a plain-numpy loop over tasks, the linear-code reference of E1 against a
hand computation, and the sampler of whole tasks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_config

from taskgeom.analysis.measures.variants import protocol
from taskgeom.analysis.reading import projection
from taskgeom.analysis.reading.heldout import sample_tasks
from taskgeom.errors import AnalysisError
from taskgeom.hooks import capture
from taskgeom.tasks import Batch
from taskgeom.tasks.base import TaskFamily
from taskgeom.tasks.dice import Dice
from taskgeom.tasks.markov import Markov
from taskgeom.tasks.regression import Regression


def numpy_fig4(ood: list[np.ndarray], major: list[np.ndarray], positions: range) -> np.ndarray:
    """[J] by the definition, one task and one position at a time: ood, major: each task's states [n, T, D]."""
    ood_means, major_means = [x.mean(0) for x in ood], [x.mean(0) for x in major]
    mu = np.mean(major_means, axis=0)  # [T, D]
    regressors = np.mean([(m - mu)[list(positions)] for m in major_means], axis=1)  # [K, D], the block's mean
    scores = []
    for mean in ood_means:
        per_position = []
        for t in positions:
            x = mean[t] - mu[t]
            coef, *_ = np.linalg.lstsq(regressors.T, x, rcond=None)  # no intercept; the K means span rank K - 1
            residual = x - regressors.T @ coef
            per_position.append(np.clip(1 - residual @ residual / ((x - x.mean()) ** 2).sum(), 0, 1))
        scores.append(np.mean(per_position))
    return np.array(scores)


def test_a_trained_models_projection_r2_is_the_numpy_loop_over_tasks(tmp_path, monkeypatch):
    from taskgeom.analysis.study import StudyRun
    from taskgeom.runs.folders import Run
    from taskgeom.training.train import train

    config = tiny_config("dice", steps=10)
    run = Run.create(config, tmp_path)
    train(run, device="cpu")
    study = StudyRun(run)
    monkeypatch.setattr(projection, "CHUNK", 5)  # chunks that cut through tasks: the sums must not care
    ood, major = study.heldout_tasks("ood", 4, n_tasks=6), study.heldout_tasks("major", 3)
    measured = study.projection_r2(ood, major)
    place = projection.place(study.family, config.model.n_layers)
    assert measured.place == place == (0, "resid_post") and (measured.n_tasks, measured.per_task) == (6, 4)

    def states(tokens: torch.Tensor) -> np.ndarray:
        with capture(study.model, [place]) as store, torch.no_grad():
            study.model(tokens)
        return store[place].double().numpy()

    tokens = ood.batch.tokens
    T = tokens.shape[1]
    expected = numpy_fig4(
        [states(tokens[4 * j : 4 * j + 4]) for j in range(6)],
        [states(major.batch.tokens[major.batch.task == k]) for k in range(3)],
        range(T - 2),
    )  # E1: 0 .. T - 3
    np.testing.assert_allclose(measured.values.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert measured.mean == pytest.approx(expected.mean(), rel=1e-5)
    assert measured.quartiles == pytest.approx(np.quantile(expected, [0.25, 0.75]).tolist(), rel=1e-5)
    assert study.projection_r2(ood, major, protocol=protocol("protocol")).values.equal(measured.values)
    per_sequence = study.projection_r2(ood, major, protocol=protocol("per-sequence-r2"))
    assert per_sequence.statistic == "per-sequence" and per_sequence.values.shape == (
        24 * 4,
    )  # every state of the late quarter
    # a protocol whose changed fields projection R^2 does not read measures it as the study's
    assert study.projection_r2(ood, major, protocol=protocol("centred-S")).values.equal(measured.values)
    with pytest.raises(AnalysisError, match="OOD tasks against the major tasks"):
        study.projection_r2(major, ood)


def test_the_e1_linear_code_reference_is_the_hand_computation():
    """V = 4 faces, majors whose sequences start with faces 0, 1, 2; T = 3, so the block is position
    0 (E1's block: 0 .. T - 3), where the estimate is (1 + onehot(x_0)) / 5. The centred major means span {v: v_3 = 0, sum v
    = 0}. An OOD task whose sequences start with face 3 is centred to (-1/3, -1/3, -1/3, 1) / 5, whose
    projection is 0: R^2 = 0. One whose sequences start with faces 0 and 3 is centred to (1/6, -1/3,
    -1/3, 1/2) / 5, squared norm (1/2) / 25; its residual (-1/6, -1/6, -1/6, 1/2) / 5 has (1/3) / 25:
    R^2 = 1/3."""
    dice = Dice(4, 1.0, "prior", 0.0)
    params = torch.eye(4, dtype=torch.float64)  # only their identity matters: sequences sharing params are one task
    major = Batch(
        torch.tensor([[0, 1, 2], [0, 3, 0], [1, 1, 1], [1, 0, 3], [2, 2, 0], [2, 3, 3]]),
        torch.tensor([0, 0, 1, 1, 2, 2]),
        params[[0, 0, 1, 1, 2, 2]],
    )
    ood = Batch(
        torch.tensor([[3, 0, 1], [0, 2, 2], [3, 3, 0], [3, 1, 3]]), torch.full((4,), -1), params[[3, 0, 3, 0]] + 1
    )
    reference = projection.reference(dice, ood, major)
    assert reference.values.tolist() == pytest.approx(
        [0.0, 1 / 3], abs=1e-12
    )  # the tasks in the order they first appear
    assert (reference.n_tasks, reference.per_task, reference.place, reference.mean) == (
        2,
        2,
        None,
        pytest.approx(1 / 6),
    )


def test_a_family_without_an_estimate_has_no_reference_and_says_why():
    class Plain(Dice):
        name = "plain"
        ood_estimate = TaskFamily.ood_estimate

    plain = Plain(4, 1.0, "prior", 0.0)
    assert "does not define ood_estimate" in projection.reference_unavailable(plain)
    assert projection.reference_unavailable(Dice(4, 1.0, "prior", 0.0)) is None
    batch = Batch(torch.zeros(2, 3, dtype=torch.long), torch.full((2,), -1), torch.ones(2, 4, dtype=torch.float64))
    with pytest.raises(
        AnalysisError, match="no linear-code reference: the 'plain' family does not define ood_estimate"
    ):
        projection.reference(plain, batch, batch)
    with pytest.raises(NotImplementedError):
        plain.ood_estimate(batch)


def test_the_markov_and_ridge_estimates_are_the_posterior_means():
    markov = Markov(3, 0.5)
    tokens = torch.tensor([[0, 1, 1, 2]])
    estimate = markov.ood_estimate(Batch(tokens, torch.tensor([-1]), torch.zeros(1, 3, 3))).view(1, 4, 3, 3)
    counts = torch.full((3, 3), 0.5, dtype=torch.float64)
    for a, b in ((0, 1), (1, 1), (1, 2)):
        counts[a, b] += 1
    assert torch.allclose(estimate[0, 3], counts / counts.sum(-1, keepdim=True))
    assert torch.allclose(
        markov.predict_ood(tokens)[0, 3], (counts / counts.sum(-1, keepdim=True))[2]
    )  # the current state's row
    regression = Regression(2, 0.5, "pair")
    batch = regression.make_batch(
        torch.ones(1, 2, dtype=torch.float64), torch.tensor([-1]), 8, torch.Generator().manual_seed(0)
    )
    x, y = batch.x[0], batch.y[0]
    w = torch.linalg.solve(x[:3].T @ x[:3] + 0.25 * torch.eye(2, dtype=torch.float64), x[:3].T @ y[:3])
    assert torch.allclose(regression.ood_estimate(batch)[0, 3], w) and regression.ood_estimate(batch)[0, 0].eq(0).all()


@pytest.mark.parametrize(
    "family",
    [Dice(6, 1.0, "prior", 0.0), Markov(4, 1.0), Regression(3, 0.5, "pair")],
    ids=["dice", "markov", "regression"],
)
def test_whole_tasks_are_drawn_per_task_as_a_pure_function_of_seed_and_stream(family):
    pool = family.sample_pool(3, 4, 0.1, seed=1)
    T = 8
    ood = sample_tasks(family, pool, "ood", 5, "projection", T, seed=0, n_tasks=4)
    assert ood.tokens.shape[0] == 20 and ood.task.eq(-1).all()
    params = ood.params.reshape(4, 5, -1)
    assert (
        params.eq(params[:, :1]).all() and len(torch.unique(params[:, 0], dim=0)) == 4
    )  # one task per group, four tasks
    assert not ood.tokens[0].equal(ood.tokens[1])  # the sequences of a task are drawn, not copied
    assert ood.tokens.equal(sample_tasks(family, pool, "ood", 5, "projection", T, seed=0, n_tasks=4).tokens)
    assert not ood.tokens.equal(sample_tasks(family, pool, "ood", 5, "projection", T, seed=1, n_tasks=4).tokens)
    groups, n = projection.task_groups(ood)
    assert n == 4 and projection.task_sizes(ood) == (4, 5)
    major = sample_tasks(family, pool, "major", 5, "projection", T, seed=0)
    assert major.task.tolist() == [k for k in range(3) for _ in range(5)]
    assert major.params.equal(pool.params[major.task])
    if isinstance(family, Regression):  # paired: every major task reads the same x sequences
        assert major.x[:5].equal(major.x[5:10])
    with pytest.raises(AnalysisError, match="major set has 3 tasks, not 2"):
        sample_tasks(family, pool, "major", 5, "projection", T, seed=0, n_tasks=2)
    with pytest.raises(AnalysisError, match="split 'prior' has no major sequences"):
        sample_tasks(family, pool, "major", 5, "prior", T, seed=0)
